"""The light path of a checkpointed cell: saved-tensor hooks only, no per-op interception.

On a host-bound step every microsecond of Python per op shows: the
op-intercepting path (``dispatch``) runs Python for every op of a region, in
forward and in recompute. Most regions need no per-op decision: full
recompute without a policy, where every op is run again. For those, the
saved tensors can be matched by position alone: the forward numbers what it
saves (and keeps only their shapes and dtypes), the recompute runs the
function again on the saved inputs and collects what it saves, in order.

A region goes light only after a first call through the full path, per call
signature, showed that it is safe (``LightProfile.validate``). The signature
is the root cell's training flag and mixed-precision type and the structure
of the arguments: tuples, lists and dicts (nested), each tensor's shape,
dtype and whether autograd tracks it, and the value of each plain scalar,
string or dtype. It holds no argument itself (a per-step rotary table passed
as a tuple must die with its step); a call with an argument of any other
kind is not profiled and takes the full path. The profile is checked as
follows:

* no policy, no swapped inputs (``checkpoint_wrapper`` without
  ``policy_fn``; ``exclude_op`` is a policy);
* no op that may write tensors (``side_effect_mem`` primitives such as
  BatchNorm in training, ``Inplace*`` ops), no nested region;
* no kept op: no unreplayable random op, except the Dropout kernel of an
  ``nn.Dropout`` cell called through its ``DropoutProxy`` (below); replayable
  random primitives (``mac_replayable``) are recomputed like any op;
* its recompute saved exactly what its forward saved (count, shapes and
  dtypes, in order).

``nn.Dropout``: the wrapper replaces the ``dropout`` primitive of each
``nn.Dropout`` sub-cell by a ``DropoutProxy`` that hands the call to the
running region. On the light path the forward keeps its mask as bits (as
``random_ops.DropoutRecord``) and numbers the Dropout's own saves apart; the
recompute rebuilds the output from the mask without calling the kernel (the
rebuild's ops save nothing for the region) and the Dropout's saves take the
rebuilt output and mask.

A light recompute re-tracks the inputs exactly as the full path
(``rerun.recompute_input``) and checks that it saved as many tensors, of the
same shapes and dtypes, as its forward, and ran every Dropout of the forward;
if not it raises the same "recompute diverged from forward" error, naming the
op (from the profiling call) and what differed.

Counters: ``kept_bytes`` (inputs, mask bits) are measured per call;
``ops_forward``, ``ops_rerun``, ``rerun_by_op`` and ``dropped_bytes`` are the
profiling call's, which ran the same ops: a light forward whose saves differ
from the profile's (its code path changed) drops the profile so that the next
call profiles again.
"""
import collections
import copy
import enum
import weakref

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn
from ..mindspore_compat import pynative_executor as _executor
from mindspore.ops import Primitive

from ..precision import cell_precision, no_casts
from ..tensors import is_tracked, storage_info
from .dispatch import REBUILD
from .random_ops import DropoutRecord
from .region import run_region
from .rerun import RerunOnce, SavedInput, recompute_graph, recompute_input
from .state import ENGINE, FORWARD, RECOMPUTE


def _describe(meta):
    return f"{meta[0]} {meta[1]}" if meta is not None else "not saved"


