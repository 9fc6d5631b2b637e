"""Output recompute of one op attribute (MindFormers' ``output_recompute`` / ``recompute_comm``).

The op's own saves are tokens (``_OutputRecord.pack_inner``); the scope cell (normally the layer) runs under hooks
that recognise packs of the op's output (``_Scope._pack``); when the scope returns each call is settled
(``_settle``): dropped, keeping its inputs, only when that frees more bytes than the inputs cost, else kept as
without recompute, with a warning saying why. In backward a dropped call's first token re-runs the op once
(``_OutputRecord.rerun``), checked against the forward's saves. Why, and the limits: docs/exactness.md, "Output
recompute of one op".
"""
import logging
import weakref

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.utils import MsDispatchMode

from ..construct_patch import DROPPED, ConstructPatch, bracket_calls, find_patch
from ..ledger import ActivationLedger
from ..meter import CHAIN_PASSED
from ..mindspore_compat import no_grad
from ..mindspore_compat import pynative_executor as _executor
from ..precision import cell_precision, no_casts, under_precision
from ..tensors import detached, output_tensors, param_ptrs, storage_info, tensor_leaves_in_objects
from ..whitelist import registry_slot
from . import messages
from .dispatch import op_name_of
from .op_slot import OpSlot, release, slot_at
from .random_ops import is_random_op_name, is_unreplayable_random_op
from .rerun import SavedInput, keep_saved, map_inputs, recompute_graph, recompute_input
from .side_effects import may_write
from .state import ENGINE
from .stats import RecomputeStats

logger = logging.getLogger("mindformers_ac.recompute")

_SCOPE_ATTR = "_mac_output_scope"
_OUTPUT_KIND = "wrap_op_output"

class _RerunProbe(MsDispatchMode):
    """Sees the ops of one call and notes those that can't be run again (ops are forwarded unchanged):
    ``random_ops`` would draw other numbers, ``side_effect_ops`` write again (BatchNorm's moving statistics,
    ``AssignAdd``, any ``Inplace*`` op): the re-run calls the whole op or cell and can't hand it copies of what it
    writes, unlike a checkpoint region."""

    def __init__(self):
        super().__init__()
        self.random_ops = []
        self.side_effect_ops = []

    def __ms_dispatch__(self, func, args, kwargs=None):
        name = op_name_of(func, args)
        if is_unreplayable_random_op(name, args):
            self.random_ops.append(name)
        elif may_write(name, args):
            self.side_effect_ops.append(name)
        return func(*args, **(kwargs or {}))


def _layout(t):
    """What a pack must match to be the output itself: shape, dtype and strides (a transposed view of a square
    output has its pointer, shape and dtype)."""
    return tuple(t.shape), t.dtype, tuple(t.stride())


def _storages(tensors, weights):
    """``{storage pointer: bytes}`` of ``tensors`` (Nones and weights left out)."""
    found = {}
    for t in tensors:
        if t is not None and t.data_ptr() not in weights:
            ptr, nbytes = storage_info(t)
            found[ptr] = nbytes
    return found


class _ScopeRun:
    """One forward of the scope: the op calls it recorded and every other save made under it."""

    __slots__ = ("records", "passed", "weights", "__weakref__")

    def __init__(self, weights):
        self.records = []   # _OutputRecord per op call, in call order; emptied when the scope returns
        # Storage pointer -> [(bytes, weakref)] of every other save in the scope (weights excluded), kept
        # anyway; only those still alive when the scope returns count (MindSpore drops some saves). An outer
        # meter counts them itself: the scope's pack is marked for it (meter.CHAIN_PASSED).
        self.passed = {}
        self.weights = weights


