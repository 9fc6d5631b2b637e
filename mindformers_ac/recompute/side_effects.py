"""What a region's forward writes, one model for every path (rules W1-W7 of docs/exactness.md; why and at what cost:
its "Stateful ops").

Ops that write an argument (W1) run in the re-run on copies of what they write (``StateSnapshot``; all of a legacy
op's Parameter arguments, which its signature can't tell apart), or keep their outputs when those copies would cost
more (``KEEP``). Parameters rebound without an op are ``ReboundParameters`` (W4), seen through the ``RebindSlot``
put on each Parameter once per wrapper; a light re-run's late writes to buffers are undone by ``BufferGuard``.
"""
import contextlib
import functools
import weakref

from mindspore import Parameter, Tensor, ops
from mindspore.ops import Primitive

from ..mindspore_compat import no_grad
from ..precision import no_casts
from ..tensors import is_tracked, param_ptrs, tensor_leaves_in_objects
from .state import ENGINE

SNAPSHOT, KEEP = "snapshot", "keep"


def is_side_effect_op(args):
    """True for a legacy op (dispatched as ``(primitive, name, (inputs...))``) whose primitive writes memory
    (``side_effect_mem``); other ops cost one isinstance check."""
    return bool(args) and isinstance(args[0], Primitive) and getattr(args[0], "side_effect_mem", False) is True


# Ops that write their first input, by name (pyboost ops are dispatched without their primitive):
# in-place ops (``copy_``, ``masked_fill_`` ...), ``ops.assign*`` and ``Scatter*`` updates, and the
# collectives of ``mint.distributed``, which write their tensor (``all_reduce``) or output in place (rule W1).
_WRITES_FIRST = ("Inplace", "InnerInplace", "Assign", "Scatter", "DistComm")


def first_input(args):
    """The first input of a dispatched op: ``args[0]``, or a legacy op's ``(prim, name, (inputs...))`` first."""
    if is_side_effect_op(args) or (len(args) == 3 and isinstance(args[0], Primitive) and isinstance(args[2], tuple)):
        return args[2][0] if args[2] else None
    return args[0] if args else None


def writes_first_input(name, args):
    """True for an op that writes its first input, a tensor, in place (see ``_WRITES_FIRST``)."""
    return name.startswith(_WRITES_FIRST) and isinstance(first_input(args), Tensor)


def may_write(name, args):
    """Cheap pre-check, per op in forward, before ``written_slots``: a marked primitive or a writer by name."""
    return is_side_effect_op(args) or name.startswith(_WRITES_FIRST)


def written_tensors(name, args):
    """The tensors op ``name`` may write: a ``side_effect_mem`` primitive's Parameter arguments, and a writer's
    first input (a tensor, or the tensors of a list of outputs)."""
    found = [_item(args, pos) for pos in written_slots(name, args, ())] if is_side_effect_op(args) else []
    if name.startswith(_WRITES_FIRST):
        first = first_input(args)
        items = [first] if isinstance(first, Tensor) else list(first) if isinstance(first, (tuple, list)) else []
        found += [t for t in items if isinstance(t, Tensor) and all(t is not f for f in found)]
    return found


def _item(args, pos):
    return args[pos[0]] if len(pos) == 1 else args[pos[0]][pos[1]]


def _positions(args):
    """``(position, value)`` of each argument, and of each item of a tuple or list one: ``(i,)`` / ``(i, j)``."""
    for i, a in enumerate(args):
        if isinstance(a, (tuple, list)):
            yield from (((i, j), b) for j, b in enumerate(a))
        else:
            yield (i,), a


def written_slots(name, args, param_ptrs):
    """Positions (``(i,)`` or ``(i, j)`` in a legacy op's input tuple) of the tensors an op may write: a
    ``side_effect_mem`` primitive's Parameter arguments, a writer's by name first one when it is in ``param_ptrs``."""
    if is_side_effect_op(args):
        return [pos for pos, a in _positions(args) if isinstance(a, Parameter)]
    if name.startswith(_WRITES_FIRST) and args and isinstance(args[0], Tensor) and args[0].data_ptr() in param_ptrs:
        return [(0,)]
    return []


# A write's copies of at most this many bytes are always taken (SNAPSHOT): held until backward, they cost
# less than one activation of the smallest benchmark shape (batch 2 x seq 32 x hidden 64 floats, 16 KiB),
# and a kept output would refuse an exact pattern (a re-run op that reads the tensor before the write).
SMALL_COPY_BYTES = 16 * 1024


