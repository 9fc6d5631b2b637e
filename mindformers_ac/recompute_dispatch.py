"""Engine internals of op-level recompute: per-thread state, op dispatch, saved-tensor packing.

How a region works (see ``recompute.checkpoint`` for the user contract):

* Forward: the region's function runs under a ``MsDispatchMode`` that numbers
  every op and asks the policy, *before* the op runs (legacy ops such as
  LayerNorm or Dropout pack their saved tensors inside the call), whether to
  keep it, and under ``saved_tensors_hooks`` whose pack replaces every tensor
  saved by a recomputed op with a ``_Token`` (op index, pack number) that does
  not hold the tensor.
* Backward: the first unpack of a token re-runs the function on the saved
  inputs, in a throw-away graph, under the same numbering; the recompute pack
  hook files each regenerated tensor under its key and the token takes it.
  Kept ops are not run again: their cached outputs are returned in place.
* Random ops are never run again. ``Dropout`` (the only random kernel the CPU
  build has on this path) keeps its mask as packed bits and its output is
  rebuilt as ``x * (mask * (1 / keep_prob))``, a formula checked bitwise
  against the kernel once per dtype and keep_prob (if the check fails the
  outputs are kept instead); other random ops keep their outputs.
"""
import functools
import logging
import re
import threading
import types

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops
from mindspore.ops import Primitive
from mindspore.utils import MsDispatchMode


logger = logging.getLogger("mindformers_ac.recompute")

# Names of ops whose output cannot be reproduced by running them again.
RANDOM_OP_PATTERN = re.compile(
    r"dropout|uniform|normal(?!ize)|random|bernoulli|multinomial|randperm|randint|randn|^rand|"
    r"^gamma|poisson|shuffle|seed", re.IGNORECASE)

FORWARD, RECOMPUTE, REPLAY = "forward", "recompute", "replay"

# Decisions recorded per op index in forward (absent = recompute).
SAVE, SWAP, REBUILD = "save", "swap", "rebuild"


# A random primitive with this attribute set to True promises that calling it again on the same
# inputs draws the same output (a fresh primitive with explicit seeds: a counter-based RNG).
REPLAYABLE_ATTR = "mac_replayable"


def is_random_op_name(name):
    """True if an op called ``name`` draws random numbers (its output is always kept)."""
    return bool(name) and RANDOM_OP_PATTERN.search(name) is not None


def is_unreplayable_random_op(name, args):
    """True if op ``name`` called with ``args`` draws random numbers that a second call would not repeat.

    Legacy ops are dispatched with their primitive as the first argument; a
    primitive marked ``mac_replayable = True`` is recomputed like any other op
    instead of keeping its output or mask.
    """
    if not is_random_op_name(name):
        return False
    return not (args and getattr(args[0], REPLAYABLE_ATTR, False) is True)