class _OutputRecord:
    """One call of the wrapped op: its inputs, what it saved, its outputs; re-run in backward if dropped.

    ``dropped``: None until the scope returns, then True (tokens take a re-run's tensors) or False (tokens keep what
    they stand for).
    """

    __slots__ = ("target", "run", "inputs", "input_bytes", "views", "precision", "outs", "held_outs",
                 "out_tokens", "out_left", "inner", "inner_meta", "dropped", "result", "rebuilt", "__weakref__")

    def __init__(self, target, run, args, kwargs):
        self.target, self.run = target, run
        self.precision = cell_precision(target.owner)   # the op runs inside its owner's __call__
        leaves = tensor_leaves_in_objects((args, kwargs))
        self.input_bytes = _storages(leaves, run.weights)
        self.views = []   # (storage pointer, SavedInput) of each tensor argument
        top = set()

        def save(_, a):
            if not isinstance(a, Tensor) or isinstance(a, Parameter):
                return a   # a Parameter is read at re-run time; a tensor nested in an argument is held as it is
            saved = SavedInput.of(a)
            self.views.append((storage_info(a)[0], saved))
            top.add(id(a))
            return saved

        with no_casts():   # the engine's own op: a saved input keeps its dtype
            self.inputs = map_inputs(save, args, kwargs)
        if len(leaves) > len(self.views):   # nested tensors: their storages can't be compacted
            nested = {storage_info(t)[0] for t in leaves if id(t) not in top}
            self.views = [(ptr, s) for ptr, s in self.views if ptr not in nested]
        self.outs = ()           # (data_ptr, layout) per output, None for a non-tensor
        self.held_outs = []      # the outputs (detached) until settled; kept ones after
        self.out_tokens = []     # consumer saves of each output
        self.out_left = []       # of those, not yet unpacked since the latest re-run
        self.inner = []          # what the op saved (detached), by position; None for a weight
        self.inner_meta = []     # (shape, dtype) of each, None for a weight
        self.dropped = None
        self.result = None       # a re-run's outputs
        self.rebuilt = None      # a re-run's saves, by position

    # -- forward ----------------------------------------------------------------------------------------
    def pack_inner(self, t):
        """The op's own save hook: a weight as it is, anything else held until settled, a token left."""
        if t.data_ptr() in self.run.weights:
            self.inner.append(None)
            self.inner_meta.append(None)
            return t
        self.inner.append(detached(t))   # a tensor with its graph node would tie the graph to itself
        self.inner_meta.append((tuple(t.shape), t.dtype))
        return _Token(self, len(self.inner) - 1, True)

    def freeable(self):
        """``{storage: bytes}`` of what dropping this call would stop keeping (before other savers)."""
        held = [t for t in self.inner if t is not None]
        held += [t for t, n in zip(self.held_outs, self.out_tokens) if n and t is not None]
        return _storages(held, self.run.weights)

    def input_cost(self, kept, freeable):
        """Bytes the inputs cost when dropping this call, and the storages to keep as copies of its views.

        An input storage kept anyway (``kept``: saved elsewhere in the scope; ``freeable``: saved by the op itself)
        costs nothing; any other costs its bytes, or those of copies of the argument views on it when smaller (a
        SwiGLU gate split from the fc1 output holds all of that output).
        """
        views = {}
        for ptr, saved in self.views:
            views[ptr] = views.get(ptr, 0) + int(saved.value.nbytes)
        cost, compact = 0, set()
        for ptr, nbytes in self.input_bytes.items():
            if ptr in kept or ptr in freeable:
                continue
            if views.get(ptr, nbytes) < nbytes:
                cost += views[ptr]
                compact.add(ptr)
            else:
                cost += nbytes
        return cost, compact

    def settle(self, drop, compact=()):
        """Drop (keep only the inputs, views on ``compact`` storages as copies; returns ``{storage: bytes}`` of what
        it keeps) or keep (tokens hold what they stand for; inputs released)."""
        self.dropped = drop
        if not drop:
            self.inputs = self.views = None
            # an output no consumer saved is not held past the scope
            self.held_outs = [t if n else None for t, n in zip(self.held_outs, self.out_tokens)]
            return {}
        self.inner = [None] * len(self.inner)
        self.held_outs = None
        self.out_left = list(self.out_tokens)
        kept = {ptr: n for ptr, n in self.input_bytes.items() if ptr not in compact}
        if compact:
            with no_grad(), no_casts():   # the engine's own copies
                for ptr, saved in self.views:
                    if ptr in compact:
                        saved.value = ops.deepcopy(saved.value)
                        kept.update(_storages((saved.value,), ()))
        self.views = None
        return kept

    # -- backward ---------------------------------------------------------------------------------------
    def inner_value(self, k):
        if not self.dropped:
            return self.inner[k]
        if self.rebuilt is None or self.rebuilt[k] is None:
            self.rerun()
        t, self.rebuilt[k] = self.rebuilt[k], None   # each save is unpacked once
        return t

    def output_value(self, j):
        if not self.dropped:
            return self.held_outs[j]
        if self.result is None or self.result[j] is None:
            self.rerun()
        t = self.result[j]
        self.out_left[j] -= 1
        if self.out_left[j] <= 0:   # its last consumer has it: don't hold it for the rest of backward
            self.result[j] = None
        return t

    def rerun(self):
        """Run the op again on its inputs, once per backward (a grad of a grad's too: R1): outputs, and its saves
        when it saved any."""
        target = self.target
        args, kwargs = map_inputs(lambda _, a: recompute_input(a), *self.inputs)
        if any(m is not None for m in self.inner_meta):
            saved = []
            # The throw-away graph keeps nothing (pack returns None); the saves are collected in order.
            with recompute_graph(None, self.precision), ms.saved_tensors_hooks(saved.append, keep_saved):
                out = output_tensors(target.op(*args, **kwargs))
            messages.check_saves([(tuple(t.shape), t.dtype) for t in saved], self.inner_meta,
                                 lambda k: f"saved tensor #{k} of {target.name}", "")
            with no_grad():
                self.rebuilt = [detached(t) if m is not None else None for t, m in zip(saved, self.inner_meta)]
        else:   # it saved nothing itself: no graph is needed
            ENGINE.enter_recompute()
            try:
                with no_grad(), under_precision(self.precision):
                    out = output_tensors(target.op(*args, **kwargs))
            finally:
                ENGINE.exit_recompute()
        self.result = [detached(t) if isinstance(t, Tensor) else t for t in out]
        self.out_left = list(self.out_tokens)
        target.stats.count_rerun(target.name)
        target.stats.recompute_calls += 1


