"""``OpSlot``: the one object the engine puts in a cell's op slot in place of the op, with up to four roles.

An op slot is an instance attribute holding a Primitive or a function, or an item of a dict a cell holds
(``_prims["AllGather"]``, a ``_comm_ops`` entry or the ``'fn'`` of MindFormers' ``{'fn': fn, 'domain': d}``). Each
mechanism acting on an op there is a role of one ``OpSlot``, set and cleared independently, so none wraps another by
hand: **track** (``mac_paths``: the slot's path under each path tracker's root, pushed on the run's ``attrs`` for a
policy's ``ctx.attr_path`` and for keep sites), **keep** (``mac_keep``: a light run that keeps this slot hands the call
to ``LightRegion.keep_call``), **dropout** (``mac_dropout``: an ``nn.Dropout`` kernel, handed to the running region)
and **output** (``mac_output``: output recompute of the op). A call goes through the roles in that order and ends in
the op.
"""
import copy

from mindspore import nn
from mindspore.ops import Primitive

from .state import ENGINE


class OpSlot:
    """Stands in an op slot for the callable ``mac_inner`` (see the module docstring for the roles)."""

    def __init__(self, inner):
        self.mac_inner = inner
        self.mac_paths = {}
        self.mac_keep = self.mac_output = None
        self.mac_dropout = 0

    def __call__(self, *args, **kwargs):
        run = ENGINE.top()
        if run is None:
            return self.call_op(args, kwargs)
        path = self.mac_paths.get(run.tracker) if self.mac_paths else None
        if path is not None:
            run.attrs.append((self, path))
        try:
            if self.mac_keep is not None and run.keeps is not None and self in run.keeps:
                return run.region.keep_call(run, self, args, kwargs)
            if self.mac_dropout:
                return run.region.dropout_call(run, self.mac_inner, *args)
            return self.call_op(args, kwargs)
        finally:
            if path is not None:
                run.attrs.pop()

    def call_op(self, args, kwargs):
        """The op itself, through output recompute when that role is set."""
        target = self.mac_output
        if target is not None:
            return target.observe(args, kwargs, lambda: self.mac_inner(*args, **kwargs))
        return self.mac_inner(*args, **kwargs)

    def __getattr__(self, name):   # only for names the slot lacks: the op's attributes stay reachable
        return getattr(self.__dict__["mac_inner"], name)

    def __deepcopy__(self, memo):   # a copied cell gets the plain op (see construct_patch)
        return copy.deepcopy(self.mac_inner, memo)


def slot_at(holder, key):
    """The ``OpSlot`` in ``holder``'s op slot ``key`` (a cell and an attribute name, or a dict and a key), put there
    around the op if there is none yet."""
    table = holder if isinstance(holder, dict) else vars(holder)
    current = table[key] if key in table else getattr(holder, key)
    if isinstance(current, OpSlot):
        return current
    slot = OpSlot(current)
    if isinstance(holder, dict):
        holder[key] = slot
    else:
        object.__setattr__(holder, key, slot)   # an instance attribute: the cell tree is unchanged
    return slot


def release(holder, key, slot):
    """Put the plain op back in ``holder``'s slot ``key`` once ``slot`` has no role left (a slot someone replaced
    since is left as they set it)."""
    table = holder if isinstance(holder, dict) else vars(holder)
    if slot.mac_paths or slot.mac_keep is not None or slot.mac_output is not None or slot.mac_dropout > 0 \
            or table.get(key) is not slot:
        return
    if isinstance(holder, dict):
        holder[key] = slot.mac_inner
    else:
        object.__setattr__(holder, key, slot.mac_inner)


def install_dropout_slots(root):
    """The dropout role on the kernel slot of every ``nn.Dropout`` under ``root``; returns an undo callable.

    The light path intercepts no op, yet a Dropout must never be run again in a recompute (it would draw another
    mask): the slot hands its kernel call to the innermost running region (``dropout_call`` of either path,
    ``rerun.RegionBase.keep_dropout``). A cell whose ``dropout`` is not the plain ``Dropout`` primitive (replaced by
    the user or another tool) is left alone: its kernel goes through the dispatch only, and the region stays
    intercepted.
    """
    slots = []
    for _, cell in root.cells_and_names():
        if not isinstance(cell, nn.Dropout):
            continue
        current = cell.__dict__.get("dropout")
        inner = current.mac_inner if isinstance(current, OpSlot) else current
        if not (isinstance(inner, Primitive) and inner.name == "Dropout"):
            continue
        slot = slot_at(cell, "dropout")
        slot.mac_dropout += 1
        slots.append((cell, slot))

    def remove():
        for cell, slot in slots:
            slot.mac_dropout -= 1
            release(cell, "dropout", slot)
        slots.clear()
    return remove
