"""Random ops in a recomputed region (docs/exactness.md, "Random ops"): which ones can't be run again (a second call
draws other numbers), and how ``Dropout``, the only random kernel the CPU build has on this path, is rebuilt from its
mask bits exactly."""
import functools
import logging
import re

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops
from mindspore.ops import Primitive

from ..mindspore_compat import generator_random_op, no_grad
from ..precision import no_casts
from . import messages

logger = logging.getLogger("mindformers_ac.recompute")

_HALF = (ms.float16, ms.bfloat16)   # dtypes the CPU Dropout kernel computes in float32

# Names of ops whose output cannot be reproduced by running them again: the fallback for an op MindSpore
# does not mark (``is_random_op``).
RANDOM_OP_PATTERN = re.compile(
    r"dropout|uniform|normal(?!ize)|random|bernoulli|multinomial|randperm|randint|randn|^rand|"
    r"^gamma|poisson|shuffle|seed|laplace|cauchy", re.IGNORECASE)

# A random primitive with this attribute set to True promises that calling it again on the same
# inputs draws the same output (a fresh primitive with explicit seeds: a counter-based RNG).
REPLAYABLE_ATTR = "mac_replayable"


def is_random_primitive(prim):
    """True for a primitive MindSpore marks as random: ``side_effect_hidden`` (every primitive of
    ``ops/operations/random_ops.py``, Dropout), or the seeds it draws from."""
    attrs = prim.attrs if isinstance(getattr(prim, "attrs", None), dict) else {}
    return attrs.get("side_effect_hidden") is True or "seed" in attrs or "seed2" in attrs


@functools.lru_cache(maxsize=None)   # a fact of MindSpore's op tables and of the name: asked once per op name
def is_random_op_name(name):
    """True if an op called ``name`` draws random numbers by MindSpore's own op table (a pyboost op dispatched
    without its primitive: ``generator_random_op``), or by its name (the fallback)."""
    return bool(name) and (generator_random_op(name) or RANDOM_OP_PATTERN.search(name) is not None)


def is_random_op(name, args):
    """True if op ``name`` called with ``args`` (a legacy op's primitive first) draws random numbers."""
    return (bool(args) and isinstance(args[0], Primitive) and is_random_primitive(args[0])) or is_random_op_name(name)


def is_unreplayable_random_op(name, args):
    """True if op ``name`` called with ``args`` draws random numbers that a second call would not repeat (one marked
    ``REPLAYABLE_ATTR`` is recomputed like any other op)."""
    return is_random_op(name, args) and not (args and getattr(args[0], REPLAYABLE_ATTR, False) is True)


class DropoutFormulaCheck:
    """Whether ``dropout_formula`` equals the kernel bitwise (as bit patterns: a NaN equals itself, -0 differs from
    0), checked once per (dtype, keep_prob). Only a call whose input and output are all finite decides the cached
    answer: an overflowed step (which a loss scaler skips) is judged for itself alone, so it can neither cache a
    failure for the process nor log one."""

    def __init__(self):
        self._ok = {}   # (dtype, keep_prob) -> bool, from finite calls only

    def __call__(self, x, out, mask, keep_prob):
        key = (str(x.dtype), float(keep_prob))
        ok = self._ok.get(key)
        if ok is not None:
            return ok
        on, mn = out.asnumpy(), mask.asnumpy()
        ok = False
        if np.isin(mn, (0, 1)).all():
            with no_grad():   # a check, not part of the graph
                rebuilt = dropout_formula(x, mn, keep_prob).asnumpy()
            bits = np.dtype(f"u{on.dtype.itemsize}")
            ok = rebuilt.dtype == on.dtype and rebuilt.shape == on.shape and \
                np.array_equal(rebuilt.view(bits), on.view(bits))
        if np.isfinite(x.asnumpy()).all() and np.isfinite(on).all():
            self._ok[key] = ok
            if not ok:
                logger.warning(messages.DROPOUT_NOT_REBUILT, key)
        return ok


def dropout_formula(x, mask, keep_prob):
    """The CPU kernel's ``out = mask * x * (1/keep_prob)`` as ``x * (mask * scale)`` (``mask``: a numpy array). With
    mask in {0, 1} both orders round identically (x*scale or a signed zero); the scale is rounded in the mask dtype as
    the kernel does, except for float16 / bfloat16, which the kernel computes in float32. Runs a MindSpore op so that
    the rebuilt output carries gradient history from ``x`` (the recompute must record the ops that consume it)."""
    if x.dtype in _HALF:
        # rounded once at the end, and without mixed-precision casts (they would change the dtypes computed in)
        scaled = mask.astype(np.float32) * (np.float32(1.0) / np.float32(keep_prob))
        with no_casts():
            return ops.cast(ops.mul(ops.cast(x, ms.float32), Tensor.from_numpy(scaled)), x.dtype)
    dt = mask.dtype
    scaled = mask * (dt.type(1.0) / dt.type(keep_prob))
    return ops.mul(x, Tensor.from_numpy(scaled))   # a fresh array of ours: no copy needed


class DropoutRecord:
    """One Dropout kernel call of a forward, on either path: its mask as 1 bit per element, from which ``rebuild``
    makes (output, mask) again from the op's input; or, when ``dropout_formula`` does not reproduce the kernel
    bitwise (``rebuilds`` False), its outputs ``out``, ``kept``."""

    __slots__ = ("bits", "shape", "dtype", "keep_prob", "meta", "kept", "pack_outputs", "rebuilt")

    def __init__(self, x, out, keep_prob, rebuilds):
        self.meta = (tuple(x.shape), x.dtype)   # the input's, checked by a light re-run
        self.keep_prob, self.kept, self.bits = keep_prob, None if rebuilds else out, None
        self.pack_outputs = []   # intercepting path: (pack number, output index) of the packs the op made
        self.rebuilt = []        # light path: the re-run's (output, mask), which its packs unpack
        if rebuilds:
            m = out[1].asnumpy()
            self.shape, self.dtype = m.shape, m.dtype
            self.bits = np.packbits(m != 0)

    def rebuild(self, x):
        mask = np.unpackbits(self.bits, count=int(np.prod(self.shape))).reshape(self.shape).astype(self.dtype)
        return dropout_formula(x, mask, self.keep_prob), Tensor.from_numpy(mask)


def dropout_input(args):
    """(x, keep_prob) of a dispatched legacy ``Dropout`` call ``(prim, name, (x, keep_prob, seed0, seed1))``."""
    if len(args) == 3 and isinstance(args[2], tuple) and len(args[2]) >= 2 and isinstance(args[2][0], Tensor):
        return args[2][0], float(args[2][1])
    return None, None