class _Token:
    """A save left in the graph for a call: its output ``index`` (``inner`` False) or its own save ``index``."""

    __slots__ = ("record", "index", "inner")

    def __init__(self, record, index, inner):
        self.record, self.index, self.inner = record, index, inner


def _unpack_output(obj):
    if obj.__class__ is not _Token:
        return obj
    return obj.record.inner_value(obj.index) if obj.inner else obj.record.output_value(obj.index)


class _Scope:
    """The saved-tensors hooks of one scope cell, shared by every op wrapped under it."""

    def __init__(self, cell):
        self.cell = cell
        self.targets = []
        self.live = {}          # data_ptr -> (record, output index), during one scope forward
        self.run = None
        self.calling = 0        # wrapped op calls in progress (an op inside another runs plainly)
        self._ctx = None
        self._bracket = None

    def __deepcopy__(self, memo):   # the scope of the original cell: a copy has none (see construct_patch)
        return DROPPED

    def attach(self, target):
        if not self.targets:
            self._bracket = bracket_calls(self.cell, "op_output_scope", self._enter, self._exit)
        self.targets.append(target)

    def detach(self, target):
        self.targets.remove(target)
        if not self.targets:
            self._bracket.remove()
            self._bracket = None
            object.__delattr__(self.cell, _SCOPE_ATTR)

    def _enter(self, _args, _kwargs):
        """True when this call opened the scope's hooks (a re-entered scope is already open)."""
        # Inside a checkpoint region (or its re-run) the region already drops what it can.
        if self._ctx is not None or ENGINE.top() is not None or ENGINE.in_recompute() \
                or not _executor.requires_grad():
            return False
        self.live = {}
        self.calling = 0
        self.run = _ScopeRun(param_ptrs(self.cell.get_parameters()))
        self._ctx = ms.saved_tensors_hooks(self._pack, _unpack_output)
        self._ctx.__enter__()
        return True

    def _exit(self, opened, failed):
        if not opened:
            return
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)
        self.live = {}
        run, self.run = self.run, None
        records, run.records = run.records, []   # tokens hold records, records the run: no cycle back
        if failed:   # an abandoned forward: keep what was saved, for a backward that won't come
            for rec in records:
                rec.settle(False)
            return
        self._settle(run, records)

    def _settle(self, run, records):
        """Drop each call that frees more than its inputs cost; report the bytes; say why for the rest."""
        passed = {}
        for ptr, entries in run.passed.items():
            sizes = [n for n, ref in entries if ref() is not None]
            if sizes:
                passed[ptr] = max(sizes)
        kept = dict(passed)
        # The ledger (ActivationLedger) per stats object: what the scope keeps goes into the first
        # target's (apply_ac gives a layer's targets one stats), what each target's dropped calls freed into
        # its own, summed as decided (a freed storage's address may be reused).
        ledgers = {}
        why = {}       # target -> the warning of its first kept call, while none was dropped
        for rec in records:
            target, freeable = rec.target, rec.freeable()
            gain = sum(n for p, n in freeable.items() if p not in kept and p not in rec.input_bytes)
            cost, compact = rec.input_cost(kept, freeable)
            ledger = ledgers.setdefault(id(target.stats), (target.stats, ActivationLedger(run.weights)))[1]
            if target.keep_output is not True and gain > cost:
                kept.update(rec.settle(True, compact))
                ledger.rebuilt(gain)
                why[target] = None
                continue
            rec.settle(False)
            kept.update(freeable)
            if target.keep_output is not True and target not in why:
                name = target.name   # the warn-once key, text and arguments saying why it kept what it saved
                if gain:
                    why[target] = ("inputs_cost", name), messages.OUTPUT_INPUTS_COST, name, cost, gain
                elif any(rec.out_tokens) or freeable:
                    why[target] = ("output_kept_by_op", name), messages.OUTPUT_KEPT_ELSEWHERE, name
                else:
                    why[target] = ("nothing_dropped", name), messages.OUTPUT_NOTHING_DROPPED, name
        if ledgers:   # the meter counts what was passed
            next(iter(ledgers.values()))[1].kept = {p: n for p, n in kept.items() if p not in passed}
        for stats, ledger in ledgers.values():
            stats.open_region(run, ledger.close())
        for target, warning in why.items():
            if warning is not None:
                ENGINE.warnings.warning(*warning)
                if not target.settled_once:
                    target.retire(warning)
            target.settled_once = True

    def _pack(self, t):
        hit = self.live.get(t.data_ptr())
        if hit is not None and hit[0].dropped is None and hit[0].outs[hit[1]][1] == _layout(t):
            rec, j = hit
            rec.out_tokens[j] += 1
            return _Token(rec, j, False)
        run = self.run   # anything else is kept as it is, noted for the decisions
        if run is not None and t.data_ptr() not in run.weights:
            ptr, nbytes = storage_info(t)
            run.passed.setdefault(ptr, []).append((nbytes, weakref.ref(t)))
        return t

    setattr(_pack, CHAIN_PASSED, True)   # what it lets through is counted by an outer meter


