"""Swap executor (offload/load of single tensors) and the swap report.

``SwapExecutor`` is the duck-typed object other engines call:

    handle = executor.offload(tensor)     # tensor copied to host; device memory may be dropped
    tensor = executor.load(handle)        # a device tensor with the same values

The scheduler (``scheduler.py``) uses the split form (``start_offload`` in pack,
``finish_offload`` at the end of the layer's forward, ``prefetch`` when the
trigger layer's backward starts, ``load`` in unpack) so copies overlap compute.
"""
import collections
import logging
import weakref

from .backends import HostBufferPool, UnsupportedTensorError, select_backend

logger = logging.getLogger("mindformers_ac.swap")

_STAT_FIELDS = ("offloaded_bytes", "num_offloaded", "prefetched_bytes", "late_bytes", "on_demand_bytes",
                "num_on_demand", "resident_bytes", "num_resident", "over_budget_bytes", "dedup_hits")


class LayerSwapStats:
    """Per-layer counters for one step.

    offloaded_bytes     bytes copied to host (one copy per storage view)
    prefetched_bytes    bytes whose prefetch had completed when backward asked for them
    late_bytes          bytes prefetched but still in flight when needed (backward waited)
    on_demand_bytes     bytes loaded synchronously because no prefetch was issued
    resident_bytes      saved bytes left on the device for backward (storage bytes,
                        deduplicated; inputs, small tensors, over-budget, policy-kept)
    over_budget_bytes   part of resident_bytes kept because the host pool was full
    """

    __slots__ = _STAT_FIELDS + ("kept_reasons",)

    def __init__(self):
        for f in _STAT_FIELDS:
            setattr(self, f, 0)
        self.kept_reasons = collections.Counter()

    def as_dict(self):
        d = {f: getattr(self, f) for f in _STAT_FIELDS}
        d["kept_reasons"] = dict(self.kept_reasons)
        return d


class SwapReport:
    """What the swap engine did, per step and per layer key.

    ``layers[key]`` holds the current step's ``LayerSwapStats``; ``events`` the
    step's ordered prefetch/load events as tuples (``("prefetch", key, trigger)``,
    ``("load", key, "in_time" | "late" | "on_demand")``). ``end_step()`` returns a
    snapshot dict, keeps the last ``history`` snapshots and starts a new step.
    ``live_resident_bytes``/``peak_resident_bytes``: device bytes held for
    backward by swap regions right now / at the peak since ``end_step``
    (kept tensors plus offloads whose copy has not finished).
    """

    def __init__(self, history=8):
        self.history = collections.deque(maxlen=history)
        self.pool_stats = None       # callable set by the executor
        self._resident = {}          # storage ptr -> [refcount, nbytes]
        self.live_resident_bytes = 0
        self.reset()

    def reset(self):
        """Forget the current step's counters (the live resident count stays: those tensors are alive)."""
        self.layers = collections.defaultdict(LayerSwapStats)
        self.events = collections.deque(maxlen=4096)   # bounded: callers may never call end_step
        self.step = getattr(self, "step", 0)
        self.peak_resident_bytes = self.live_resident_bytes

    def add_resident(self, ptr, nbytes):
        ent = self._resident.get(ptr)
        if ent is None:
            self._resident[ptr] = [1, nbytes]
            self.live_resident_bytes += nbytes
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.live_resident_bytes)
        else:
            ent[0] += 1

    def hold(self, nbytes):
        """Count device bytes held for an offload until its copy is verified (no dedup: one per handle)."""
        self.live_resident_bytes += nbytes
        if self.live_resident_bytes > self.peak_resident_bytes:
            self.peak_resident_bytes = self.live_resident_bytes

    def release(self, nbytes):
        self.live_resident_bytes -= nbytes

    def drop_resident(self, ptr):
        ent = self._resident.get(ptr)
        if ent is None:
            return
        ent[0] -= 1
        if ent[0] == 0:
            del self._resident[ptr]
            self.live_resident_bytes -= ent[1]

    def as_dict(self):
        d = {"step": self.step, "layers": {k: v.as_dict() for k, v in self.layers.items()},
             "events": list(self.events), "live_resident_bytes": self.live_resident_bytes,
             "peak_resident_bytes": self.peak_resident_bytes}
        for f in _STAT_FIELDS[:-1]:
            d[f] = sum(getattr(v, f) for v in self.layers.values())
        if self.pool_stats is not None:
            d.update(self.pool_stats())
        return d

    def end_step(self):
        """Snapshot this step (see ``as_dict``), keep it in ``history``, start the next step."""
        snap = self.as_dict()
        self.history.append(snap)
        self.step += 1
        self.reset()
        return snap


class SwapHandle:
    """One offloaded tensor. Returned by ``SwapExecutor.offload``; pass it to ``load``.

    Holds the host copy (a pool buffer, given back after the load or, when the
    backend's loads alias it, when the handle dies), the device tensor until ``finish_offload``, and a weak
    reference to it for the late in-place check at load time.
    """

    __slots__ = ("key", "tag", "nbytes", "owner", "refs", "_ticket", "_buf", "_give_back", "_device", "_probe",
                 "_load", "_loaded", "__weakref__")

    def __init__(self, key, tag, nbytes):
        self.key, self.tag, self.nbytes = key, tag, nbytes
        self.owner = None          # the scheduler group, if any
        self.refs = 1              # packs sharing this handle (dedup); the cached load is dropped at 0
        self._ticket = self._buf = self._give_back = self._device = self._probe = None
        self._load = self._loaded = None

    @property
    def on_device(self):
        return self._ticket is None

    @property
    def prefetched(self):
        return self._load is not None or self._loaded is not None

    def _release(self):
        # Once: after the load, or when the handle dies (always, when loads alias the buffer).
        buf, self._buf = self._buf, None
        if buf is not None:
            self._give_back(buf, self.nbytes)

    def __del__(self):
        # Cheaper than a weakref.finalize per handle; a handle is freed by reference counting
        # as soon as autograd drops it.
        self._release()


