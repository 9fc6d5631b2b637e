"""The safety net of every re-run: a bitwise sample of a tensor both runs computed (docs/exactness.md, "The
safety net").

Whatever pattern no rule knows (an op whose output depends on Python state, a branch on a flag changed since
the forward), a re-run that computes other values than its forward must not hand them to backward. Each
region keeps ``PROBE_SIZE`` evenly spaced elements of a tensor its forward computed (its first floating
output, or, when its re-run may stop early, the last tensor it dropped) and compares them bitwise with the
re-run's before any saved tensor leaves the region: one ``GatherNd`` per forward and per re-run.
"""
import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from ..mindspore_compat import no_grad
from ..precision import no_casts
from ..tensors import tensor_leaves_in_objects as tensor_leaves  # issue 49: the walk stays here for now
from ..tensors import tensors_equal

PROBE_SIZE = 64

# bfloat16 is left out: the CPU build has no bfloat16 Gather or GatherNd, and a cast of the whole tensor would
# cost more than the probe is worth; a region whose outputs are all bfloat16 is not probed (docs/exactness.md).
_PROBED = (ms.float16, ms.float32, ms.float64)


def probed(t):
    """Whether tensor ``t`` can be sampled (a floating dtype the CPU build gathers, contiguous, not empty)."""
    return t.dtype in _PROBED and t.size > 0 and t.is_contiguous()


def first_probed(out):
    """The first tensor of ``out`` (nested in any object ``tensor_leaves`` searches) that can be sampled."""
    return next((t for t in tensor_leaves(out) if probed(t)), None)


class SampleIndex:
    """Per wrapper: output shape -> the coordinates a ``Sample`` of that shape gathers (built once)."""

    __slots__ = ("_index",)

    def __init__(self):
        self._index = {}

    def of(self, shape):
        index = self._index.get(shape)
        if index is None:
            positions = np.arange(0, int(np.prod(shape)), max(1, int(np.prod(shape)) // PROBE_SIZE))[:PROBE_SIZE]
            coords = np.stack(np.unravel_index(positions, shape), -1) if shape else positions[:, None]
            index = self._index[shape] = Tensor(coords.astype(np.int32))
        return index


class Sample:
    """``PROBE_SIZE`` elements of tensor ``t`` (None: nothing to sample), copied: one ``GatherNd`` on the
    tensor as it is (a flattening view first would cost another op, about 8 us at the small shape)."""

    __slots__ = ("index", "values", "shape")

    def __init__(self, t, index):
        self.index = self.values = self.shape = None
        if t is None:
            return
        self.shape = tuple(t.shape)
        self.index = index.of(self.shape)
        self.values = self._take(t)

    def _take(self, t):
        with no_grad(), no_casts():
            return ops.gather_nd(t if self.shape else t.reshape((1,)), self.index)

    def matches(self, t):
        """Whether ``t`` (the re-run's tensor) holds the sampled elements bitwise."""
        if self.values is None:
            return True
        return t is not None and tuple(t.shape) == self.shape and tensors_equal(self.values, self._take(t))
