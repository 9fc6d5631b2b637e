"""Swap executor (offload/load of single tensors) and the swap report.

``SwapExecutor`` is the duck-typed object other engines call:

    handle = executor.offload(tensor)     # tensor copied to host; device memory may be dropped
    tensor = executor.load(handle)        # a device tensor with the same values

The scheduler (``scheduler.py``) uses the split form (``start_offload`` in pack,
``finish_offloads`` of the group's handles at the end of the layer's forward,
``prefetch`` when the trigger layer's backward starts, ``load`` in unpack) so
copies overlap compute. Each ``SwapHandle`` owns its state (``HandleState``)
and the transitions between states; the executor decides when they happen and
talks to the backend only through the ``SwapBackend`` Protocol.
"""
import collections
import enum
import logging
import weakref

from ..mindspore_compat import attach_to_tensor, no_grad, tensor_version
from ..precision import engine_ops
from ..tensors import version_alias
from .backends import HostBufferPool, SwapBackend, UnsupportedTensorError, protocol_members, select_backend

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
    unsaved_marks       tag -> how many ``swap_tensor_wrapper`` marks of that tag no op saved
                        after the mark (nothing of theirs was offloaded; see ``SwapScheduler``)
    """

    __slots__ = _STAT_FIELDS + ("kept_reasons", "unsaved_marks")

    def __init__(self):
        for f in _STAT_FIELDS:
            setattr(self, f, 0)
        self.kept_reasons = collections.Counter()
        self.unsaved_marks = collections.Counter()

    def as_dict(self):
        d = {f: getattr(self, f) for f in _STAT_FIELDS}
        d["kept_reasons"] = dict(self.kept_reasons)
        d["unsaved_marks"] = dict(self.unsaved_marks)
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


class HandleState(enum.Enum):
    """Where one ``SwapHandle``'s data is. Transitions (anything else raises RuntimeError)::

        KEPT                                   never offloaded: the handle holds the device tensor
        COPYING -> KEPT                        the offload given up as its group closed (``keep_on_device``)
        COPYING -> OFFLOADED -> LOADING -> LOADED -> RELEASED (host buffer given back)
                   OFFLOADED ------------> LOADED    (an on-demand load)
                   OFFLOADED or LOADING -> RELEASED  (the saved storage is still alive: served, rule W6s)

    A backend whose loads alias the host buffer (``loads_alias_host``) gives it
    back at the handle's last unpack (``drop_loaded``), or when the handle dies
    unloaded; until then such a handle stays LOADED. A RELEASED handle holds
    nothing of its step (no buffer, ticket, device tensor or group), however long
    something else (a tracker holding an attached loss, a retained graph) keeps
    the handle itself alive; the pool reuses a given-back buffer only once no
    loaded tensor aliases it (``HostBufferPool``).
    """

    KEPT = "kept"
    COPYING = "copying"
    OFFLOADED = "offloaded"
    LOADING = "loading"
    LOADED = "loaded"
    RELEASED = "released"


class SwapHandle:
    """One offloaded tensor. Returned by ``SwapExecutor.offload``; pass it to ``load``.

    It owns its state (``state``, a ``HandleState``) and the transitions; the
    executor decides when they happen. It holds the host copy (a pool buffer,
    given back after the load or, when the backend's loads alias it, when the
    handle dies), the device tensor until ``finish_offload``, a weak reference
    to the ``SavedStorage`` stamp of the saved tensor (rule W6s), the storage
    that stamp handed over when the tensor died written, and the loaded
    tensor until ``drop_loaded``.
    """

    __slots__ = ("key", "tag", "nbytes", "owner", "refs", "state", "_ticket", "_buf", "_give_back", "_device",
                 "_live", "_written_storage", "_probe", "_load", "_loaded", "version", "written", "storage", "__weakref__")

    def __init__(self, key, tag, nbytes):
        self.key, self.tag, self.nbytes = key, tag, nbytes
        self.owner = None          # the scheduler group, if any
        self.refs = 1              # packs sharing this handle (dedup); the cached load is dropped at 0
        self.state = HandleState.KEPT
        self._ticket = self._buf = self._give_back = self._device = self._live = self._written_storage = None
        self._probe = None
        self._load = self._loaded = None
        self.version = None        # the saved tensor's version counter when it was saved (rule W6s)
        self.written = None        # (version saved, version now) once a write after the save was seen
        self.storage = None        # (base pointer, bytes) of the saved tensor's storage, noted by the scheduler

    @classmethod
    def kept(cls, key, tag, tensor):
        """A handle that never left the device (``load`` returns ``tensor``)."""
        h = cls(key, tag, int(tensor.nbytes))
        h._loaded = tensor
        return h

    @property
    def device(self):
        """The device tensor while the offload is in flight (COPYING), else None."""
        return self._device

    @property
    def on_device(self):
        return self.state is HandleState.KEPT

    @property
    def prefetched(self):
        return self.state is HandleState.LOADING or self.state is HandleState.LOADED

    @property
    def ticket(self):
        """The backend's ticket of the host copy (None while KEPT)."""
        return self._ticket

    @property
    def loaded(self):
        """The tensor ``load`` returned (or the kept one); None before the load and after ``drop_loaded``."""
        return self._loaded

    def _refuse(self, state, action):
        raise RuntimeError(f"swap handle of {self.key!r} cannot {action} in state {self.state.value} "
                           f"(expected {state.value}); this is a bug in the caller of SwapExecutor")

    def start_offload(self, ticket, tensor, buf, give_back):
        """KEPT -> COPYING: the copy of ``tensor`` into ``buf`` started; ``give_back(buf, nbytes)`` frees it."""
        if self.state is not HandleState.KEPT:   # checked inline: one call less per saved tensor
            self._refuse(HandleState.KEPT, "start an offload")
        self._ticket, self._device, self._buf, self._give_back = ticket, tensor, buf, give_back
        self.version = tensor_version(tensor)
        self.state = HandleState.COPYING

    def keep_on_device(self, tensor):
        """COPYING -> KEPT: the offload is given up (the host buffer goes back); ``load`` returns ``tensor``,
        for every unpack (a second backward over the same graph reads it again)."""
        if self.state is not HandleState.COPYING:
            self._refuse(HandleState.COPYING, "be kept on the device")
        self._release()
        self._device = None
        self._loaded = tensor
        self.state = HandleState.KEPT

    def finish_offload(self):
        """COPYING -> OFFLOADED: drop and return the device tensor (the caller checks it, then may ``watch``)."""
        if self.state is not HandleState.COPYING:   # checked inline: one call less per saved tensor
            self._refuse(HandleState.COPYING, "finish an offload")
        tensor, self._device = self._device, None
        self.state = HandleState.OFFLOADED
        return tensor

    def stamp(self, tensor, matches, closed):
        """Attach a ``SavedStorage`` to the offloaded device tensor (rule W6s); none when it can't be attached
        (a release without ``Tensor.data`` or tensor user data: a write after the group's close is then not
        seen). ``closed``: the group's one-item list, true once it dropped its references (``SavedStorage``). Run
        under ``no_grad`` and ``engine_ops`` (its view is no region's op)."""
        alias = counter_alias(tensor)
        if alias is None:
            return
        live = SavedStorage(alias, self, matches, closed)
        if attach_to_tensor(tensor, SavedStorage.KEY, live):
            self._live = weakref.ref(live)

    def watch(self, tensor):
        """Keep a weak reference to the offloaded tensor, for ``probe`` at load time (``SwapExecutor.offload``:
        its caller hands in the tensor it holds, so the reference lives as long as the caller's)."""
        try:
            self._probe = weakref.ref(tensor)
        except TypeError:  # tensor kinds without weakref support: only the forward-time check applies
            pass

    def probe(self):
        """The tensor ``watch`` was given, if its caller still holds it (for the late in-place check)."""
        return self._probe() if self._probe is not None else None

    def keep_written(self, alias):
        """The saved tensor died written since its host copy: the load serves its storage (``alias``)."""
        if self.state is HandleState.OFFLOADED or self.state is HandleState.LOADING:
            self._written_storage = alias

    def start_load(self, load):
        """OFFLOADED -> LOADING: ``load`` (a ``PendingLoad``) is in flight."""
        if self.state is not HandleState.OFFLOADED:   # checked inline: one call less per saved tensor
            self._refuse(HandleState.OFFLOADED, "start a load")
        self._load = load
        self.state = HandleState.LOADING

    def take_load(self):
        """The pending load (LOADING, it is taken) or None (OFFLOADED: load on demand)."""
        if self.state is HandleState.LOADING:
            load, self._load = self._load, None
            return load
        if self.state is not HandleState.OFFLOADED:
            raise RuntimeError(f"swap handle of {self.key!r} loaded in state {self.state.value}, after its host "
                               "copy was released (unpacked more often than packed?); this is a bug in the caller "
                               "of SwapExecutor.load")
        return None

    def finish_load(self, tensor, release):
        """-> LOADED: cache ``tensor``; ``release``: give the host buffer back now (RELEASED, data in ``tensor``)."""
        self._loaded = tensor
        self.state = HandleState.LOADED
        if release:
            self._release()
            self.state = HandleState.RELEASED

    def live(self):
        """The saved storage, if it is still on the device: the tensor is alive outside the graph (its stamp
        lives), or it died after a write (``keep_written``); else None (the host copy holds its values)."""
        if self._written_storage is not None:
            return self._written_storage
        live = self._live() if self._live is not None else None
        return live.alias if live is not None else None

    def drop_loaded(self):
        """Forget the loaded tensor (autograd holds it now) and give the host buffer back: a later ``load``
        raises instead of returning it. A KEPT handle keeps its tensor (it has no buffer; a second backward
        over the same graph reads it again)."""
        if self.state is HandleState.KEPT:
            return
        self._loaded = None
        if self.state is HandleState.LOADED:
            self._release()
            self.state = HandleState.RELEASED

    def _release(self):
        # Once: after the load (at the last unpack, when loads alias the buffer), or when the handle dies.
        # Everything of the step goes with the buffer: a graph kept alive past its step (a tracker holding
        # an attached loss) keeps this handle, and must not keep the buffer, the group or its scheduler.
        buf, self._buf = self._buf, None
        give_back, self._give_back = self._give_back, None
        live = self._live() if self._live is not None else None
        if live is not None:   # the held tensor may outlive the step: its stamp lets go of the storage too
            live.alias = live.matches = None
        self._ticket = self._live = self._written_storage = self._probe = self._load = self.owner = None
        if buf is not None:
            give_back(buf, self.nbytes)

    def __del__(self):
        # Cheaper than a weakref.finalize per handle; a handle is freed by reference counting
        # as soon as autograd drops it. Most were released at their last unpack already.
        if self._buf is not None:
            self._release()