def op_name_of(op):
    """Name of a dispatched op (``op.name`` is a str, or a method on some op kinds)."""
    name = getattr(op, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else type(op).__name__


class _Engine:
    """Per-thread stack of running regions plus the few process-wide caches of the engine."""

    def __init__(self):
        self._local = threading.local()
        self._lock = threading.Lock()
        self._warned = set()
        self._dropout_formula_ok = {}   # (dtype, keep_prob) -> bool

    def _state(self):
        local = self._local
        if not hasattr(local, "runs"):
            local.runs = []
            local.recompute_depth = 0
        return local

    def top(self):
        runs = self._state().runs
        return runs[-1] if runs else None

    def push(self, run):
        self._state().runs.append(run)

    def pop(self, run):
        runs = self._state().runs
        if not runs or runs[-1] is not run:
            raise RuntimeError("mindformers_ac: region stack corrupted (a region exited out of order)")
        runs.pop()

    def in_recompute(self):
        return self._state().recompute_depth > 0

    def enter_recompute(self):
        self._state().recompute_depth += 1

    def exit_recompute(self):
        self._state().recompute_depth -= 1

    def warn_once(self, key, msg, *args):
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning(msg, *args)

    def dropout_formula_ok(self, x, out, mask, keep_prob):
        """Check once per (dtype, keep_prob) that ``_dropout_formula`` equals the kernel bitwise."""
        key = (str(x.dtype), float(keep_prob))
        ok = self._dropout_formula_ok.get(key)
        if ok is None:
            mn = mask.asnumpy()
            ok = bool(np.isin(mn, (0, 1)).all())
            if ok:
                with ms._no_grad():   # a check, not part of the graph
                    rebuilt = _dropout_formula(x, mask, keep_prob)
                ok = np.array_equal(rebuilt.asnumpy(), out.asnumpy())
            self._dropout_formula_ok[key] = ok
            if not ok:
                logger.warning("Dropout output can't be rebuilt bitwise from its mask for %s; "
                               "keeping Dropout outputs instead (more memory, still exact)", key)
        return ok


# Process-wide on purpose: ``is_in_recompute()`` and nested regions must be answerable from any
# code on the thread, without a handle; the mutable per-run state is thread-local inside it.
ENGINE = _Engine()


def _dropout_formula(x, mask, keep_prob):
    """The CPU kernel's ``out = mask * x * (1/keep_prob)`` as ``x * (mask * scale)``.

    With mask in {0, 1} both orders round identically (x*scale or a signed
    zero); the scale is rounded in the mask dtype as the kernel does. Runs a
    MindSpore op so that the rebuilt output carries gradient history from ``x``
    (the recompute must record the ops that consume it).
    """
    mask = mask.asnumpy() if isinstance(mask, Tensor) else mask
    dt = mask.dtype
    scaled = mask * (dt.type(1.0) / dt.type(keep_prob))
    return ops.mul(x, Tensor(scaled))


class _DropoutRecord:
    """A Dropout result kept as 1 bit per element; rebuilds (output, mask) from the op's input."""

    __slots__ = ("bits", "shape", "dtype", "keep_prob", "pack_outputs")

    def __init__(self, mask, keep_prob):
        m = mask.asnumpy()
        self.shape, self.dtype = m.shape, m.dtype
        self.bits = np.packbits(m != 0)
        self.keep_prob = keep_prob
        self.pack_outputs = []   # (pack number, output index) of the packs the op made in forward

    @property
    def nbytes(self):
        return int(self.bits.nbytes)

    def rebuild(self, x):
        n = int(np.prod(self.shape))
        mask = np.unpackbits(self.bits, count=n).reshape(self.shape).astype(self.dtype)
        return _dropout_formula(x, mask, self.keep_prob), Tensor(mask)


def dropout_input(args):
    """(x, keep_prob) of a dispatched legacy ``Dropout`` call ``(prim, name, (x, keep_prob, seed0, seed1))``."""
    if len(args) == 3 and isinstance(args[2], tuple) and len(args[2]) >= 2 and isinstance(args[2][0], Tensor):
        return args[2][0], float(args[2][1])
    return None, None


class OpContext:
    """What a ``policy_fn`` learns about the op being dispatched.

    ``op_name``: dispatched op name (``MatMulExt``, ``Softmax``, ``Dropout`` ...).
    ``cell_path``: dotted path of the innermost sub-cell running, relative to the
    region root ('' at the root). ``op_path``: ``cell_path + '.' + op_name``.
    ``attr_path``: path of the op attribute being called (e.g.
    ``self_attention.core_attention.bmm_qk``, ``mlp.activation_func`` for every
    op gelu runs), tracked for cell regions; otherwise a guess (the only
    Primitive or function attribute of the innermost cell named like the op),
    or None.
    ``is_recompute``: True in the backward-time re-run. ``op_index``: order in the region.
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
        if self._attr_path is not None:
            return self._attr_path
        attr = _find_op_attr(self._cell, self.op_name)
        if attr is None:
            return None
        return f"{self.cell_path}.{attr}" if self.cell_path else attr


def _norm_op_name(name):
    name = name.lower().replace("_", "")
    return name[:-3] if name.endswith("ext") else name


def _find_op_attr(cell, op_name):
    if cell is None:
        return None
    want = _norm_op_name(op_name)
    found = []
    for attr, value in vars(cell).items():
        if attr.startswith("_") or not callable(value) or isinstance(value, ms.nn.Cell):
            continue
        name = getattr(value, "name", None) or getattr(value, "__name__", None)
        if isinstance(name, str) and _norm_op_name(name) == want:
            found.append(attr)
    # Two attributes running the same op (bmm_qk, bmm_pv) can't be told apart from the op alone.
    return found[0] if len(found) == 1 else None


def is_op_attribute(value):
    """A cell attribute that runs ops when called: a Primitive, a function, or one of our proxies."""
    return isinstance(value, (Primitive, types.FunctionType, types.BuiltinFunctionType, functools.partial)) \
        or getattr(value, "mac_is_op_proxy", False)


class AttrProxy:
    """Instance-attribute stand-in that names the attribute for the policy while its op runs.

    ``mac_inner`` is the wrapped callable (a later ``wrap_op_output`` may swap it).
    """

    mac_is_op_proxy = True

    def __init__(self, tracker, path, inner):
        self.mac_tracker, self.mac_path, self.mac_inner = tracker, path, inner

    def __call__(self, *args, **kwargs):
        run = ENGINE.top()
        if run is None or run.region.tracker is not self.mac_tracker:
            return self.mac_inner(*args, **kwargs)
        run.attrs.append(self.mac_path)
        try:
            return self.mac_inner(*args, **kwargs)
        finally:
            run.attrs.pop()

    def __getattr__(self, name):   # keep Primitive attributes (name, attrs ...) reachable
        return getattr(self.__dict__["mac_inner"], name)


class _Swapped:
    """A tensor handed to a swap executor; loaded back on unpack."""

    __slots__ = ("executor", "handle")

    def __init__(self, executor, tensor):
        self.executor, self.handle = executor, executor.offload(tensor)

    def load(self):
        return self.executor.load(self.handle)


class _Token:
    """Stands in for a dropped saved tensor; holds the region (not the tensor) until backward."""

    __slots__ = ("region", "key", "tensor")

    def __init__(self, region, key):
        self.region, self.key, self.tensor = region, key, None

    def resolve(self):
        if self.tensor is not None:
            return self.tensor
        region = self.region
        region.ensure_recomputed()
        t = region.recomputed.pop(self.key, None)
        if t is None:
            raise RuntimeError(
                f"mindformers_ac: saved tensor {self.key} of a checkpointed region was not regenerated by "
                "its recompute (was the graph backpropagated twice, or does the region's forward depend "
                "on state that changed since?). Run backward once per forward.")
        return t


def unpack_saved(obj):
    """Unpack hook shared by all region forwards."""
    if isinstance(obj, _Token):
        return obj.resolve()
    if isinstance(obj, _Swapped):
        return obj.load()
    return obj


def _identity(obj):
    return obj


def _drop(_tensor):
    # The replay graph is never backpropagated: keep nothing alive for it.
    return None


class _Run:
    """One execution (forward, recompute, or replay) of a region's function."""

    def __init__(self, region, mode):
        self.region, self.mode = region, mode
        self.op_idx = -1
        self.inside = []       # op indices whose call is in progress (legacy ops pack inside)
        self.last = None       # index of the op that returned last (pyboost ops pack after)
        self.npacks = {}       # op index -> packs so far
        self.path = []         # [(name, cell)] of sub-cells entered, maintained by PathTracker
        self.attrs = []        # op attribute paths being called, maintained by AttrProxy
        self.child_idx = 0     # nested regions met so far
        self.in_hook = False   # our own code running ops (swap offload): not part of the region
        self.pending = []      # (token, tensor) packed inside a Dropout call, resolved when it returns

    def cell_path(self):
        return self.path[-1][0] if self.path else ""

    def cell(self):
        return self.path[-1][1] if self.path else self.region.root

    def current_op(self):
        return self.inside[-1] if self.inside else self.last

    def next_key(self):
        idx = self.current_op()
        if idx is None:
            return None
        k = self.npacks.get(idx, 0)
        self.npacks[idx] = k + 1
        return idx, k

    # -- forward pack: decide what the region keeps ---------------------------------
    def pack_forward(self, t):
        region = self.region
        if self.in_hook:
            return t
        key = self.next_key()   # first: the recompute numbers every pack, weights included
        ptr = t.data_ptr()
        if ptr in region.param_ptrs:
            return t
        decision = region.decisions.get(key[0]) if key is not None else SAVE
        if decision == SAVE or (ptr in region.input_ptrs and not region.swap_inputs):
            region.account_kept(t)
            return t
        if decision == SWAP:
            return region.offload(self, t)
        token = _Token(region, key)
        region.token_keys.add(key)
        if decision == REBUILD:
            self.pending.append((token, t))   # settled when the Dropout returns (finish_dropout)
        else:
            region.account_dropped(t)
        return token

    # -- recompute pack: file regenerated tensors under their forward keys ---------
    def pack_recompute(self, t):
        if self.in_hook:
            return None
        key = self.next_key()
        if key is not None and key in self.region.token_keys:
            self.region.recomputed[key] = t
        return None


class RegionDispatch(MsDispatchMode):
    """Numbers ops of one run and applies the region's keep/recompute decisions."""

    def __init__(self, run):
        super().__init__()
        self.run = run

    def __ms_dispatch__(self, func, args, kwargs=None):
        run = self.run
        kwargs = kwargs or {}
        # Ops of a nested region, or run by our own hooks, belong to nobody here; skipping
        # them in forward and recompute alike keeps the numbering aligned.
        if run.in_hook or ENGINE.top() is not run:
            return func(*args, **kwargs)
        run.op_idx += 1
        idx = run.op_idx
        if run.mode == FORWARD:
            return self._forward_op(run, idx, func, args, kwargs)
        return self._recompute_op(run, idx, func, args, kwargs)

    @staticmethod
    def _call(run, idx, func, args, kwargs):
        run.inside.append(idx)
        try:
            return func(*args, **kwargs)
        finally:
            run.inside.pop()
            run.last = idx

    def _forward_op(self, run, idx, func, args, kwargs):
        region = run.region
        name = op_name_of(func)
        region.op_names.append(name)
        region.stats.ops_forward += 1
        decision = region.decide(run, idx, name, func, args, kwargs)
        if decision is not None:
            region.decisions[idx] = decision   # before the call: legacy ops pack inside it
        out = self._call(run, idx, func, args, kwargs)
        region.note_outputs(idx, out)
        if decision == REBUILD:
            region.finish_dropout(run, idx, args, out)
        elif decision in (SAVE, SWAP):
            region.cache_output(run, idx, out)
        return out

    def _recompute_op(self, run, idx, func, args, kwargs):
        region = run.region
        name = op_name_of(func)
        if idx >= len(region.op_names) or region.op_names[idx] != name:
            expected = region.op_names[idx] if idx < len(region.op_names) else "<end of region>"
            raise RuntimeError(
                f"mindformers_ac: recompute diverged from forward at op #{idx}: forward ran {expected}, "
                f"recompute runs {name}. A checkpointed region must take the same code path when run "
                "again (no branching on global state, step counters or is_in_recompute() that changes ops).")
        if region.policy_fn is not None:
            region.ask_policy(run, idx, name, func, args, kwargs)   # lets the policy observe the re-run
        decision = region.decisions.get(idx)
        if decision is None:
            region.stats.count_rerun(name)
            return self._call(run, idx, func, args, kwargs)
        region.stats.ops_reused += 1
        run.last = idx
        if decision == REBUILD:
            return region.rebuild_dropout(run, idx, args)
        return region.cached_output(idx)