class _Target:
    """The wrapped op: calls it, records it in the scope, re-runs it in backward."""

    def __init__(self, op, name, owner, scope, stats, on_retire=None):
        self.op, self.name, self.owner, self.scope, self.stats = op, name, owner, scope, stats
        self.keep_output = None   # True: never re-run (random or writes parameters); decided on the first recorded call
        self.settled_once = False
        self.retired = None       # why, once its first training forward dropped none of its calls
        self.on_retire = on_retire

    def retire(self, warning):
        """Its first training forward saved nothing by any call (``warning``: the warn-once key, text and arguments
        that said why): from now on the op runs plainly, unrecorded and never re-run, so the work agrees with the
        log; ``on_retire`` is told why (``apply_ac`` notes it on the layer's plan)."""
        _, text, *args = warning
        self.retired = text % tuple(args)
        if self.on_retire is not None:
            self.on_retire(self.retired)

    def observe(self, args, kwargs, call):
        """Run ``call()`` (the op), recording it when the scope is collecting; the first recorded call decides
        whether the op can be run again at all."""
        scope = self.scope
        if self.keep_output is True or self.retired is not None or scope.run is None or scope.calling \
                or ENGINE.top() is not None or ENGINE.in_recompute():
            return call()
        rec = _OutputRecord(self, scope.run, args, kwargs)
        scope.calling += 1
        try:
            with ms.saved_tensors_hooks(rec.pack_inner, _unpack_output):
                if self.keep_output is None:
                    with _RerunProbe() as probe:
                        out = call()
                    self.keep_output = bool(probe.random_ops or probe.side_effect_ops)
                    if probe.random_ops:
                        ENGINE.warnings.warning(("random_output", self.name), messages.OUTPUT_RANDOM_OPS,
                                                self.name, probe.random_ops)
                    elif probe.side_effect_ops:
                        ENGINE.warnings.warning(("side_effect_output", self.name), messages.OUTPUT_SIDE_EFFECT_OPS,
                                                self.name, probe.side_effect_ops)
                else:
                    out = call()
        finally:
            scope.calling -= 1
        # a kept op (random, writes) is settled as kept with the others
        outs = output_tensors(out)
        rec.outs = tuple((t.data_ptr(), _layout(t)) if isinstance(t, Tensor) else None for t in outs)
        rec.held_outs = [detached(t) if isinstance(t, Tensor) else None for t in outs]
        rec.out_tokens = [0] * len(outs)
        scope.live.update((o[0], (rec, j)) for j, o in enumerate(rec.outs) if o is not None)
        scope.run.records.append(rec)
        return out


