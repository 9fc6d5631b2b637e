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
import logging
import weakref

import mindspore as ms

logger = logging.getLogger("mindformers_ac.meter")

MiB = 2 ** 20


def rss():
    """Resident set size of this process in bytes (includes MindSpore's pool, which never shrinks)."""
    import psutil  # local import: only the RSS helpers need it
    return psutil.Process().memory_info().rss


def _status_field(name):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{name} not found in /proc/self/status (Linux only)")


def vm_hwm():
    """Peak resident set size (VmHWM) in bytes since start or the last ``reset_hwm()``. Linux only."""
    return _status_field("VmHWM")


def reset_hwm():
    """Reset VmHWM to the current RSS (writes 5 to /proc/self/clear_refs). Linux only."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def storage_info(t):
    """(base pointer, bytes) of the storage behind ``t``: views of one storage share the key."""
    try:
        storage = t.untyped_storage()
        return int(storage.data_ptr()), int(storage.nbytes())
    except Exception:  # some tensor kinds have no untyped_storage on CPU
        return int(t.data_ptr()), int(t.nbytes)


def storage_nbytes(t):
    """Bytes of the storage behind tensor ``t``."""
    return storage_info(t)[1]


def param_ptrs(params):
    """Set of ``data_ptr`` of the given parameters (weights arrive in pack as plain tensors sharing them)."""
    ptrs = set()
    for p in params:
        try:
            ptrs.add(p.data_ptr())
        except Exception:  # a parameter not yet initialised has no storage; it can't be packed either
            continue
    return ptrs


class _Packed:
    """What the meter returns from pack: holds the tensor; its death releases the bytes."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Count bytes kept alive for backward by autograd, deduplicated by storage.

    Use ``with meter.hooks(): loss, grads = grad_fn(...)`` or ``measure_step``.
    ``current`` is the bytes held now, ``peak`` the maximum since construction
    or ``reset_peak()``; ``counts`` maps a storage base pointer to how many
    packed references hold it (views of one storage count once). Weights (by ``data_ptr`` in ``params``) are not
    counted. The meter is inert outside ``hooks()``.
    """

    def __init__(self, params=()):
        self.param_ptrs = param_ptrs(params)
        self.counts = {}        # data_ptr -> number of live packed references
        self._nbytes = {}       # data_ptr -> storage bytes
        self.current = 0
        self.peak = 0
        self.n_pack = 0
        self.n_unpack = 0

    def reset_peak(self):
        self.peak = self.current

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
        self.n_pack += 1
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
        self.n_unpack += 1
        return packed.tensor if isinstance(packed, _Packed) else packed

    def hooks(self):
        """Context manager installing the meter's pack/unpack (innermost hook wins)."""
        return ms.saved_tensors_hooks(self.pack, self.unpack)


def measure_step(fn, *args, params=(), weights=None, meter=None):
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
