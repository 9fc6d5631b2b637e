"""Copy backends and the host buffer pool behind the activation swap engine.

``SwapBackend`` (a ``typing.Protocol``) is the whole interface ``SwapExecutor``
uses; both backends satisfy it, and ``tests/test_swap_engine.py`` checks that
every member exists with the Protocol's signature:

``name``, ``loads_alias_host``   what it is; True: a load returns a tensor that aliases the host buffer
``alloc_host(nbytes)``            a host buffer the pool keeps and reuses
``fence()``                       wait until no queued kernel can still read a buffer a load aliased
``aliased(buffer)``               True while a tensor a load returned still reads the buffer (it must not be reused)
``start_d2h(tensor, buffer, nbytes)``  start copying a device tensor into the buffer; returns a ticket
``wait_d2h(ticket)``              after it returns the caller may drop the device tensor; True when
                                  the copy was taken by this call (it holds the tensor as it is now)
``matches(ticket, tensor)``       True/False: does the device tensor still equal its host copy?
                                  None when the backend cannot tell cheaply
``start_h2d(ticket)``             start the copy back; returns a ``PendingLoad`` (``done()``, ``result()``)
``load_now(ticket)``              copy back synchronously (an on-demand load)
``reusable(load)``                block until the load no longer reads the host buffer
``close()``                       stop worker threads; idempotent

* ``HostCopyBackend`` (CPU build): one ``memmove`` of the tensor's bytes (CPU
  device memory is host memory) into a pool buffer, taken in ``wait_d2h`` (the
  end of the layer's forward, so in-place writes inside the layer are in the
  copy); small ones on the caller's thread, large ones split between it and
  one worker thread. A load is
  ``Tensor.from_numpy`` of that buffer: on CPU host memory is the device's, so
  copying back would only cost time. The buffer goes back to the pool when its
  handle's last unpack and is reused only after a fence (the PyNative executor's sync),
  so no queued backward kernel can still read it, and only if no loaded tensor
  still aliases it: a loaded tensor that outlives its step (held by class-level
  state, a tracker's retained graph, a gradient the caller keeps) keeps its
  buffer, which the pool then gives up (``disowned``) instead of overwriting.
* ``DeviceCopyBackend`` (Ascend/GPU): a dedicated copy stream per direction,
  events ordering copies against the compute stream both ways, pinned host
  buffers, non-blocking copies. It has NOT yet run on a device (the CPU build
  has no working streams, events or pinned memory); its scheduling is tested
  with a fake runtime (a ``DeviceRuntime`` and ``DeviceOps``) that records the calls.

``select_backend()`` picks one from ``ms.get_context("device_target")``.
"""
import ctypes
import ctypes.util
import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ContextManager, Optional, Protocol, runtime_checkable

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ..config import DEVICE_BACKEND_TARGETS
from ..mindspore_compat import pynative_executor
from ..precision import no_casts

logger = logging.getLogger("mindformers_ac.swap")