def choose_handling(args, slots):
    """SNAPSHOT when the written tensors are at most ``SMALL_COPY_BYTES`` or no larger than the op's other tensor
    inputs; KEEP the op's outputs otherwise (a ScatterUpdate into an embedding table)."""
    written = {id(_item(args, pos)) for pos in slots}
    param_bytes = sum(int(_item(args, pos).nbytes) for pos in slots)
    if param_bytes <= SMALL_COPY_BYTES:
        return SNAPSHOT
    other_bytes = sum(int(b.nbytes) for _, b in _positions(args) if isinstance(b, Tensor) and id(b) not in written)
    return SNAPSHOT if param_bytes <= other_bytes else KEEP


def slot_ptrs(args, slots):
    return [_item(args, pos).data_ptr() for pos in slots]


def replace_at(args, replacements):
    """``args`` with the values at the positions of ``{position: value}`` replaced."""
    out = list(args)
    nested = {}
    for pos, value in replacements.items():
        if len(pos) == 1:
            out[pos[0]] = value
        else:
            nested.setdefault(pos[0], list(args[pos[0]]))[pos[1]] = value
    for i, items in nested.items():
        out[i] = type(args[i])(items)
    return tuple(out)


class StateSnapshot:
    """The tensors a side-effect op may write, copied before its forward call (``ptrs``: theirs, by which the
    recompute recognises reads of them by other ops). A fresh copy per re-run requires grad exactly when the original
    was tracked, so the op saves the same tensors as in forward."""

    __slots__ = ("slots", "ptrs", "copies", "tracked", "nbytes", "buffers", "live")

    def __init__(self, args, slots):
        self.slots = list(slots)
        items = [_item(args, pos) for pos in self.slots]
        self.ptrs = slot_ptrs(args, self.slots)
        # the written non-trainable Parameters (None elsewhere): the re-run writes them for real, from their
        # value before the forward (``buffers_as_before``), so that reads no op dispatches (``self.hist[0]``,
        # a view) see what the forward saw before and after the write
        self.buffers = [t if isinstance(t, Parameter) and not t.requires_grad else None for t in items]
        self.live = False   # inside buffers_as_before: the buffers hold their pre-forward values
        self.tracked = [is_tracked(t) for t in items]
        with no_grad():   # a copy, not part of the graph
            self.copies = [ops.deepcopy(t) for t in items]
        self.nbytes = sum(int(c.nbytes) for c in self.copies)

    def fresh(self, k):
        with no_grad():
            c = ops.deepcopy(self.copies[k])
        if self.tracked[k]:
            c.requires_grad_()
        return c

    def args_for_rerun(self, args, state):
        """``args`` with the written tensors replaced by fresh copies, recorded in ``state`` (ptr -> copy)."""
        replacements = {}
        for k, pos in enumerate(self.slots):
            if self.live and self.buffers[k] is not None:   # a replay inside a parent's re-run writes copies
                state[self.ptrs[k]] = self.buffers[k]   # later reads get it as written (buffers_as_before)
                continue
            c = self.fresh(k)
            state[self.ptrs[k]] = c
            replacements[pos] = c
        return replace_at(args, replacements)


def read_slots(args, ptrs):
    """``[(position, data_ptr, tensor)]`` of an op's tensor arguments whose storage pointer is in ``ptrs``."""
    return [(pos, t.data_ptr(), t) for pos, t in _positions(args) if isinstance(t, Tensor) and t.data_ptr() in ptrs]


@contextlib.contextmanager
def buffers_as_before(snapshots):
    """Around a re-run (outside its graph): the buffers the forward wrote by an op (``StateSnapshot.buffers``) hold,
    in place, their values from before the forward's first write, and afterwards what they held before the re-run;
    so the re-run's write lands in them and is undone, and every read sees the forward's values (rule W1)."""
    first = {}
    snapshots = list(snapshots)
    for snapshot in snapshots:   # in op order: the first write's copy is the value before the forward
        for b, c in zip(snapshot.buffers, snapshot.copies):
            if b is not None:
                first.setdefault(id(b), (b, c))
    if not first:
        yield
        return
    with no_grad(), no_casts():
        current = [(b, ops.deepcopy(b)) for b, _ in first.values()]
        for b, c in first.values():
            ops.assign(b, c)   # in place: reads of its storage (views) see it
    for snapshot in snapshots:
        snapshot.live = True
    try:
        yield
    finally:
        for snapshot in snapshots:
            snapshot.live = False
        with no_grad(), no_casts():
            for b, c in current:
                ops.assign(b, c)


class BufferGuard:
    """Copies of a region's non-trainable Parameters (its buffers) taken before a light re-run, whose
    ``restore_if_written`` undoes a write its checking call did not show (docs/exactness.md, "The light path": a
    late write is undone)."""

    __slots__ = ("params", "copies")

    def __init__(self, params):
        self.params = params
        with no_grad():
            self.copies = [ops.deepcopy(p) for p in params]

    def restore_if_written(self):
        """Put back every buffer the re-run changed; returns whether any was."""
        written = [(p, c) for p, c in zip(self.params, self.copies) if p.asnumpy().tobytes() != c.asnumpy().tobytes()]
        with no_grad():
            for p, c in written:
                ops.assign(p, c)   # in place: the Parameter keeps its storage
        return bool(written)