class LightProfile:
    """What the first (op-intercepting) call of one call signature showed about the region.

    ``ok`` is None until that call's recompute finished, then whether later
    calls with this signature may take the light path.
    """

    __slots__ = ("fwd", "rec", "keys", "ok", "op_names", "op_paths", "n_forward", "n_rerun", "rerun_counts",
                 "n_dropouts", "dropped", "param_ptrs", "_owner")

    def __init__(self):
        self.fwd, self.rec = [], []   # (shape, dtype) of every save of forward / recompute, in order
        self.keys = []                # (op index, pack number) of each forward save, for messages
        self.ok = None
        self.op_names, self.op_paths = [], {}
        self.n_forward = self.n_rerun = self.n_dropouts = self.dropped = 0
        self.rerun_counts = collections.Counter()
        self.param_ptrs = frozenset()
        self._owner = None

    def attach(self, region):
        self._owner = weakref.ref(region)

    def note_forward(self, t, key):
        self.fwd.append((tuple(t.shape), t.dtype))
        self.keys.append(key)

    def note_recompute(self, t):
        self.rec.append((tuple(t.shape), t.dtype))

    def validate(self, region):
        """After the profiling call's recompute: may this signature take the light path?"""
        decisions = region.decisions
        rebuilt = {i for i, d in decisions.items() if d == REBUILD}
        self.ok = (region.policy_fn is None and not region.swap_inputs and not region.may_write_seen
                   and not region.snapshots and not region.written and not region.cache
                   and not region.children and len(rebuilt) == len(decisions)
                   and rebuilt <= region.cell_dropouts and self.fwd == self.rec)
        self.op_names, self.op_paths = list(region.op_names), dict(region.op_paths)
        self.n_forward = len(self.op_names)
        self.rerun_counts = collections.Counter(n for i, n in enumerate(self.op_names) if i not in decisions)
        self.n_rerun = sum(self.rerun_counts.values())
        self.n_dropouts = len(rebuilt)
        self.dropped = region.totals[1] if region.totals is not None else 0
        self.param_ptrs = frozenset(region.param_ptrs)
        self.rec = None
        self._owner = None

    def abandoned(self):
        """A profiling call whose region died without a recompute (a forward without backward)."""
        return self.ok is None and (self._owner is None or self._owner() is None)

    def describe_save(self, i):
        """``op #3 MatMulExt (in 'mlp')`` for forward save ``i``, as the profiling call numbered it."""
        key = self.keys[i] if i < len(self.keys) else None
        if key is None:
            return f"saved tensor #{i}"
        idx, k = key
        path = self.op_paths.get(idx, "")
        name = self.op_names[idx] if idx < len(self.op_names) else "?"
        return f"op #{idx} {name}{f' (in {path!r})' if path else ''}, its saved tensor #{k}"


# Arguments keyed by value: immutable, and holding no tensor.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, enum.Enum, np.generic, ms.dtype.Type, type)
_MAX_DEPTH = 8


class _NoSignature(Exception):
    """An argument the signature can't describe without holding it."""


def _signature(v, depth=_MAX_DEPTH):
    """A hashable description of ``v`` that holds no tensor and no object of the caller."""
    if isinstance(v, Tensor):
        return Tensor, v.shape, v.dtype, is_tracked(v), isinstance(v, Parameter)
    if isinstance(v, _VALUE_TYPES):
        return type(v), v   # the type too: 1, 1.0 and True are equal keys otherwise
    if depth > 0:
        if isinstance(v, (tuple, list)):
            return type(v), tuple(_signature(x, depth - 1) for x in v)
        if isinstance(v, dict):
            return type(v), tuple((_signature(k, 0), _signature(x, depth - 1)) for k, x in v.items())
    raise _NoSignature


class LightProfiles:
    """Per-wrapper cache: call signature -> ``LightProfile`` (bounded; beyond it calls stay on the full path)."""

    MAX_KEYS = 32

    def __init__(self):
        self._profiles = {}

    @staticmethod
    def key(root, args, kwargs):
        """The call signature (see the module docstring), or None when an argument can't be described
        without holding it (that call is not profiled and takes the full path)."""
        try:
            # The mixed-precision type changes which Casts run and what is saved (to_float after some steps).
            return (root.training if root is not None else None, cell_precision(root),
                    tuple(_signature(a) for a in args),
                    tuple((k, _signature(kwargs[k])) for k in sorted(kwargs)))
        except _NoSignature:
            return None

    def lookup(self, key):
        profile = self._profiles.get(key)
        if profile is not None and profile.abandoned():
            del self._profiles[key]
            profile = None
        return profile

    def start(self, key):
        if len(self._profiles) >= self.MAX_KEYS:
            return None
        profile = self._profiles[key] = LightProfile()
        return profile

    def forget(self, key):
        self._profiles.pop(key, None)

    def __len__(self):
        return len(self._profiles)