def protocol_members(protocol):
    """Names a class must have to satisfy ``protocol``: its annotated attributes and its public methods."""
    names = list(getattr(protocol, "__annotations__", {}))
    names += [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return names


@runtime_checkable
class PendingLoad(Protocol):
    """A load in flight: ``done()`` without blocking, ``result()`` the device tensor (once)."""

    def done(self) -> bool: ...

    def result(self) -> Tensor: ...


@runtime_checkable
class SwapBackend(Protocol):
    """What ``SwapExecutor`` needs from a copy backend (see the module docstring for each member).

    Arguments are passed by position (the names are free).

    Failure modes a backend must keep: ``start_d2h`` raises ``UnsupportedTensorError`` for a tensor
    it cannot copy (the executor then keeps it on the device); once the backend is closed, every method
    but ``close``, ``load_now`` and ``fence`` may raise RuntimeError (a backward recorded before the close
    still loads its tensors on demand, and gives their buffers back).
    """

    name: str
    loads_alias_host: bool

    def alloc_host(self, nbytes: int, /) -> Any: ...

    def fence(self) -> None: ...

    def aliased(self, buffer: Any, /) -> bool: ...

    def start_d2h(self, tensor: Tensor, buffer: Any, nbytes: int, /) -> Any: ...

    def wait_d2h(self, ticket: Any, /) -> bool: ...

    def matches(self, ticket: Any, tensor: Tensor, /) -> Optional[bool]: ...

    def start_h2d(self, ticket: Any, /) -> PendingLoad: ...

    def load_now(self, ticket: Any, /) -> Tensor: ...

    def reusable(self, load: PendingLoad, /) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class DeviceRuntime(Protocol):
    """The stream API ``DeviceCopyBackend`` drives: ``mindspore.runtime``, or a fake that records calls."""

    def Stream(self) -> Any: ...  # noqa: N802  (mirrors mindspore.runtime.Stream)

    def Event(self) -> Any: ...  # noqa: N802

    def StreamCtx(self, stream: Any, /) -> ContextManager: ...  # noqa: N802

    def current_stream(self) -> Any: ...


@runtime_checkable
class DeviceOps(Protocol):
    """The three tensor primitives ``DeviceCopyBackend`` needs (``MindSporeDeviceOps`` on a device)."""

    def empty_pinned(self, nbytes: int, /) -> Any: ...

    def copy_to_host(self, src: Tensor, host_buffer: Any, nbytes: int, /) -> Any: ...

    def copy_to_device(self, host: Any, /) -> Tensor: ...


class UnsupportedTensorError(TypeError):
    """The backend cannot copy this tensor (e.g. a dtype numpy does not know); the caller keeps it on device."""


class HostBufferPool:
    """Host buffers, reused across steps, with a bound on what is owned and on what sits idle.

    Buffers are bucketed by exact byte size: a training step saves the same
    shapes every step, so once warm every ``acquire`` is served from the free
    list and nothing is allocated. ``max_bytes`` bounds the bytes the pool owns
    (free and in use). When a new buffer would pass the bound, idle buffers of
    other sizes are dropped first; if that is not enough ``acquire`` returns
    ``None`` and the caller must keep the tensor on the device (the executor
    counts it as ``over_budget``). Thread safe.

    ``max_idle_bytes`` bounds the bytes of buffers given back and not in use
    (default None: the peak bytes in use since the pool was made, so the pool
    owns at most twice what a step needed at its peak). Without it a sequence
    length that changes every step would leave a buffer of every size ever seen:
    given-back buffers beyond it are freed, least recently given back sizes
    first. The first time the bound frees buffers it is logged, once per pool.

    ``aliased(buffer) -> bool`` (the backend's): a buffer given back with
    ``release_later`` that a tensor still aliases when it would be recycled
    (something kept a loaded tensor past its step) is never reused: the pool
    gives it up (``disowned``; it stops counting it, and the tensor that aliases
    it keeps its memory alive), so nothing after the step that owned a buffer
    can see it change. Logged once per pool.
    """

    def __init__(self, allocator, max_bytes=None, fence=None, max_idle_bytes=None, aliased=None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None (unbounded), got {max_bytes}")
        if max_idle_bytes is not None and max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0 or None (the peak bytes in use), got {max_idle_bytes}")
        self._alloc = allocator
        self.max_bytes = max_bytes
        self.max_idle_bytes = max_idle_bytes
        self._fence = fence        # waits until no queued kernel can still read a deferred buffer
        self._aliased = aliased    # buffer -> True while a loaded tensor still reads it
        self._deferred = []        # (buffer, nbytes) given back while kernels may still read them
        self._free = {}            # nbytes -> [buffer, ...], least recently given back size first
        self._lock = threading.Lock()
        self.total_bytes = 0       # owned by the pool, free or in use
        self.in_use_bytes = 0
        self.deferred_bytes = 0    # given back, waiting for the fence
        self.peak_total_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0
        self.reuses = 0
        self.refusals = 0
        self.idle_frees = 0        # buffers freed by the idle bound
        self.disowned = 0          # deferred buffers given up because a tensor still aliased them
        self.disowned_bytes = 0
        self._logged_idle_bound = self._logged_disowned = False

    @property
    def idle_bound(self):
        """Bytes of idle buffers the pool keeps at most (``max_idle_bytes``, else the peak bytes in use)."""
        return self.max_idle_bytes if self.max_idle_bytes is not None else self.peak_in_use_bytes

    def _evict_idle(self, needed):
        # Caller holds the lock. Drop idle buffers of other sizes until `needed` fits.
        for size in list(self._free):
            while self._free[size] and self.total_bytes + needed > self.max_bytes:
                self._free[size].pop()
                self.total_bytes -= size
            if not self._free[size]:
                del self._free[size]
            if self.total_bytes + needed <= self.max_bytes:
                return

    def _put_free(self, buf, nbytes):
        # Caller holds the lock. The size moves to the end: the idle bound frees the oldest sizes first.
        bucket = self._free.pop(nbytes, None)
        if bucket is None:
            bucket = []
        bucket.append(buf)
        self._free[nbytes] = bucket

    def _trim_idle(self):
        # Caller holds the lock. Deferred buffers count as idle but can only go once recycled.
        excess = self.total_bytes - self.in_use_bytes - self.idle_bound
        if excess <= 0:
            return
        freed = 0
        for size in list(self._free):
            bucket = self._free[size]
            while bucket and freed < excess:
                bucket.pop()
                freed += size
                self.total_bytes -= size
                self.idle_frees += 1
            if not bucket:
                del self._free[size]
            if freed >= excess:
                break
        if freed and not self._logged_idle_bound:
            self._logged_idle_bound = True
            rule = ("max_idle_bytes" if self.max_idle_bytes is not None
                    else "the peak bytes in use since the pool was made")
            logger.info("swap host pool: freeing idle host buffers beyond %.2f MiB (%s); saved tensors of "
                        "changing shapes would otherwise keep a buffer of every size seen", self.idle_bound / 2**20,
                        rule)

    def acquire(self, nbytes):
        """A buffer of exactly ``nbytes`` bytes, or ``None`` when the bound forbids it."""
        if self._deferred:
            self._recycle_deferred()
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                buf = bucket.pop()
                if not bucket:
                    del self._free[nbytes]
                self.reuses += 1
            else:
                if self.max_bytes is not None and self.total_bytes + nbytes > self.max_bytes:
                    self._evict_idle(nbytes)
                    if self.total_bytes + nbytes > self.max_bytes:
                        self.refusals += 1
                        return None
                buf = self._alloc(nbytes)
                self.allocations += 1
                self.total_bytes += nbytes
                self.peak_total_bytes = max(self.peak_total_bytes, self.total_bytes)
            self.in_use_bytes += nbytes
            if self.in_use_bytes > self.peak_in_use_bytes:
                self.peak_in_use_bytes = self.in_use_bytes
            return buf

    def release_later(self, buf, nbytes):
        """Give back a buffer that device tensors aliased: it is reused only after the fence
        (the next ``acquire`` first waits until every queued kernel has finished)."""
        with self._lock:
            self.in_use_bytes -= nbytes
            self.deferred_bytes += nbytes
            self._deferred.append((buf, nbytes))
            self._trim_idle()

    def _recycle_deferred(self):
        if not self._deferred:   # unlocked peek: a buffer given back meanwhile waits for the next acquire
            return
        with self._lock:
            deferred, self._deferred = self._deferred, []
        if not deferred:
            return
        if self._fence is not None:
            self._fence()
        kept = [] if self._aliased is None else [(b, n) for b, n in deferred if self._aliased(b)]
        with self._lock:
            for buf, nbytes in deferred:
                self.deferred_bytes -= nbytes
                if kept and any(buf is b for b, _ in kept):
                    # A loaded tensor outlived its step: the memory is that tensor's now.
                    self.total_bytes -= nbytes
                    self.disowned += 1
                    self.disowned_bytes += nbytes
                else:
                    self._put_free(buf, nbytes)
            self._trim_idle()
        if kept and not self._logged_disowned:
            self._logged_disowned = True
            logger.info("swap host pool: %d host buffer(s) (%d bytes) still read by a loaded tensor after their "
                        "step (kept by class-level state, a retained graph or a kept gradient): given up to that "
                        "tensor instead of reused", len(kept), sum(n for _, n in kept))

    def release(self, buf, nbytes):
        """Give a buffer back; it must not be read or written by the caller afterwards."""
        with self._lock:
            self.in_use_bytes -= nbytes
            self._put_free(buf, nbytes)
            self._trim_idle()

    def stats(self):
        with self._lock:
            return {"pool_bytes": self.total_bytes, "pool_in_use_bytes": self.in_use_bytes,
                    "pool_deferred_bytes": self.deferred_bytes,
                    "pool_peak_bytes": self.peak_total_bytes, "pool_peak_in_use_bytes": self.peak_in_use_bytes,
                    "pool_max_bytes": self.max_bytes, "pool_allocations": self.allocations,
                    "pool_reuses": self.reuses, "pool_refusals": self.refusals,
                    "pool_idle_bytes": self.total_bytes - self.in_use_bytes,
                    "pool_idle_bound_bytes": self.idle_bound, "pool_idle_frees": self.idle_frees,
                    "pool_disowned": self.disowned, "pool_disowned_bytes": self.disowned_bytes}


def _libc_memcmp():
    """libc's ``memcmp`` through ctypes, or None where no C library can be found (numpy compares then)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_int
    return fn


class _HostTicket:
    """One host copy, and its own load (a ``PendingLoad`` that is done when issued).

    ``host``: the pool buffer (uint8, exactly the tensor's bytes); ``addr`` its address; ``dtype`` and
    ``shape`` to load it back as; ``tensor``: the device tensor until ``wait_d2h`` copies it; ``raw``:
    its bytes are read through its address (contiguous, dtype seen before), so a check can compare
    memory directly while the caller holds the tensor.
    """

    __slots__ = ("host", "addr", "dtype", "shape", "tensor", "raw")

    def __init__(self, host, addr, dtype, shape, tensor, raw):
        self.host, self.addr, self.dtype, self.shape = host, addr, dtype, shape
        self.tensor, self.raw = tensor, raw

    def typed(self):
        """The host copy as an array of the tensor's dtype and shape (a view of the buffer)."""
        return self.host.view(self.dtype).reshape(self.shape)

    @staticmethod
    def done():
        return True

    def result(self):
        # Tensor.from_numpy (a microsecond, no copy): on CPU the host buffer is device memory.
        return Tensor.from_numpy(self.host.view(self.dtype).reshape(self.shape))


def _same_bytes(a, b):
    """Byte equality of two equally sized contiguous arrays, compared in the widest word that fits
    (NaNs equal themselves, unlike a value comparison; 8-byte words are ~8x fewer elements)."""
    a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if a.nbytes != b.nbytes:
        return False
    for word, size in _WORDS:
        if a.nbytes % size == 0:
            return bool((a.view(word) == b.view(word)).all())
    return bool((a == b).all())


_WORDS = ((np.uint64, 8), (np.uint32, 4), (np.uint16, 2))
# sys.getrefcount of an array held by one tuple only: the tuple's reference and getrefcount's argument.
_UNSHARED_REFS = 2


class HostCopyBackend:
    """CPU backend: ``memmove`` of the tensor's bytes, on the caller's thread or one worker thread.

    Offload: ``start_d2h`` (in the pack hook) only takes a pool buffer; the
    copy is taken in ``wait_d2h``, when the layer's forward ends and the
    executor would otherwise drop the device tensor. So the copy holds the
    tensor as backward would have read it, in-place writes inside the layer
    included (as without swap), and needs no check afterwards: one copy of
    the bytes, not a copy and a comparison. A contiguous tensor of a dtype
    seen before is read in place through its ``data_ptr`` (CPU device memory
    is host memory; ``data_ptr`` waits for the ops that write it) with one
    ``ctypes.memmove`` into the pool buffer: per saved tensor one C call,
    because at a dispatch-bound shape the Python around each tensor is the
    cost. The first tensor of a dtype, and non-contiguous ones, go through
    ``Tensor.asnumpy()`` (~8 us: numpy parses a PEP 3118 format string each
    call). Copies under ``sync_bytes`` run on the caller's thread (a worker
    round trip costs tens of microseconds); larger ones are split between the
    caller's thread and the worker (``memmove`` releases the GIL). ``matches``
    (one ``memcmp``) serves the late check at load. Load: ``Tensor.from_numpy``
    of the host buffer (no copy), on the caller's thread. Only MindSpore's own
    thread calls MindSpore.
    """

    name = "host"
    # Loads alias the host buffer (Tensor.from_numpy): on CPU host memory is the device's, so a
    # copy back would only cost time. The buffer is then recycled only after a fence.
    loads_alias_host = True
    SYNC_BYTES = 128 << 10

    def __init__(self, sync_bytes=None):
        self.sync_bytes = self.SYNC_BYTES if sync_bytes is None else sync_bytes
        # Started on its first copy: a model whose tensors are all small never starts it.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mac-swap")
        self._closed = False
        self._np_dtypes = {}      # MindSpore dtype -> numpy dtype, learnt from asnumpy()
        self._memcmp = _libc_memcmp()

    @staticmethod
    def fence():
        """Wait for every queued MindSpore kernel (backward may still read an aliased buffer).

        The PyNative executor's sync: ``ms.runtime.synchronize()`` is refused on CPU.
        """
        pynative_executor.sync()

    @staticmethod
    def aliased(buffer):
        """True while a tensor a load returned (``Tensor.from_numpy`` of a view, which holds the view, which
        holds the buffer) or a ticket still references the buffer's array: its only other reference is the
        ``(array, address)`` pair itself."""
        return sys.getrefcount(buffer[0]) > _UNSHARED_REFS

    @staticmethod
    def alloc_host(nbytes):
        """(uint8 array of ``nbytes``, its address): the address is taken once per buffer, not per copy."""
        buf = np.empty(nbytes, dtype=np.uint8)
        return buf, buf.ctypes.data

    @staticmethod
    def host_view(tensor):
        """The tensor's data as an ndarray (aliases on CPU); raises UnsupportedTensorError."""
        try:
            return np.ascontiguousarray(tensor.asnumpy())
        except (TypeError, RuntimeError, ValueError) as err:
            raise UnsupportedTensorError(f"cannot view dtype {tensor.dtype} as numpy: {err}") from err

    def _check_open(self):
        if self._closed:
            raise RuntimeError("swap backend is closed; create a new SwapExecutor (or SwapManager().reset())")

    def start_d2h(self, tensor, buffer, nbytes):
        if self._closed:
            self._check_open()
        host, addr = buffer
        np_dtype = self._np_dtypes.get(tensor.dtype)
        if np_dtype is None:   # the first of its dtype: learn how numpy sees it (raises if it can't copy)
            np_dtype = self._np_dtypes[tensor.dtype] = self.host_view(tensor).dtype
            return _HostTicket(host, addr, np_dtype, tensor.shape, tensor, False)
        return _HostTicket(host, addr, np_dtype, tensor.shape, tensor, tensor.is_contiguous())

    def wait_d2h(self, ticket):
        """Take the host copy now, from the tensor as it is at this call (returns True; False when an
        earlier call took it).

        A large copy is split between this thread and the worker: it runs at
        the end of a layer's forward, when MindSpore's own threads are idle.
        """
        tensor = ticket.tensor
        if tensor is None:
            return False
        ticket.tensor = None
        if not ticket.raw:
            np.copyto(ticket.host, self.host_view(tensor).reshape(-1).view(np.uint8))
            return True
        src, dst, nbytes = tensor.data_ptr(), ticket.addr, ticket.host.nbytes   # data_ptr waits for writers
        if nbytes < self.sync_bytes:
            ctypes.memmove(dst, src, nbytes)
            return True
        half = nbytes // 2
        future = self._worker.submit(ctypes.memmove, dst, src, half)
        ctypes.memmove(dst + half, src + half, nbytes - half)
        future.result()
        return True

    def matches(self, ticket, tensor):
        if self._memcmp is not None and ticket.raw and tensor.is_contiguous():
            return self._memcmp(ticket.addr, tensor.data_ptr(), ticket.host.nbytes) == 0
        try:   # an op gave the tensor another layout, or no memcmp: compare as arrays
            current = self.host_view(tensor)
        except UnsupportedTensorError:
            return None
        return _same_bytes(ticket.host, current)

    def start_h2d(self, ticket):
        # Nothing to start: the ticket loads itself with Tensor.from_numpy when the tensor is asked for.
        self._check_open()
        return ticket

    @staticmethod
    def load_now(ticket):
        return ticket.result()

    @staticmethod
    def reusable(load):
        """Nothing to wait for: the loaded tensor is the host buffer itself."""
        del load

    def close(self):
        if not self._closed:
            self._closed = True
            self._worker.shutdown(wait=True)


class MindSporeDeviceOps:
    """The three tensor primitives the device backend needs, on the real MindSpore runtime."""

    def __init__(self, device_target):
        self.device_target = device_target

    @staticmethod
    def empty_pinned(nbytes):
        return Tensor(np.empty(nbytes, dtype=np.uint8)).pin_memory()

    @staticmethod
    def copy_to_host(src, host_buffer, nbytes):
        # A dtype/shape view of the pinned bytes, filled without blocking the host. Offloads run inside a
        # layer's call: under its mixed-precision type copy_ would write into a cast copy of dst instead.
        with no_casts():
            dst = host_buffer[:nbytes].view(src.dtype).reshape(src.shape)
            dst.copy_(src, non_blocking=True)
        return dst

    def copy_to_device(self, host):
        with no_casts():
            return host.move_to(self.device_target, blocking=False)


class _DeviceTicket:
    __slots__ = ("host", "done", "tensor")

    def __init__(self, host, done, tensor):
        self.host, self.done, self.tensor = host, done, tensor


class _DeviceLoad:
    __slots__ = ("tensor", "loaded", "_rt")

    def __init__(self, tensor, loaded, rt):
        self.tensor, self.loaded, self._rt = tensor, loaded, rt

    def result(self):
        # The compute stream (current on the caller) must not read the tensor before the H2D copy ends.
        self._rt.current_stream().wait_event(self.loaded)
        return self.tensor

    def done(self):
        return bool(self.loaded.query())


class DeviceCopyBackend:
    """Ascend/GPU backend: copy streams, events and pinned host buffers.

    NOT YET RUN ON A DEVICE: the CPU build cannot create streams, events or
    pinned memory, so this class is exercised only with an injected fake
    ``runtime`` and ``ops`` (tests/test_swap_engine.py) that record which
    stream each copy runs on and which events order it.

    Ordering contract:
    * D2H: an event recorded on the compute stream after the producer is
      waited by the D2H stream before the copy; ``wait_d2h`` makes the compute
      stream wait for the copy's event before the device memory can be reused.
    * H2D: the H2D stream waits for the D2H event of the same ticket (the host
      buffer must be complete); ``result()`` makes the compute stream wait for
      the H2D event; ``reusable`` synchronizes that event before the pinned
      buffer goes back to the pool.
    * ``matches`` returns None: comparing device data would cost a copy, so
      in-place modification after offload is not detected on this backend.

    ``runtime`` needs ``Stream()``, ``Event()``, ``StreamCtx(stream)``,
    ``current_stream()``; ``ops`` needs ``empty_pinned``, ``copy_to_host``,
    ``copy_to_device`` (see ``MindSporeDeviceOps``).
    """

    name = "device"
    loads_alias_host = False   # a load is a device copy: the pinned buffer is free once it has been read

    def __init__(self, runtime=None, ops=None, device_target=None):
        if runtime is None:
            import mindspore.runtime as runtime  # pylint: disable=import-outside-toplevel
        self._rt = runtime
        self._ops = ops or MindSporeDeviceOps(device_target or ms.get_context("device_target"))
        self.d2h_stream = runtime.Stream()
        self.h2d_stream = runtime.Stream()

    def alloc_host(self, nbytes):
        return self._ops.empty_pinned(nbytes)

    @staticmethod
    def fence():
        """Nothing to wait for: no load aliases a pinned buffer (``reusable`` orders each H2D read)."""

    @staticmethod
    def aliased(buffer):
        """Never: a load is a device copy, the pinned buffer is given back with ``release``."""
        del buffer
        return False

    def start_d2h(self, tensor, buffer, nbytes):
        produced = self._rt.Event()
        produced.record(self._rt.current_stream())
        self.d2h_stream.wait_event(produced)
        with self._rt.StreamCtx(self.d2h_stream):
            host = self._ops.copy_to_host(tensor, buffer, nbytes)
            done = self._rt.Event()
            done.record(self.d2h_stream)
        # The ticket keeps the device tensor until wait_d2h has ordered its reuse after the copy.
        return _DeviceTicket(host, done, tensor)

    def wait_d2h(self, ticket):
        self._rt.current_stream().wait_event(ticket.done)
        ticket.tensor = None
        return False   # copied at start_d2h, on the copy stream

    @staticmethod
    def matches(ticket, tensor):
        del ticket, tensor
        return None

    def start_h2d(self, ticket):
        self.h2d_stream.wait_event(ticket.done)
        with self._rt.StreamCtx(self.h2d_stream):
            dev = self._ops.copy_to_device(ticket.host)
            loaded = self._rt.Event()
            loaded.record(self.h2d_stream)
        return _DeviceLoad(dev, loaded, self._rt)

    def load_now(self, ticket):
        load = self.start_h2d(ticket)
        tensor = load.result()
        self.reusable(load)
        return tensor

    @staticmethod
    def reusable(load):
        """Block until the H2D copy has read the pinned buffer, so the pool may hand it out again."""
        if isinstance(load, _DeviceLoad):
            load.loaded.synchronize()

    def close(self):
        """Streams are released with the backend; nothing to stop."""


def select_backend(device_target=None, kind="auto"):
    """The backend ``kind`` (``swap.backend``) names: ``host`` is ``HostCopyBackend``, ``device``
    ``DeviceCopyBackend`` (Ascend/GPU only: ValueError elsewhere), ``auto`` the host one on CPU and the
    device one on Ascend/GPU."""
    target = device_target or ms.get_context("device_target")
    if kind == "host":
        return HostCopyBackend()
    if kind not in ("auto", "device"):
        raise ValueError(f"no swap backend {kind!r}; expected 'auto', 'host' or 'device'")
    if target in DEVICE_BACKEND_TARGETS:
        return DeviceCopyBackend(device_target=target)
    if kind == "auto" and target == "CPU":
        return HostCopyBackend()
    raise ValueError(f"no {kind} swap backend for device_target={target!r}; expected "
                     f"{'Ascend or GPU' if kind == 'device' else 'CPU, Ascend or GPU'}")