def counter_alias(t):
    """``t``'s storage as another C++ tensor, untracked, sharing ``t``'s version counter (``version_alias``; run
    under ``no_grad`` and ``engine_ops``), or ``Tensor.data`` for a layout ``view`` refuses (a ``copy_`` is then
    not seen). It does not hold ``t`` (measured: ``t`` and its user data are freed when the caller drops it while
    the alias lives)."""
    try:
        return version_alias(t)
    except (RuntimeError, TypeError, ValueError):
        return getattr(t, "data", None)


class SavedStorage:
    """The stamp of one offloaded tensor's storage (rule W6s of docs/exactness.md), attached as the swap group
    closes to the saved tensor's C++ tensor, which every Python object of it shares (``attach_to_tensor``).

    Measured on MindSpore 2.10 CPU (``docs/exactness.md``, W6s): the object a pack hook receives is another
    Python object than the one the op returned, and dies when the hook returns, so a weak reference to it
    says nothing; an entry in the C++ tensor's user data set after the save lives exactly as long as the
    tensor (or a view of it) is held outside the graph: by the caller through any object (a dataclass, a
    namedtuple, a custom class), a cache, the next layer. That is the only way the storage can be written
    after the save. So the stamp holds ``alias``, an untracked tensor of the same storage (no cycle: it is
    another C++ tensor sharing the version counter; no memory: the held tensor holds that storage anyway):

    * at load, while the stamp lives, the handle serves ``alias``: the very storage the graph reads without
      AC, so a write that MindSpore's version counter misses (``ops.assign_add``, ``ops.assign``) is read as
      without AC, and a rebinding (slice assignment, ``assign_value``) is not;
    * when the tensor dies before the load (the caller wrote it, then dropped it), the stamp compares its
      storage with the host copy (``matches``, a ``memcmp`` on CPU); if they differ, or the backend can't
      tell, the handle keeps ``alias`` for the load (``keep_written``), as the graph would have kept it;
    * a write that advances the version counter (``copy_``) after the save is refused at the load, as
      MindSpore refuses it without AC (``RuntimeError`` naming the swap group, the tag and the versions).

    Only a stamp that outlived its group's close compares (``closed``, the one-item list its group's stamps
    share, set once for them all): an intermediate tensor dies as the group drops it, unwritten.
    """

    __slots__ = ("alias", "handle", "matches", "closed", "__weakref__")
    KEY = "mindformers_ac.swap.saved_storage"

    def __init__(self, alias, handle, matches, closed):
        self.alias, self.handle, self.matches, self.closed = alias, weakref.ref(handle), matches, closed

    def __del__(self):
        if not self.closed[0]:
            return
        handle = self.handle()
        if handle is None or self.alias is None or handle.state not in (HandleState.OFFLOADED, HandleState.LOADING):
            return
        now = tensor_version(self.alias)
        if now != handle.version:   # ``copy_`` after the close, then dropped: refused at the load, as without AC
            handle.written = (handle.version, now)
            return
        try:
            same = self.matches(handle.ticket, self.alias)
        except Exception:   # noqa: BLE001  (a destructor must not raise; can't tell: keep the storage)
            same = None
        if same is not True:
            handle.keep_written(self.alias)


