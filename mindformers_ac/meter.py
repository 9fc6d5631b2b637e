"""Measure activation memory on CPU: bytes kept alive for backward.

MindSpore's allocator statistics (``mindspore.runtime.max_memory_allocated``)
read 0 on CPU and tracemalloc does not see tensor storage, so the figure used
throughout this package is *saved-tensor bytes*: every tensor that autograd
packs for backward is counted once per storage (``data_ptr``), parameters are
skipped, and the bytes are released when the last packed reference dies.

Limitation: an engine that installs its own ``saved_tensors_hooks`` inside the
metered region hides the meter (the innermost hook wins), so such engines must
report what they keep themselves (see ``RecomputeStats``).
"""
import weakref

import mindspore as ms

from .tensors import param_ptrs, storage_info


class _Packed:
    """What the meter returns from pack: holds the tensor; its death releases the bytes."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Count bytes kept alive for backward by autograd, deduplicated by storage.

    Use ``with meter.hooks(): loss, grads = grad_fn(...)`` or ``peak_saved_bytes``.
    ``current`` is the bytes held now, ``peak`` the maximum since
    construction; ``counts`` maps a storage base pointer to how many packed
    references hold it (views of one storage count once). Weights (by
    ``data_ptr`` in ``params``) are not counted. The meter is inert outside
    ``hooks()``.
    """

    def __init__(self, params=()):
        self.param_ptrs = param_ptrs(params)
        self.counts = {}        # data_ptr -> number of live packed references
        self._nbytes = {}       # data_ptr -> storage bytes
        self.current = 0
        self.peak = 0

    def _release(self, ptr):
        n = self.counts.get(ptr, 0) - 1
        if n > 0:
            self.counts[ptr] = n
            return
        self.counts.pop(ptr, None)
        nbytes = self._nbytes.pop(ptr, 0)
        self.current -= nbytes
        self.storage_released(ptr, nbytes)

    def storage_added(self, ptr, nbytes):
        """Called once per new storage after ``current``/``peak`` are updated (for subclasses)."""

    def storage_released(self, ptr, nbytes):
        """Called when the last packed reference to a storage dies (for subclasses)."""

    def pack(self, t):
        if t.data_ptr() in self.param_ptrs:
            return t
        ptr, nb = storage_info(t)
        holder = _Packed(t)
        if ptr in self.counts:
            self.counts[ptr] += 1
        else:
            self.counts[ptr] = 1
            self._nbytes[ptr] = nb
            self.current += nb
            self.peak = max(self.peak, self.current)
            self.storage_added(ptr, nb)
        # The callback gets the pointer, not the holder, so it can't keep the holder alive.
        weakref.finalize(holder, self._release, ptr).atexit = False
        return holder

    def unpack(self, packed):
        return packed.tensor if isinstance(packed, _Packed) else packed

    def hooks(self):
        """Context manager installing the meter's pack/unpack (innermost hook wins)."""
        return ms.saved_tensors_hooks(self.pack, self.unpack)


def peak_saved_bytes(fn, *args, params=(), weights=None, meter=None):
    """Run one forward+backward of ``fn(*args)`` under a fresh meter; return peak kept bytes.

    ``fn`` returns a scalar loss (or a tuple whose first item is the loss).
    ``params`` are excluded from the count; gradients are taken w.r.t.
    ``weights`` (default: ``params``). Pass ``meter`` to inspect counts after.
    The gradients are computed and discarded; no optimizer step is taken.
    """
    params = list(params)
    meter = meter if meter is not None else SavedTensorMeter(params)
    weights = params if weights is None else list(weights)
    grad_fn = ms.value_and_grad(fn, grad_position=None, weights=weights)
    with meter.hooks():
        out = grad_fn(*args)
    del out
    return meter.peak