def run_checkpoint(fn, args, kwargs, profiles, root, **options):
    """Entry point of a wrapped cell: the light path when its profile allows, else ``run_region``."""
    if profiles is None or ENGINE.top() is not None or not _executor.requires_grad():
        return run_region(fn, args, kwargs, root=root, **options)
    key = profiles.key(root, args, kwargs)
    profile = profiles.lookup(key) if key is not None else None
    if profile is not None and profile.ok:
        return LightRegion(fn, profile, profiles, key, options["stats"], options["context_fn"],
                           cell_precision(root)).run_forward(args, kwargs)
    if key is not None and profile is None:
        options["profile"] = profiles.start(key)
    return run_region(fn, args, kwargs, root=root, **options)


class _LightRun:
    """ENGINE stack entry of a light region run (trackers, proxies and nested regions look at it)."""

    __slots__ = ("region", "mode", "child_idx", "in_hook", "path", "attrs", "dropout_idx")

    def __init__(self, region, mode):
        self.region, self.mode = region, mode
        self.child_idx, self.in_hook, self.dropout_idx = 0, False, 0
        self.path, self.attrs = [], []

    def dropout_call(self, prim, x):
        return self.region.dropout_call(self, prim, x)


class _DropoutPack:
    """What a light forward leaves for a tensor saved inside an ``nn.Dropout`` kernel call."""

    __slots__ = ("region", "tensor", "drop", "index")

    def __init__(self, region, tensor):
        self.region, self.tensor, self.drop, self.index = region, tensor, None, 0


class _LightDropout:
    """One ``nn.Dropout`` kernel call of a light forward: its mask as bits, or its outputs when kept."""

    __slots__ = ("record", "kept", "meta", "rebuilt")

    def __init__(self, x):
        self.record = self.kept = self.rebuilt = None
        self.meta = (tuple(x.shape), x.dtype)


class _Collector:
    """The light recompute's pack hook; held by the recompute graph, so it holds no region."""

    __slots__ = ("saved", "skip")

    def __init__(self):
        self.saved, self.skip = [], False

    def pack(self, t):
        if not self.skip and self.saved is not None:
            self.saved.append(t)


def _keep(obj):
    return obj


def _unpack(obj):
    """Unpack hook of light forwards: ``(region, position)`` or a ``_DropoutPack``."""
    if obj.__class__ is tuple:
        return obj[0].take(obj[1])
    if obj.tensor is not None:   # a _DropoutPack whose tensor was kept
        return obj.tensor
    obj.region.ensure_recomputed()
    return obj.drop.rebuilt[obj.index]