def _written_message(handle):
    saved, now = handle.written
    return (f"One of the Tensor needed for gradient computation has been modified by an inplace operation: a "
            f"tensor swap group {handle.key!r} saved for backward (tag {handle.tag!r}, {handle.nbytes} bytes) was "
            f"written in place after it was saved (its version is {now}, expected version {saved}); MindSpore "
            "refuses this backward without AC too (rule W6s of docs/exactness.md). Write into a copy "
            "(x = x * 1.0 before the in-place op), or use a functional op instead of the in-place one.")


class SwapExecutor:
    """Offloads tensors to host buffers and loads them back through a copy backend.

    Args:
        backend: a ``SwapBackend`` (default: ``select_backend()`` from the device target).
        max_pool_bytes: bound of the host buffer pool (None: unbounded). A tensor that
            does not fit stays on the device and is counted as ``over_budget``.
        max_idle_bytes: bound of the pool's buffers not in use (None: the peak bytes in use, so the
            pool never owns more than twice a step's peak, whatever shapes come; see ``HostBufferPool``).
        verify: compare the device tensor with its host copy when the offload finishes if the backend
            copied earlier (a device backend); a difference raises RuntimeError. A saved tensor written
            after its group closed is read from its live storage (``SavedStorage``, rule W6s).
        report: a ``SwapReport`` to count into (default: a new one).

    Call ``close()`` (or drop the executor) to stop the worker thread.
    """

    def __init__(self, backend=None, max_pool_bytes=None, verify=True, report=None, max_idle_bytes=None):
        self.backend = backend if backend is not None else select_backend()
        if not isinstance(self.backend, SwapBackend):
            missing = [m for m in protocol_members(SwapBackend) if not hasattr(self.backend, m)]
            raise TypeError(f"swap backend {type(self.backend).__name__} lacks {', '.join(missing)} "
                            "(see mindformers_ac.swap.backends.SwapBackend)")
        self._aliased = self.backend.loads_alias_host
        self.pool = HostBufferPool(self.backend.alloc_host, max_pool_bytes, fence=self.backend.fence,
                                   max_idle_bytes=max_idle_bytes, aliased=self.backend.aliased)
        self.verify = verify
        self.report = report if report is not None else SwapReport()
        self.report.pool_stats = self.pool.stats
        self._give_back = self.pool.release_later if self._aliased else self.pool.release
        self._closer = weakref.finalize(self, self.backend.close)
        self.closed = False

    # --- offload -------------------------------------------------------------------------
    def start_offload(self, tensor, key=None, tag=None):
        """Give ``tensor`` a host buffer and hand it to the backend (a device backend starts copying on its
        copy stream; the host backend copies in ``finish_offload``). Returns a SwapHandle, or None if it
        must stay on device (pool bound reached: counted as over budget; dtype the backend cannot copy)."""
        nbytes = int(tensor.nbytes)
        buf = self.pool.acquire(nbytes)
        if buf is None:
            return None
        try:
            ticket = self.backend.start_d2h(tensor, buf, nbytes)
        except UnsupportedTensorError as err:
            self.pool.release(buf, nbytes)
            logger.debug("keeping tensor on device: %s", err)
            return None
        h = SwapHandle(key, tag, nbytes)
        h.start_offload(ticket, tensor, buf, self._give_back)
        return h

    def finish_offload(self, handle, closed=None):
        """Finish the copy, drop the device reference; keep a weak one for the check at load.

        A backend that copied at ``start_offload`` (a device backend) is checked here: RuntimeError if
        the tensor was modified in place since (the handle is finished all the same: it loads the host
        copy, taken when the tensor was saved). A copy taken now (the host backend) holds the tensor as
        it is, in-place writes before this call included, so there is nothing to compare.

        ``closed``: attach a ``SavedStorage`` to the tensor (a swap group's offloads, rule W6s), armed once the
        group sets this one-item list true; None (the synchronous ``offload`` of other engines): keep a weak
        reference to the caller's tensor instead, and compare it with the host copy at load while it lives (a
        difference raises RuntimeError)."""
        if handle.state is not HandleState.COPYING:
            return
        copied_now = self.backend.wait_d2h(handle.ticket)
        tensor = handle.finish_offload()
        now = tensor_version(tensor)
        if now != handle.version:   # written in place since the save: MindSpore refuses its backward (W6s)
            handle.written = (handle.version, now)
        if self.verify and not copied_now:
            self._check_unchanged(handle, tensor, "before its layer's forward ended")
        if closed is not None:
            handle.stamp(tensor, self.backend.matches, closed)
        elif self.verify:
            handle.watch(tensor)

    def keep_on_device(self, handle):
        """Give up ``handle``'s offload as its group closes: wait for a copy in flight (the buffer goes back
        to the pool), then ``load`` returns the device tensor's alias (held without its graph node, sharing its
        version counter: ``counter_alias``)."""
        if handle.state is not HandleState.COPYING:
            return
        self.backend.wait_d2h(handle.ticket)
        with no_grad(), engine_ops():
            handle.keep_on_device(counter_alias(handle.device))

    def finish_offloads(self, handles):
        """``finish_offload`` of each handle (a group's, at its close): every handle is finished even if
        one fails the in-place check, and the first such RuntimeError is raised at the end."""
        error, closed = None, [False]
        with no_grad(), engine_ops():   # the stamps' views: untracked, and no op of a recompute region around
            for h in handles:
                try:
                    self.finish_offload(h, closed)
                except RuntimeError as err:
                    error = error or err
        # the device tensors are dropped: a stamp alive now belongs to one held outside the graph (an output in any
        # object, a cache), which may be written; it checks its storage when it dies
        closed[0] = True
        if error is not None:
            raise error

    def _check_unchanged(self, handle, tensor, when):
        if self.backend.matches(handle.ticket, tensor) is False:
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
            h = SwapHandle.kept(key, tag, tensor)
            self.report.layers[key].over_budget_bytes += h.nbytes
            return h
        self.finish_offload(h)
        self.report.layers[key].offloaded_bytes += h.nbytes
        self.report.layers[key].num_offloaded += 1
        return h

    # --- load ----------------------------------------------------------------------------
    def prefetch(self, handle):
        """Start loading ``handle`` on the copy worker/stream; no-op if already loading or loaded, or once
        the executor is closed (the handle then loads on demand)."""
        if handle.state is not HandleState.OFFLOADED or self.closed:
            return False
        handle.start_load(self.backend.start_h2d(handle.ticket))
        return True

    def load(self, handle):
        """The device tensor for ``handle``: waits for its own prefetch only, or loads on demand.

        While the saved tensor is held outside the graph, or when it died written, its storage is served
        instead of the host copy (``SavedStorage``, rule W6s). Raises RuntimeError if the handle's host copy
        was already released (loaded more often than offloaded), or if the tensor's version changed before
        its group closed (MindSpore refuses that backward without AC)."""
        tensor = handle.loaded
        if handle.state is HandleState.KEPT and handle.version is not None:
            now = tensor_version(tensor)   # kept by keep_on_device: a shared counter
            if now != handle.version:
                handle.written = (handle.version, now)
        if handle.written is not None:
            raise RuntimeError(_written_message(handle))
        if tensor is not None:
            return tensor
        live = handle.live()
        if live is not None:   # the saved storage is still on the device: what the graph reads without AC
            now = tensor_version(live)
            if now != handle.version:   # ``copy_`` after the close: MindSpore refuses this backward without AC
                handle.written = (handle.version, now)
                raise RuntimeError(_written_message(handle))
            pending = handle.take_load()
            if pending is not None:
                self.backend.reusable(pending)
            self.report.events.append(("load", handle.key, "live"))
            handle.finish_load(live, release=True)
            return live
        pending = handle.take_load()
        stats = self.report.layers[handle.key]
        if pending is not None:
            in_time = pending.done()
            tensor = pending.result()
            self.backend.reusable(pending)
            if in_time:
                how = "in_time"
                stats.prefetched_bytes += handle.nbytes
            else:
                how = "late"
                stats.late_bytes += handle.nbytes
        else:
            how = "on_demand"
            tensor = self.backend.load_now(handle.ticket)
            stats.on_demand_bytes += handle.nbytes
            stats.num_on_demand += 1
        self.report.events.append(("load", handle.key, how))
        probe = handle.probe()
        if probe is not None:
            self._check_unchanged(handle, probe, "after it was offloaded")
        # Not aliased: the data is in `tensor` now, so the host buffer can serve the next offload.
        handle.finish_load(tensor, release=not self._aliased)
        return tensor

    def close(self):
        """Stop the copy worker. Handles not yet loaded can still be loaded on demand.

        A backward recorded before the close (``remove_ac`` between an ``ms.vjp`` forward and its
        backward) still runs the prefetch triggers it holds: from now on they start nothing, and
        ``load`` copies each tensor back on demand."""
        self.closed = True
        self._closer()

