"""Where an op runs inside a region: the cell path and op attribute a ``policy_fn`` sees.

``PathTracker`` keeps ``cell_path`` (forward pre/post hooks on the root's sub-cells) and ``attr_path`` (the track
role of each op attribute's ``op_slot.OpSlot``) of the innermost running region on this thread; ``OpContext`` is
what the policy is handed per op.
"""
import contextlib

import mindspore as ms

from ..construct_patch import drop_on_copy, hold_copy_hook, release_copy_hook
from ..whitelist import COMM_OPS_REGISTRY, registry_slot
from .op_slot import release, slot_at
from .state import ENGINE


class OpContext:
    """What a ``policy_fn`` learns about the op being dispatched.

    ``op_name``: dispatched op name (``MatMulExt``, ``Softmax``, ``Dropout`` ...). ``cell_path``: dotted path of the
    innermost sub-cell running, relative to the region root ('' at the root). ``op_path``: ``cell_path + '.' +
    op_name``. ``attr_path``: path of the op attribute being called (e.g. ``self_attention.core_attention.bmm_qk``,
    ``mlp.activation_func`` for every op gelu runs), tracked for cell regions; otherwise a guess (the only Primitive
    or function attribute of the innermost cell named like the op), or None. ``is_recompute``: True in the
    backward-time re-run. ``op_index``: order in the region.
    """

    __slots__ = ("op_name", "cell_path", "is_recompute", "op_index", "_cell", "_attr_path")

    def __init__(self, op_name, cell_path, is_recompute, op_index, cell, attr_path=None):
        self.op_name, self.cell_path, self.is_recompute = op_name, cell_path, is_recompute
        self.op_index, self._cell, self._attr_path = op_index, cell, attr_path

    @property
    def op_path(self):
        return f"{self.cell_path}.{self.op_name}" if self.cell_path else self.op_name

    @property
    def attr_path(self):
        if self._attr_path is not None or self._cell is None:
            return self._attr_path
        want = _norm_op_name(self.op_name)
        found = []
        for attr, value in vars(self._cell).items():
            if attr.startswith("_") or not callable(value) or isinstance(value, ms.nn.Cell):
                continue
            name = getattr(value, "name", None) or getattr(value, "__name__", None)
            if isinstance(name, str) and _norm_op_name(name) == want:
                found.append(attr)
        if len(found) != 1:   # two attributes running the same op (bmm_qk, bmm_pv) can't be told apart by it
            return None
        return f"{self.cell_path}.{found[0]}" if self.cell_path else found[0]


def _norm_op_name(name):
    name = name.lower().replace("_", "")
    return name[:-3] if name.endswith("ext") else name


def is_op_attribute(value):
    """A cell attribute that runs ops when called: any callable (a Primitive, a function, a kernel wrapper, an
    ``OpSlot`` ...) but a Cell (a sub-cell is tracked as a cell), a class or a tensor."""
    return callable(value) and not isinstance(value, (ms.nn.Cell, type, ms.Tensor))


def _op_slots(cell):
    """``(holder, key, name)`` of every op slot of ``cell`` a path tracker tracks: its op attributes, and the ops of
    its ``_comm_ops`` registry that are not cells (MindFormers' ``{'fn': op}`` entries, named by their dotted slot
    name as the whitelist names them; a cell there runs its own ops)."""
    slots = [(cell, attr, attr) for attr, value in list(vars(cell).items())
             if not attr.startswith("_") and attr != "construct" and is_op_attribute(value)]
    registry = vars(cell).get(COMM_OPS_REGISTRY)
    if isinstance(registry, dict):
        for name in list(registry):
            holder, key = registry_slot(registry, name)
            if is_op_attribute(holder[key]):
                slots.append((holder, key, name))
    return slots


class PathTracker:
    """Maintains ``cell_path`` and ``attr_path`` of the running region for its policy (how: the module docstring).
    Its hooks and track roles act only when the innermost running region on this thread was created with this
    tracker, so nested regions and calls outside regions are left alone. ``remove()`` restores every attribute and
    hook."""

    def __init__(self, root):
        self.root = root
        self._handles = []
        self._hooked = []       # cells carrying our hooks (and a copy hook that leaves them out of a copy)
        self._attrs = []        # (holder: a cell or a registry dict, key, OpSlot)
        self.installed = False

    def install(self):
        if self.installed:
            return
        self.installed = True

        @drop_on_copy   # plain functions: a deep copy of a sub-cell must not keep our hooks
        def leave(cell, _args, _output):
            run = ENGINE.top()
            if run is not None and run.tracker is self and run.path and run.path[-1][1] is cell:
                run.path.pop()
        for name, cell in self.root.cells_and_names():
            if cell is not self.root and name:
                @drop_on_copy
                def enter(cell, _args, name=name):
                    run = ENGINE.top()
                    if run is not None and run.tracker is self:
                        run.path.append((name, cell))
                self._handles.append(cell.register_forward_pre_hook(enter))
                # No always_call: a call that raises ends its region run, and the path dies with it.
                self._handles.append(cell.register_forward_hook(leave))
                hold_copy_hook(cell)
                self._hooked.append(cell)
            for holder, key, attr in _op_slots(cell):
                slot = slot_at(holder, key)
                slot.mac_paths[self] = f"{name}.{attr}" if name else attr
                self._attrs.append((holder, key, slot))

    def remove(self):
        for h in self._handles:
            h.remove()
        for cell in self._hooked:
            release_copy_hook(cell)
        for holder, key, slot in reversed(self._attrs):
            slot.mac_paths.pop(self, None)
            release(holder, key, slot)   # someone may have replaced it since: leave theirs
        self._handles, self._hooked, self._attrs = [], [], []
        self.installed = False

    @contextlib.contextmanager
    def active(self):
        """Install for the duration of a run unless installed for good (by ``checkpoint_wrapper``)."""
        installed = self.installed
        self.install()
        try:
            yield
        finally:
            if not installed:
                self.remove()

