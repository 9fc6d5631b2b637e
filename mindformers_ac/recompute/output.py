"""Output recompute of one op attribute (MindFormers' ``output_recompute`` / ``recompute_comm``).

Recomputing a single op as a tiny region saves nothing: its consumers still
save its output. Instead, the *scope* cell (normally the transformer layer)
runs under ``saved_tensors_hooks`` that recognise packs of the wrapped op's
output storage (by ``data_ptr``, recorded when the op returns, checked against
a weak reference to the output so a reused address is never mistaken) and
store a token instead; in backward the first unpack runs the op again on its
inputs (without recording a graph) and every token of that output takes the
result. The op's inputs stay alive (usually saved anyway by the op itself).

Limits: only packs of the output tensor itself made while the scope cell runs
are replaced (a consumer that saves a view or slice of it, or runs in another
layer, keeps it); a checkpoint region or a swap hook installed
*inside* the scope takes precedence for what it covers; an op found to run a
random kernel, or one that writes (a ``side_effect_mem`` primitive such as
BatchNorm in training, an ``Inplace*`` op), on its first call is kept, with a
warning: re-running it would draw other numbers or write twice.
"""
import copy
import logging
import weakref

import mindspore as ms
from mindspore import Tensor, nn
from mindspore.utils import MsDispatchMode

from ..construct_patch import DROPPED, ConstructPatch, bracket_calls, find_patch
from ..mindspore_compat import no_grad
from ..mindspore_compat import pynative_executor as _executor
from ..precision import cell_precision, under_precision
from ..tensors import output_tensors, storage_nbytes
from . import messages
from .dispatch import op_name_of
from .random_ops import is_random_op_name, is_unreplayable_random_op
from .rerun import refuse_higher_order
from .side_effects import may_write
from .state import ENGINE
from .stats import RecomputeStats
from .tracking import AttrProxy

logger = logging.getLogger("mindformers_ac.recompute")

_SCOPE_ATTR = "_mac_output_scope"
_OUTPUT_KIND = "wrap_op_output"


class _RerunProbe(MsDispatchMode):
    """Sees the ops of one call and notes those that can't be run again (ops are forwarded unchanged).

    ``random_ops``: a second call would draw other numbers. ``side_effect_ops``:
    a second call would write again (BatchNorm's moving statistics,
    ``AssignAdd``, any ``Inplace*`` op); the re-run calls the whole op or cell
    and can't hand it copies of what it writes, unlike a checkpoint region.
    """

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


class _ScopeRun:
    """Outputs recorded during one forward of the scope; owns the accounting of that forward."""

    __slots__ = ("stats_bytes", "dropped_any", "dropped_refs", "passed", "weights", "__weakref__")

    def __init__(self, weights=frozenset()):
        self.stats_bytes = {}   # stats object id -> [stats, kept, dropped, seen ptrs]
        self.dropped_any = {}   # target -> whether a consumer's save of its output was dropped
        self.dropped_refs = {}  # data_ptr of an output whose save was dropped -> (target, weakref to it)
        # Our hooks hide an outer meter (accounting.StepMeter): what they let through is kept, and ours
        # to report. data_ptr -> (bytes, weakref) of every other save in the scope, weights (by data_ptr)
        # excluded; only those still alive when the scope returns count (MindSpore drops some saves).
        self.passed = {}
        self.weights = weights


class _OutputRecord:
    """One call of the wrapped op: its inputs, and its result once re-run."""

    __slots__ = ("target", "args", "kwargs", "outs", "result", "run", "precision", "__weakref__")

    def __init__(self, target, args, kwargs, outs, run):
        self.target, self.args, self.kwargs, self.run = target, args, kwargs, run
        self.outs = [weakref.ref(t) if isinstance(t, Tensor) else None for t in outs]
        self.result = None
        self.precision = cell_precision(target.owner)   # the op ran inside its owner's __call__

    def rerun(self):
        if self.result is None:
            refuse_higher_order()
            ENGINE.enter_recompute()
            try:
                # No graph is recorded for the re-run; it runs under the forward's mixed precision.
                with no_grad(), under_precision(self.precision):
                    self.result = output_tensors(self.target.call_original(*self.args, **self.kwargs))
            finally:
                ENGINE.exit_recompute()
            self.target.stats.count_rerun(self.target.name)
            self.target.stats.recompute_calls += 1
        return self.result


class _OutputToken:
    __slots__ = ("record", "index")

    def __init__(self, record, index):
        self.record, self.index = record, index