class SwapExecutor:
    """Offloads tensors to host buffers and loads them back through a copy backend.

    Args:
        backend: a copy backend (default: ``select_backend()`` from the device target).
        max_pool_bytes: bound of the host buffer pool (None: unbounded). A tensor that
            does not fit stays on the device and is counted as ``over_budget``.
        verify: compare the device tensor with its host copy when the offload finishes
            and, if the tensor is still alive, again at load; a difference means it was
            modified in place after being saved and raises RuntimeError.
        report: a ``SwapReport`` to count into (default: a new one).

    Call ``close()`` (or drop the executor) to stop the worker thread.
    """

    def __init__(self, backend=None, max_pool_bytes=None, verify=True, report=None):
        self.backend = backend if backend is not None else select_backend()
        self._aliased = getattr(self.backend, "loads_alias_host", False)
        self.pool = HostBufferPool(self.backend.alloc_host, max_pool_bytes,
                                   fence=getattr(self.backend, "fence", None))
        self.verify = verify
        self.report = report if report is not None else SwapReport()
        self.report.pool_stats = self.pool.stats
        self._give_back = self.pool.release_later if self._aliased else self.pool.release
        self._drop_source = getattr(self.backend, "drop_source", None)
        self._closer = weakref.finalize(self, self.backend.close)

    # --- offload -------------------------------------------------------------------------
    def start_offload(self, tensor, key=None, tag=None):
        """Start copying ``tensor`` to host. Returns a SwapHandle, or None if it must stay on device
        (pool bound reached: counted as over budget; dtype the backend cannot copy)."""
        nbytes = int(tensor.nbytes)
        buf = self.pool.acquire(nbytes)
        if buf is None:
            return None
        try:
            ticket = self.backend.start_d2h(tensor, buf)
        except UnsupportedTensorError as err:
            self.pool.release(buf, nbytes)
            logger.debug("keeping tensor on device: %s", err)
            return None
        h = SwapHandle(key, tag, nbytes)
        h._ticket, h._device, h._buf, h._give_back = ticket, tensor, buf, self._give_back
        return h

    def finish_offload(self, handle):
        """Wait for the copy, check the tensor was not modified meanwhile, drop the device reference."""
        tensor, handle._device = handle._device, None
        if handle.on_device or tensor is None:
            return
        self.backend.wait_d2h(handle._ticket)
        if self.verify:
            self._check_unchanged(handle, tensor, "before its layer's forward ended")
        if self._drop_source is not None:
            self._drop_source(handle._ticket)
        if self.verify:
            try:
                handle._probe = weakref.ref(tensor)
            except TypeError:  # tensor kinds without weakref support: only the forward-time check applies
                pass

    def _check_unchanged(self, handle, tensor, when):
        if self.backend.matches(handle._ticket, tensor) is False:
            raise RuntimeError(
                f"a tensor saved for backward (shape {tuple(tensor.shape)}, dtype {tensor.dtype}, "
                f"swap group {handle.key!r}, tag {handle.tag!r}) was modified in place {when}, after it "
                "was offloaded to host; backward would use stale values. Keep it on the device "
                "(policy_fn -> CheckpointPolicy.MUST_SAVE, custom_check_fn -> False, or exclude the op), "
                "or modify a copy instead of the saved tensor.")

    def offload(self, tensor, key=None, tag=None):
        """Synchronous offload for other engines: returns a handle; ``load(handle)`` gives the tensor back.
        If the pool is full the handle keeps the tensor on the device (counted as over budget)."""
        h = self.start_offload(tensor, key, tag)
        if h is None:
            h = SwapHandle(key, tag, int(tensor.nbytes))
            h._loaded = tensor
            self.report.layers[key].over_budget_bytes += h.nbytes
            return h
        self.finish_offload(h)
        self.report.layers[key].offloaded_bytes += h.nbytes
        self.report.layers[key].num_offloaded += 1
        return h

    # --- load ----------------------------------------------------------------------------
    def prefetch(self, handle):
        """Start loading ``handle`` on the copy worker/stream; no-op if already loading or loaded."""
        if handle.on_device or handle.prefetched:
            return False
        handle._load = self.backend.start_h2d(handle._ticket)
        return True

    def load(self, handle):
        """The device tensor for ``handle``: waits for its own prefetch only, or loads on demand."""
        if handle._loaded is not None:
            return handle._loaded
        if handle._buf is None:
            raise RuntimeError("swap handle loaded after its host copy was released (unpacked more often "
                               "than packed?); this is a bug in the caller of SwapExecutor.load")
        stats = self.report.layers[handle.key]
        if handle._load is not None:
            how = "in_time" if handle._load.done() else "late"
            tensor = handle._load.result()
            self.backend.reusable(handle._load)
            handle._load = None
            if how == "in_time":
                stats.prefetched_bytes += handle.nbytes
            else:
                stats.late_bytes += handle.nbytes
        else:
            how = "on_demand"
            tensor = self.backend.load_now(handle._ticket)
            stats.on_demand_bytes += handle.nbytes
            stats.num_on_demand += 1
        self.report.events.append(("load", handle.key, how))
        probe = handle._probe() if handle._probe is not None else None
        if probe is not None:
            self._check_unchanged(handle, probe, "after its layer's forward")
        if not self._aliased:
            handle._release()      # the data is in `tensor` now: the host buffer can serve the next offload
        handle._loaded = tensor
        return tensor

    def close(self):
        """Stop the copy worker. Handles not yet loaded can still be loaded on demand."""
        self._closer()