class OpOutputHandle:
    """Undo handle returned by ``wrap_op_output``; ``remove()`` restores the op slot. ``original``: the wrapped op."""

    def __init__(self, holder, attr, target, patch, slot=None):
        self.holder, self.attr, self.target, self._patch, self.slot = holder, attr, target, patch, slot
        self.stats, self.original = target.stats, target.op
        self.removed = False

    def remove(self):
        if self.removed:
            return
        self.removed = True
        if self._patch is not None:
            self._patch.remove()
        else:
            self.slot.mac_output = None
            release(self.holder, self.attr, self.slot)
        self.target.scope.detach(self.target)


def wrap_op_output(owner_cell, attr_name, stats=None, registry=None, scope=None, on_retire=None):
    """Drop the output of op ``owner_cell.<attr_name>`` (or ``owner_cell.<registry>[attr_name]``) for backward.

    The op (a function, a Primitive, or a Cell with a custom ``bprop``) gets the output role of its
    ``op_slot.OpSlot``, or, a Cell, an instance ``construct`` patch. Neither what it saves nor its output as saved by
    consumers inside ``scope`` (default ``owner_cell``; pass the layer) is kept, only its inputs, for each call where
    that frees more than the inputs cost (else a warning says why); backward runs the op again, counted in
    ``stats``. An op whose first training forward dropped none of its calls is retired (``on_retire(why)``).
    Returns an ``OpOutputHandle`` (``remove()`` undoes it); wrapping a slot twice raises ValueError.
    """
    holder, key = owner_cell, attr_name
    if registry is None:
        if not hasattr(owner_cell, attr_name):
            raise AttributeError(f"{type(owner_cell).__name__} has no op attribute '{attr_name}'")
        op = getattr(owner_cell, attr_name)
    else:
        table = getattr(owner_cell, registry, None)
        if not isinstance(table, dict) or attr_name not in table:
            raise AttributeError(f"{type(owner_cell).__name__}.{registry} has no op '{attr_name}'")
        holder, key = registry_slot(table, attr_name)   # MindFormers' {'fn': op, ...} entry, or the op
        op = holder[key]
    slot = op if isinstance(op, OpSlot) else None   # a checkpoint region's slot (track, keep, dropout roles)
    op = slot.mac_inner if slot is not None else op
    if (slot is not None and slot.mac_output is not None) or \
            (isinstance(op, nn.Cell) and find_patch(op, _OUTPUT_KIND) is not None):
        raise ValueError(f"op '{attr_name}' of {type(owner_cell).__name__} is already output-recomputed; "
                         "remove() its handle first")
    if not callable(op):
        raise TypeError(f"'{attr_name}' of {type(owner_cell).__name__} is not callable ({type(op).__name__})")
    cell = scope if scope is not None else owner_cell
    if _SCOPE_ATTR not in cell.__dict__:
        object.__setattr__(cell, _SCOPE_ATTR, _Scope(cell))   # plain attribute: not a sub-cell or parameter
    name = f"{type(owner_cell).__name__}.{attr_name}"
    target = _Target(op, name, owner_cell, cell.__dict__[_SCOPE_ATTR],
                     stats if stats is not None else RecomputeStats(), on_retire)
    if is_random_op_name(op_name_of(op) if not isinstance(op, nn.Cell) else type(op).__name__):
        logger.warning(messages.OUTPUT_RANDOM_OP, name, op)
        target.keep_output = True
    target.scope.attach(target)
    if isinstance(op, nn.Cell):
        # A Cell op (e.g. a collective with a custom bprop) keeps its slot: forward hooks are ignored on
        # cells with a custom bprop, and a non-Cell proxy in the slot would change the cell tree. Its
        # output is recorded inside the call: a custom bprop saves the output for itself as the call
        # returns, which a proxy around the call would see too late to drop.
        patch = ConstructPatch(op, _OUTPUT_KIND, lambda inner, *a, **k: target.observe(a, k, lambda: inner(*a, **k)),
                               undo="remove() its OpOutputHandle")
        return OpOutputHandle(holder, key, target, patch)
    slot = slot_at(holder, key)
    slot.mac_output = target
    return OpOutputHandle(holder, key, target, None, slot)