class _Scope:
    """The saved-tensors hooks of one scope cell, shared by every op wrapped under it."""

    def __init__(self, cell):
        self.cell = cell
        self.targets = []
        self.live = {}          # data_ptr -> (record, output index), during one scope forward
        self.run = None
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
        self.run = _ScopeRun(frozenset(p.data_ptr() for p in self.cell.get_parameters()))
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
        if failed:
            return   # an abandoned forward: nothing was kept for a backward that won't come
        alive = {ptr: n for ptr, (n, ref) in run.passed.items() if ref() is not None}
        inputs = {key for entry in run.stats_bytes.values() for key in entry[3] if not isinstance(key, tuple)}
        passed = sum(n for ptr, n in alive.items() if ptr not in inputs)
        # An output dropped by its consumers but also saved as it is stays alive (a Cell with a custom
        # bprop saves its output for the bprop, which a proxy around the call sees too late). Same
        # pointer is not enough: a dropped output freed early leaves its address to later tensors.
        still_alive = {ptr for ptr, (_, ref) in run.dropped_refs.items() if ptr in alive and ref() is not None}
        for stats, kept, dropped, keys in run.stats_bytes.values():
            still = sum(alive[key[1]] for key in keys if isinstance(key, tuple) and key[1] in still_alive)
            stats.open_region(run, kept + passed, dropped - still, 0)
            passed = 0   # once, with the first target's stats (apply_ac gives a layer's targets one stats)
        by_target = {}
        for ptr, (target, _) in run.dropped_refs.items():
            by_target.setdefault(target, set()).add(ptr)
        for target, ptrs in by_target.items():
            if ptrs <= still_alive:
                ENGINE.warnings.warning(
                    ("output_kept_by_op", target.name),
                    "output recompute of %s saves nothing: its output is saved for backward as it is "
                    "before the op returns (a Cell with a custom bprop keeps its inputs and output for "
                    "the bprop); it is still run again in backward", target.name)
        for target, dropped in run.dropped_any.items():
            if not dropped:
                ENGINE.warnings.warning(("nothing_dropped", target.name), messages.OUTPUT_NOTHING_DROPPED,
                                        target.name)

    def record(self, target, args, kwargs, out):
        if self.run is None:
            return
        outs = output_tensors(out)
        rec = _OutputRecord(target, args, kwargs, outs, self.run)
        self.run.dropped_any.setdefault(target, False)
        for j, t in enumerate(outs):
            if isinstance(t, Tensor):
                self.live[t.data_ptr()] = (rec, j)
        entry = self.run.stats_bytes.setdefault(id(target.stats), [target.stats, 0, 0, set()])
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, Tensor) and a.data_ptr() not in entry[3]:
                entry[3].add(a.data_ptr())
                entry[1] += storage_nbytes(a)

    def _pack(self, t):
        hit = self.live.get(t.data_ptr())
        if hit is None:
            return self._pass(t)
        rec, j = hit
        out = rec.outs[j]() if rec.outs[j] is not None else None
        if out is None or out.shape != t.shape or out.dtype != t.dtype:
            return self._pass(t)
        entry = rec.run.stats_bytes[id(rec.target.stats)]
        rec.run.dropped_any[rec.target] = True
        rec.run.dropped_refs[t.data_ptr()] = (rec.target, rec.outs[j])
        if ("out", t.data_ptr()) not in entry[3]:
            entry[3].add(("out", t.data_ptr()))
            entry[2] += storage_nbytes(t)
        return _OutputToken(rec, j)

    def _pass(self, t):
        """``t`` kept as it is: noted for the accounting (an outer meter can't see it)."""
        run, ptr = self.run, t.data_ptr()
        if run is not None and ptr not in run.weights and ptr not in run.passed:
            run.passed[ptr] = (storage_nbytes(t), weakref.ref(t))
        return t


def _unpack_output(obj):
    if isinstance(obj, _OutputToken):
        return obj.record.rerun()[obj.index]
    return obj