class LightRegion(RerunOnce):
    """One call on the light path: saved tensors are numbered in forward and refilled by position."""

    tracker = None   # path tracking is for policies, and a light region has none

    def __init__(self, fn, profile, profiles, key, stats, context_fn, precision):
        super().__init__()   # children: regions nested in the forward (none when the profile held)
        self.fn, self.profile, self.stats, self.context_fn = fn, profile, stats, context_fn
        self.precision = precision   # the mixed-precision type of the forward (see rerun)
        self._profiles, self._key = profiles, key
        self.inputs = None
        self.sig = []             # (shape, dtype) of each tensor saved in forward, in order
        self.dropouts = []        # _LightDropout per nn.Dropout kernel call, in order
        self.recomputed = None    # tensors the recompute saved, by position; None once taken
        self._pending = None      # _DropoutPacks made inside a Dropout kernel call in progress
        self._collector = None
        self._kept = {}

    # -- forward ------------------------------------------------------------------
    def _pack(self, t):
        # What is left in the graph holds the region until backward used it (not the hook functions:
        # MindSpore keeps those as long as the graph, which outlives the backward).
        pending = self._pending
        if pending is not None:
            p = _DropoutPack(self, t)
            pending.append(p)
            return p
        sig = self.sig
        sig.append((t.shape, t.dtype))
        return self, len(sig) - 1

    def take(self, i):
        """The tensor the recompute saved at position ``i`` (single use)."""
        if not self.done:
            self.ensure_recomputed()
        recomputed = self.recomputed
        t = recomputed[i]
        if t is None:
            raise RuntimeError(
                f"mindformers_ac: saved tensor #{i} of a checkpointed region was already used: its "
                "recompute regenerated it once and an earlier backward took it. Was the graph "
                "backpropagated twice? Run backward once per forward.")
        recomputed[i] = None
        return t

    def _save_input(self, a):
        if not isinstance(a, Tensor) or isinstance(a, Parameter):
            return a
        self._keep_bytes(a)
        return SavedInput(ms.ops.stop_gradient(a), is_tracked(a))

    def run_forward(self, args, kwargs):
        run = _LightRun(self, FORWARD)
        ENGINE.push(run)
        try:
            with no_casts():
                self.inputs = (tuple(self._save_input(a) for a in args),
                               {k: self._save_input(v) for k, v in kwargs.items()})
            with self.run_context(FORWARD), ms.saved_tensors_hooks(self._pack, _unpack):
                out = self.fn(*args, **kwargs)
        finally:
            ENGINE.pop(run)
        profile = self.profile
        if self.sig != profile.fwd or len(self.dropouts) != profile.n_dropouts:
            # Its code path changed since the profiling call: this call's recompute is still checked
            # against its own forward, but the next call profiles again.
            self._profiles.forget(self._key)
        stats = self.stats
        stats.ops_forward += profile.n_forward
        kept = sum(self._kept.values())
        self._kept = None
        stats.open_region(self, kept, profile.dropped, 0)
        return out

    def dropout_call(self, run, prim, x):
        """An ``nn.Dropout`` kernel call: keep its mask as bits in forward, rebuild its output in recompute."""
        if run.mode == FORWARD:
            return self._dropout_forward(prim, x)
        if run.mode != RECOMPUTE:
            return prim(x)
        i = run.dropout_idx
        run.dropout_idx += 1
        if i >= len(self.dropouts):
            raise RuntimeError(
                f"mindformers_ac: recompute diverged from forward: it called nn.Dropout #{i}, the forward "
                f"called {len(self.dropouts)}. A checkpointed region must take the same code path when run "
                "again (no branching on global state, step counters or is_in_recompute() that changes ops).")
        drop = self.dropouts[i]
        if drop.kept is not None:
            return drop.kept
        got = (tuple(x.shape), x.dtype)
        if got != drop.meta:
            raise RuntimeError(
                f"mindformers_ac: recompute diverged from forward at nn.Dropout #{i}: its input was "
                f"{_describe(drop.meta)} in forward but {_describe(got)} in the recompute. The region must "
                "compute the same shapes and dtypes when run again.")
        self._collector.skip = True   # the rebuild's own ops save nothing for this region
        try:
            drop.rebuilt = drop.record.rebuild(x)
        finally:
            self._collector.skip = False
        return drop.rebuilt

    def _dropout_forward(self, prim, x):
        pending = self._pending = []
        try:
            out = prim(x)
        finally:
            self._pending = None
        output, mask = out
        keep_prob = float(prim.keep_prob)
        drop = _LightDropout(x)
        if ENGINE.dropout_formula_ok(x, output, mask, keep_prob):
            drop.record = DropoutRecord(mask, keep_prob)
            self._kept[("bits", len(self.dropouts))] = drop.record.nbytes
            ptrs = [output.data_ptr(), mask.data_ptr()]
            for p in pending:
                ptr = p.tensor.data_ptr()
                if ptr in ptrs:
                    p.drop, p.index, p.tensor = drop, ptrs.index(ptr), None
                else:
                    self._keep_bytes(p.tensor)
        else:   # can't be rebuilt bitwise: keep its outputs (and whatever it saved)
            drop.kept = out
            for t in list(out) + [p.tensor for p in pending]:
                self._keep_bytes(t)
        self.dropouts.append(drop)
        return out

    def _keep_bytes(self, t):
        if t.data_ptr() not in self.profile.param_ptrs:
            ptr, nbytes = storage_info(t)
            self._kept[ptr] = nbytes

    # -- recompute ------------------------------------------------------------------
    def ensure_recomputed(self):
        if self.done:
            return
        ndrop = self.recompute_once()
        stats = self.stats
        stats.recompute_calls += 1
        stats.ops_rerun += self.profile.n_rerun
        stats.rerun_by_op.update(self.profile.rerun_counts)
        stats.ops_reused += ndrop

    def _recompute(self):
        run = _LightRun(self, RECOMPUTE)
        args, kwargs = self.inputs
        args = tuple(recompute_input(a) for a in args)
        kwargs = {k: recompute_input(v) for k, v in kwargs.items()}
        collector = self._collector = _Collector()
        with recompute_graph(run, self.precision), self.run_context(RECOMPUTE), \
                ms.saved_tensors_hooks(collector.pack, _keep):
            self.fn(*args, **kwargs)
            saved, collector.saved = collector.saved, None   # the recompute graph keeps the collector
            self._collector = None
        self._check(saved, run)
        self.recomputed = saved
        self.inputs = self.sig = None
        return run.dropout_idx

    def _check(self, saved, run):
        """Raise unless the recompute saved what the forward saved and ran every nn.Dropout of it."""
        sig = self.sig
        got = [(t.shape, t.dtype) for t in saved]
        if got == sig and run.dropout_idx == len(self.dropouts):
            return
        n = min(len(got), len(sig))
        i = next((j for j in range(n) if got[j] != sig[j]), None)
        where = self.profile.describe_save if sig == self.profile.fwd else (lambda j: f"saved tensor #{j}")
        if i is not None:
            raise RuntimeError(
                f"mindformers_ac: recompute diverged from forward at {where(i)}: it was "
                f"{_describe(sig[i])} in forward but {_describe(got[i])} in the recompute. The region must compute "
                "the same shapes and dtypes when run again (no dependence on state that changed since the "
                "forward; a tensor read from outside the region's arguments must be passed as an argument).")
        if len(saved) != len(sig):
            raise RuntimeError(
                f"mindformers_ac: recompute diverged from forward: it saved {len(saved)} tensor(s) for backward, "
                f"the forward {len(sig)}; the first unmatched one is {where(n)}. A checkpointed region must take "
                "the same code path when run again (no branching on global state, step counters or "
                "is_in_recompute() that changes ops), and read tensors only from its arguments.")
        if run.dropout_idx != len(self.dropouts):
            raise RuntimeError(
                f"mindformers_ac: recompute diverged from forward: it called nn.Dropout {run.dropout_idx} "
                f"time(s), the forward {len(self.dropouts)}. A checkpointed region must take the same code "
                "path when run again.")


