"""The safety net of every re-run (docs/exactness.md, "The safety net"): ``PROBE_SIZE`` evenly spaced elements of a
tensor the forward computed are compared bitwise with the re-run's before any saved tensor leaves the region."""
import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from ...mindspore_compat import no_grad
from ...precision import no_casts
from ...tensors import storage_info, tensor_leaves_in_objects, tensors_equal
from .. import messages
from .base import Rule

PROBE_SIZE = 64

_PROBED = frozenset((ms.float16, ms.bfloat16, ms.float32, ms.float64))


def probed(t):
    """Whether tensor ``t`` can be sampled (a floating dtype, contiguous, not empty)."""
    return t.dtype in _PROBED and t.size > 0 and t.is_contiguous()


def first_probed(out):
    """The first tensor of ``out`` (in any object ``tensor_leaves_in_objects`` searches) that can be sampled."""
    return next((t for t in tensor_leaves_in_objects(out) if probed(t)), None)


class SampleIndex(dict):
    """Per wrapper: tensor shape -> where a ``Sample`` of that shape reads (built once). On the host (the CPU
    build, where ``Tensor.asnumpy`` shares the tensor's memory) the stride of a flat slice: no op runs. On a
    device, the coordinates one ``GatherNd`` takes, which keeps the sample there (``on_host=False``; the CPU
    build has no bfloat16 ``GatherNd``, a device build has)."""

    def __init__(self, on_host=None):
        super().__init__()
        self.on_host = ms.get_context("device_target") == "CPU" if on_host is None else on_host

    def __missing__(self, shape):
        size = int(np.prod(shape))
        step = max(1, size // PROBE_SIZE)
        coords = np.stack(np.unravel_index(np.arange(0, size, step)[:PROBE_SIZE], shape), -1) if shape else [[0]]
        self[shape] = step if self.on_host else Tensor(np.asarray(coords, np.int32))
        return self[shape]


class Sample:
    """``PROBE_SIZE`` evenly spaced elements of tensor ``t`` (None: nothing to sample), copied: on the host, the
    bytes of a strided slice of its memory read in place (about 6 us, against 20-35 us for an op on a CPU tensor);
    on a device, one ``GatherNd`` on the tensor as it is."""

    __slots__ = ("index", "values", "shape", "dtype")

    def __init__(self, t, index):
        self.index = self.values = self.shape = self.dtype = None
        if t is not None:
            self.shape, self.dtype = tuple(t.shape), t.dtype
            self.index = index[self.shape]
            self.values = self._take(t)

    def _take(self, t):
        if isinstance(self.index, int):
            return t.asnumpy().reshape(-1)[::self.index][:PROBE_SIZE].tobytes()
        with no_grad(), no_casts():
            return ops.gather_nd(t if self.shape else t.reshape((1,)), self.index)

    def matches(self, t):
        """Whether ``t`` (the re-run's tensor) holds the sampled elements bitwise."""
        if self.values is None or t is None or tuple(t.shape) != self.shape or t.dtype != self.dtype:
            return self.values is None
        got = self._take(t)
        return got == self.values if isinstance(got, bytes) else tensors_equal(self.values, got)


class SafetyNet(Rule):
    """The intercepting region's samples: its output and the last tensor dropped before the forward's end and before
    and after each kept op (whose kept output hides from the region's output what the re-run computed before it).
    ``index``: the signature's ``SampleIndex`` (a checking call's) or the wrapper's."""

    __slots__ = ("index", "samples", "last_drop", "cut_samples", "cut_pending")

    def __init__(self, region, index):
        super().__init__(region)
        self.index = index
        self.samples = self.last_drop = None
        self.cut_samples = {}     # (kept op index, "before" / "after") -> (key, Sample) of the last drop
        self.cut_pending = None   # (kept op index, "after") until the next op: its packs are made by then

    def note_drop(self, key, t):
        if probed(t):
            self.last_drop = (key, t)   # held until the next kept op or the forward's end, then sampled

    def take_samples(self, run, out):
        """At the end of the forward: its output and the last tensor dropped since the last kept op."""
        if self.cut_pending is not None:
            self.sample_at_kept(run, self.cut_pending)
        t = first_probed(out)
        producer = self.region.bytes.producer.get(storage_info(t)[0]) if t is not None else None
        self.samples = (Sample(t, self.index), producer, self._sample_last_drop())

    def _sample_last_drop(self):
        drop, self.last_drop = self.last_drop, None
        return (drop[0], Sample(drop[1], self.index)) if drop is not None else None

    def sample_at_kept(self, run, point):
        """Forward, at a kept op (``point``: ``(index, "before" / "after")`` its call): sample the last tensor
        dropped since, which may be an argument it saved (K1); the re-run compares at the same point."""
        self.cut_pending = None
        if self.last_drop is not None:
            with run.engine_ops():
                self.cut_samples[point] = self._sample_last_drop()

    def check_at_kept(self, run, point):
        with run.engine_ops():
            self._check_drop(self.cut_samples.get(point))

    def check(self, out, stopped):
        """After the re-run, before a rebuilt tensor leaves the region: the samples hold the forward's values
        bitwise, else ``RecomputeError`` naming the region and the op: a pattern no rule knows fails at once."""
        self._check_drop(self.samples[2])
        if not stopped and not self.samples[0].matches(first_probed(out)):
            raise messages.other_values(self.region.cell_path(), self.describe_output_op())

    def _check_drop(self, drop):
        """``drop``: (key, Sample) of a dropped tensor, or None."""
        if drop is not None and not drop[1].matches(self.region.recomputed.get(drop[0])):
            (idx, k), region = drop[0], self.region
            raise messages.other_values(region.cell_path(), f"op #{idx} {region.describe_op(idx)}, its saved tensor #{k}")

    def describe_output_op(self):
        """``op #7 Add (in 'mlp'), the region's output``: the op that made the sampled output."""
        idx = self.samples[1] if self.samples is not None else None
        return "the region's output" if idx is None else f"op #{idx} {self.region.describe_op(idx)}, the region's output"