class RebindSlot:
    """Stands in a Parameter's ``set_data`` or ``assign_value`` (an instance attribute, put there once per wrapper
    by ``RebindSlots``): a call made while region forwards run on the engine stack is shown first to each of them
    that watches the Parameter (``ReboundParameters.note``), as ``op_slot.OpSlot`` routes an op; else it is the
    method itself. A deep copy or a pickle of the Parameter leaves it behind (a copied model wraps its own)."""

    __slots__ = ("param", "method", "users")

    def __init__(self, param, method):
        self.param, self.method, self.users = weakref.ref(param), method, 0

    def __call__(self, *args, **kwargs):
        p = self.param()
        call = functools.partial(getattr(type(p), self.method), p)
        watchers = [run.region.replaced for run in ENGINE.forward_runs()
                    if run.region.replaced is not None and id(p) in run.region.replaced.watched]
        if not watchers:
            return call(*args, **kwargs)
        old = param_ptrs((p,))
        for watcher in watchers:
            watcher.note(p)
        result = call(*args, **kwargs)
        new = param_ptrs((p,))
        for watcher in watchers:
            if watcher.moved is not None:
                watcher.moved(old, new)
        return result


class RebindSlots:
    """The ``RebindSlot`` s one wrapper (or one ``checkpoint`` call) put on Parameters, each once; ``remove`` takes
    them off (a slot shared with another wrapper stays until its last user goes)."""

    __slots__ = ("covered",)

    METHODS = ("set_data", "assign_value")

    def __init__(self):
        self.covered = {}   # id(Parameter) -> weak reference to it

    def cover(self, params):
        for p in params:
            if id(p) in self.covered and self.covered[id(p)]() is p:
                continue
            self.covered[id(p)] = weakref.ref(p)
            for method in self.METHODS:
                slot = p.__dict__.get(method)
                if not isinstance(slot, RebindSlot):
                    slot = p.__dict__[method] = RebindSlot(p, method)
                slot.users += 1

    def remove(self):
        for ref in self.covered.values():
            p = ref()
            for method in self.METHODS if p is not None else ():
                slot = p.__dict__.get(method)
                if isinstance(slot, RebindSlot):
                    slot.users -= 1
                    if slot.users <= 0:
                        del p.__dict__[method]
        self.covered.clear()


class ReboundParameters:
    """A region's Parameters whose storage its forward replaced (``set_data``, ``assign_value``: no op the dispatch
    sees), with their values from before: rule W4 of docs/exactness.md. ``slots``: the wrapper's ``RebindSlots``
    (None for a ``checkpoint`` call: its own, for the call); ``moved(old, new)``: told the storage pointers a
    rebinding freed and took (a freed address is reused by the next tensor, which is no Parameter: found by
    tests/program_generator.py)."""

    __slots__ = ("params", "slots", "watched", "before", "moved")

    def __init__(self, params, slots=None):
        self.params, self.slots, self.moved = params, slots, None   # the root's Parameters, trainable or not
        self.watched = frozenset()   # ids of the Parameters watched while the forward runs
        self.before = {}             # id -> (param, copy of its value before the forward rebound it), in order

    @contextlib.contextmanager
    def watch(self, args=()):
        """Around the forward: the root's Parameters and those handed to the region in ``args`` (a model's Parameter
        passed to every layer) are watched; the slots are put only on Parameters without one yet."""
        own = {id(p) for p in self.params}
        extra = [p for p in tensor_leaves_in_objects(args) if isinstance(p, Parameter) and id(p) not in own]
        slots = self.slots if self.slots is not None else RebindSlots()
        slots.cover(self.params)
        slots.cover(extra)
        self.watched = own.union(map(id, extra))
        try:
            yield
        finally:
            self.watched = frozenset()
            if slots is not self.slots:
                slots.remove()

    def note(self, p):
        """Before ``p`` is rebound in forward: its value, the first time."""
        if id(p) not in self.before:
            with ENGINE.top().engine_ops(), no_grad(), no_casts():   # the copy is no op of the region
                self.before[id(p)] = (p, ops.deepcopy(p))

    @contextlib.contextmanager
    def rerun_from(self):
        """Around the re-run (outside its graph): the rebound Parameters hold their pre-forward values, and what
        they held before the re-run afterwards."""
        if not self.before:
            yield
            return
        with no_grad(), no_casts():
            current = [(p, ops.deepcopy(p)) for p, _ in self.before.values()]
            for p, copy in self.before.values():
                type(p).set_data(p, ops.deepcopy(copy))   # fresh: the re-run may write it in place
        try:
            yield
        finally:
            for p, value in current:
                type(p).set_data(p, value)