class _Target:
    """The wrapped op: calls it, records its output in the scope, re-runs it in backward."""

    def __init__(self, op, name, owner, scope, stats):
        self.op, self.name, self.owner, self.scope, self.stats = op, name, owner, scope, stats
        self.keep_output = None   # True: never re-run (random or writes parameters); decided on the first recorded call

    def call_original(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def active(self):
        return self.keep_output is not True and self.scope.run is not None and not ENGINE.in_recompute()

    def decide_rerun(self, random_ops, side_effect_ops=()):
        """Decide, from the first recorded call, whether the op can be run again at all."""
        self.keep_output = bool(random_ops) or bool(side_effect_ops)
        if random_ops:
            ENGINE.warnings.warning(("random_output", self.name), messages.OUTPUT_RANDOM_OPS, self.name,
                                    random_ops)
        elif side_effect_ops:
            ENGINE.warnings.warning(("side_effect_output", self.name), messages.OUTPUT_SIDE_EFFECT_OPS, self.name,
                                    side_effect_ops)

    def observe(self, args, kwargs, call):
        """Run ``call()`` (the op), recording its output when the scope is collecting."""
        if not self.active():
            return call()
        if self.keep_output is None:
            probe = _RerunProbe()
            with probe:
                out = call()
            self.decide_rerun(probe.random_ops, probe.side_effect_ops)
            if self.keep_output:
                return out
        else:
            out = call()
        self.scope.record(self, args, kwargs, out)
        return out


class _FunctionProxy:
    """Stands in the attribute slot of a function or Primitive op."""

    mac_is_op_proxy = True   # a checkpoint region's PathTracker may name it too

    def __init__(self, target):
        self._mac_target = target

    def __call__(self, *args, **kwargs):
        t = self._mac_target
        return t.observe(args, kwargs, lambda: t.op(*args, **kwargs))

    def __getattr__(self, name):   # keep Primitive attributes (name, attrs) reachable
        return getattr(self.__dict__["_mac_target"].op, name)

    def __deepcopy__(self, memo):   # a copied cell gets the plain op (see construct_patch)
        return copy.deepcopy(self._mac_target.op, memo)


class OpOutputHandle:
    """Undo handle returned by ``wrap_op_output``; ``remove()`` restores the op slot."""

    def __init__(self, owner, attr, registry, original, target, patch, proxy=None):
        self.owner, self.attr, self.registry = owner, attr, registry
        self.original, self.target, self._patch, self.proxy = original, target, patch, proxy
        self.removed = False

    @property
    def stats(self):
        return self.target.stats

    def remove(self):
        if self.removed:
            return
        self.removed = True
        if self._patch is not None:
            self._patch.remove()
        else:
            slots = self.owner.__dict__ if self.registry is None else getattr(self.owner, self.registry)
            current = slots.get(self.attr)
            if isinstance(current, AttrProxy) and current.mac_inner is self.proxy:
                current.mac_inner = self.original   # a region's tracker wrapped our proxy: unwrap inside it
            elif self.registry is None:
                setattr(self.owner, self.attr, self.original)
            else:
                slots[self.attr] = self.original
        self.target.scope.detach(self.target)


def _scope_of(cell):
    scope = cell.__dict__.get(_SCOPE_ATTR)
    if scope is None:
        scope = _Scope(cell)
        object.__setattr__(cell, _SCOPE_ATTR, scope)   # plain attribute: not a sub-cell or parameter
    return scope


def wrap_op_output(owner_cell, attr_name, stats=None, registry=None, scope=None):
    """Drop the output of op ``owner_cell.<attr_name>`` (or ``owner_cell.<registry>[attr_name]``) for backward.

    The op may be a Python function, a Primitive, or a Cell (e.g. a collective
    with a custom ``bprop``). A registry slot or a function/Primitive attribute
    is replaced by a proxy; a Cell attribute keeps its object and gets an
    instance ``construct`` patch (the cell tree and parameter names stay). Consumers running inside ``scope`` (default:
    ``owner_cell``; pass the transformer layer) do not keep the op's output;
    backward rebuilds it by running the op again on its inputs, counted in
    ``stats`` (``ops_rerun``, ``recompute_calls``, ``dropped_bytes``). Returns an
    ``OpOutputHandle``; ``handle.remove()`` undoes it. Wrapping the same slot
    twice raises ValueError.
    """
    if registry is None:
        if not hasattr(owner_cell, attr_name):
            raise AttributeError(f"{type(owner_cell).__name__} has no op attribute '{attr_name}'")
        op = getattr(owner_cell, attr_name)
    else:
        slots = getattr(owner_cell, registry, None)
        if not isinstance(slots, dict) or attr_name not in slots:
            raise AttributeError(f"{type(owner_cell).__name__}.{registry} has no op '{attr_name}'")
        op = slots[attr_name]
    tracker_proxy = op if isinstance(op, AttrProxy) else None   # a checkpoint region names this attribute
    if tracker_proxy is not None:
        op = tracker_proxy.mac_inner
    if isinstance(op, _FunctionProxy) or (isinstance(op, nn.Cell) and find_patch(op, _OUTPUT_KIND) is not None):
        raise ValueError(f"op '{attr_name}' of {type(owner_cell).__name__} is already output-recomputed; "
                         "remove() its handle first")
    if not callable(op):
        raise TypeError(f"'{attr_name}' of {type(owner_cell).__name__} is not callable ({type(op).__name__})")
    name = f"{type(owner_cell).__name__}.{attr_name}"
    target = _Target(op, name, owner_cell, _scope_of(scope if scope is not None else owner_cell),
                     stats if stats is not None else RecomputeStats())
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
        return OpOutputHandle(owner_cell, attr_name, registry, op, target, patch)
    proxy = _FunctionProxy(target)
    if tracker_proxy is not None:
        tracker_proxy.mac_inner = proxy
    elif registry is None:
        setattr(owner_cell, attr_name, proxy)
    else:
        getattr(owner_cell, registry)[attr_name] = proxy
    return OpOutputHandle(owner_cell, attr_name, registry, op, target, None, proxy)