class DropoutProxy:
    """Stands in for an ``nn.Dropout`` cell's ``dropout`` primitive; hands each call to the running region.

    Outside a region it calls the primitive. Installed by ``checkpoint_wrapper``
    (without a policy) on the ``nn.Dropout`` sub-cells of the wrapped cell;
    wrappers share one proxy per cell (``users``), the last one out restores
    the primitive.
    """

    mac_is_op_proxy = True

    def __init__(self, inner):
        self.mac_inner, self.users = inner, 0

    def __call__(self, x):
        run = ENGINE.top()
        if run is None:
            return self.mac_inner(x)
        return run.dropout_call(self.mac_inner, x)

    def __getattr__(self, name):   # keep Primitive attributes (name, keep_prob ...) reachable
        return getattr(self.__dict__["mac_inner"], name)

    def __deepcopy__(self, memo):   # a copied cell gets the plain primitive (see construct_patch)
        return copy.deepcopy(self.mac_inner, memo)


def install_dropout_proxies(root):
    """Put a ``DropoutProxy`` on every ``nn.Dropout`` under ``root``; returns an undo callable."""
    cells = []
    for _, cell in root.cells_and_names():
        if not isinstance(cell, nn.Dropout):
            continue
        current = cell.__dict__.get("dropout")
        if isinstance(current, DropoutProxy):
            proxy = current
        elif isinstance(current, Primitive) and current.name == "Dropout":
            proxy = DropoutProxy(current)
            object.__setattr__(cell, "dropout", proxy)
        else:
            continue
        proxy.users += 1
        cells.append((cell, proxy))

    def remove():
        for cell, proxy in cells:
            proxy.users -= 1
            if proxy.users == 0 and cell.__dict__.get("dropout") is proxy:
                object.__setattr__(cell, "dropout", proxy.mac_inner)
        cells.clear()
    return remove
