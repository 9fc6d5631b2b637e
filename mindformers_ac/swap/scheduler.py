"""Swap groups: which saved tensors go to host, and when they come back.

A *group* is one region of forward (a layer call, a sub-cell call, a
``swap(fn)`` call, an ``async_save_on_cpu`` block) during which the
scheduler's pack/unpack hooks are active. Every group has a *key* (a global
layer id, a cell label, a block id); prefetching a key loads back the tensors
of its most recent call.

Per saved tensor, in order:
1. weights are returned as is: a tensor MindSpore marks as a Parameter's
   (``param_info``, whichever cell holds it: one added after the install, a LoRA
   adapter, the cells a ``swap(lambda z: cell(z), x)`` reaches), or whose
   ``data_ptr`` or storage equals a known parameter's. A parameter met in pack is
   learnt, so later views of its storage stay too. The pointers are checked for
   changes (a checkpoint reload, ``set_data``) at the first outermost swap region
   of each forward pass (after a backward, or when an outermost key comes again),
   so reloaded weights stay weights. A change inside a pass is seen at the next
   one; until then it costs copies of views, never exactness (a weight taken for
   an activation is copied and loaded back with its values; an activation at a
   stale weight address is kept on the device);
2. a view already offloaded in this group shares that handle (one copy per view);
3. kept on device, with a reason counted in the report: ``input`` (storage of a
   tensor the group, layer or model received as input), ``unmarked`` (group
   swaps only ``swap_tensor_wrapper`` tensors: those of a marked storage, and
   those whose values are a marked tensor's, as a reshape or contiguous copy
   of it: ``nn.Dense`` on a 3-D input saves such a copy), ``check_fn`` / ``policy``
   (user rule said keep), ``small`` (< ``min_bytes``), ``over_budget`` (host
   pool full), ``output`` (decided as the group closes: same storage as what the
   region returned, rule W6s of docs/exactness.md). A kept tracked tensor is held as its untracked ``data`` (same
   storage, no graph node): held with its node, the packed object would tie the
   graph to itself, and a step that fails before its backward would never free
   that graph, its host buffers or its kept tensors;
4. otherwise offloaded: pack takes a host buffer; the device tensor is held
   until the group closes (so its address cannot be reused by a new tensor
   while the dedup table is live), then copied (the host backend; a device
   backend copies from pack on, and is checked here) and dropped.

A ``swap_tensor_wrapper`` mark that no save after it matched offloads
nothing: when its group closes, the report counts it under
``unsaved_marks[tag]`` and a warning (once per tag) names it and why (saved
before the mark, by the op that made it; or never saved: its consumers save
other tensors).
"""
import dataclasses
import hashlib
import logging
import weakref

import mindspore as ms

from ..checkpoint_policy import CheckpointPolicy
from ..config import SwapConfig
from ..ledger import ActivationLedger
from ..precision import no_casts
from ..tensors import WeightPointers, detached, is_tracked, storage_info, storage_ptr, tensor_bytes, tensor_storage_ptrs
from .executor import SwapExecutor, SwapHandle

logger = logging.getLogger("mindformers_ac.swap")


def _untracked(t):
    """``t``'s storage, shape and strides as a tensor autograd does not track (``Tensor.data``, 0.3 us;
    ``detached``, about 12 us, where a release lacks it).

    What a pack hook keeps must not hold a tracked tensor: its autograd node leads back to the graph that
    holds the packed object, a cycle reference counting can't free when the step never reaches its
    backward (a failed forward or backward would keep the whole graph, its host buffers and kept tensors).
    """
    if not is_tracked(t):
        return t
    try:
        return t.data
    except AttributeError:
        with no_casts():   # inside a to_float / amp layer the detaching op would be cast too
            return detached(t)


class _Kept:
    """Packed form of a tensor left on the device; its death releases the resident count.

    Its unpack forgets the group (a graph kept alive past its step, by a tracker holding an attached loss,
    keeps this object and the device tensor, as it would keep the tensor without AC, not the group); the
    tensor stays, for a second backward over the same graph (a grad of a grad reads it again).
    """

    __slots__ = ("tensor", "group", "_report", "_sptr")

    def __init__(self, tensor, group, report, sptr):
        self.tensor, self.group, self._report, self._sptr = tensor, group, report, sptr

    def __del__(self):
        # Cheaper than a weakref.finalize per kept tensor; autograd drops it in backward.
        self._report.drop_resident(self._sptr)


class _Group:
    __slots__ = ("key", "gen", "mode", "policy_fn", "check_fn", "exclude", "seen", "ledger", "pending",
                 "pending_ptrs", "handles", "marked", "hooks", "on_first_unpack", "unpacked", "stats", "pending_bytes", "plain",
                 "saved_marks", "digests", "unfollowed")

    def __init__(self, key, gen, mode, policy_fn, check_fn, exclude, on_first_unpack):
        self.key, self.gen, self.mode = key, gen, mode
        self.policy_fn, self.check_fn, self.exclude = policy_fn, check_fn, exclude
        self.on_first_unpack, self.unpacked = on_first_unpack, False
        self.seen = {}          # view key -> SwapHandle (live only while the group is open)
        # what the group keeps (storage ptr -> bytes) and swaps (handle -> bytes it copies), each once; its
        # totals go into the report's layer figures when the group closes
        self.ledger = ActivationLedger()
        self.pending = []       # handles whose offload is not finished
        self.pending_ptrs = set()   # their storage pointers: a close finds outputs among them without a walk
        self.pending_bytes = 0  # their bytes, held on the device until the group closes
        # No rule but the size threshold: the pack hook decides without calling _keep_reason.
        self.plain = mode == "all" and policy_fn is None
        self.handles = []       # weakrefs to every handle of this group, for prefetch
        # storage ptr -> (tensor, tag, the marked storage) from swap_tensor_wrapper, and the copies of a
        # marked tensor's values met in pack (the last item names the mark they follow)
        self.marked = {}
        self.saved_marks = set()   # marked storages of which a save was offloaded
        self.digests = {}          # marked storage -> digest of its bytes (computed on the first candidate)
        self.unfollowed = set()    # storages compared with the marks and carrying none's values
        self.hooks = None
        self.stats = None       # the report's LayerSwapStats of this key, on the first pack

    def mark(self, tensor, tag):
        # The tensor is held until the group closes so its address stays unique meanwhile.
        sptr = storage_ptr(tensor)
        self.marked[sptr] = (tensor, tag, sptr)

    def follow(self, t, sptr):
        """The mark entry whose values ``t`` carries (a reshape or contiguous copy of a marked tensor), or None.

        Compared only with marks of the same element count and dtype not saved yet, by a digest of the bytes
        (computed once per tensor); a tensor that merely holds equal values is offloaded as the mark would
        have been, which is exact too.
        """
        if sptr in self.unfollowed:
            return None
        size, dtype = t.size, t.dtype
        candidates = [(msptr, entry) for msptr, entry in self.marked.items()
                      if entry[2] == msptr and msptr not in self.saved_marks
                      and entry[0].size == size and entry[0].dtype == dtype]
        if not candidates:
            return None
        digest = _digest(t)
        for msptr, entry in candidates:
            if msptr not in self.digests:
                self.digests[msptr] = _digest(entry[0])
            if self.digests[msptr] == digest:
                followed = (t, entry[1], msptr)
                self.marked[sptr] = followed
                return followed
        self.unfollowed.add(sptr)
        return None

    def unsaved(self):
        """``(tag, why)`` of each mark of this group that no save after it matched."""
        out = []
        for msptr, (_, tag, origin) in self.marked.items():
            if origin == msptr and msptr not in self.saved_marks:
                why = ("saved before the mark, by the op that made it: mark it where it is made, or mark what "
                       "its consumers save" if self.ledger.holds(msptr) else
                       "no op saved it, nor a copy of it: its consumers save other tensors (mark one of those)")
                out.append((tag, why))
        return out


def _digest(t):
    return hashlib.blake2b(tensor_bytes(t), digest_size=16).digest()



def with_min_bytes(settings, min_bytes):
    """The swap section ``settings`` with ``min_bytes`` in it (None: as it is)."""
    return settings if min_bytes is None else dataclasses.replace(settings, min_bytes=min_bytes)

class SwapScheduler:
    """Pack/unpack hooks and group bookkeeping over a ``SwapExecutor``.

    ``open_group``/``close_group`` bracket a forward region (strictly nested);
    ``prefetch(key)`` starts loading the latest call of ``key`` (only keys
    declared with ``mark_prefetchable`` keep their groups for it, so keys that
    are never prefetched do not accumulate). ``begin_call(key)`` starts a new
    call of a key, so groups from several sub-cells of one layer call are
    prefetched together and an older micro-batch's groups are not.
    """

    def __init__(self, executor=None, min_bytes=None, params=(), settings=None):
        # the swap section apply_ac was given (defaults without one): a setting of it that the scheduler reads
        # is read here, from ``self.settings``, with nothing in between to hand it over. ``min_bytes``: the
        # API's (swap_wrapper, SwapManager ...) own value, put in the section it holds.
        self.settings = with_min_bytes(settings if settings is not None else SwapConfig(), min_bytes)
        self.owns_executor = executor is None
        self.executor = executor if executor is not None else SwapExecutor()
        self.report = self.executor.report
        self.weights = WeightPointers(params)
        self.param_ptrs = self.weights.ptrs    # the hot path's set; updated in place by ``weights``
        self.extra_exclude = set()      # storages of the top-level model call's inputs
        self._stack = []
        self._gen = {}
        self._prefetchable = set()
        self._waiting = {}              # key -> closed groups awaiting prefetch
        # Outermost keys opened since the weights were last checked; None: check at the next outermost group.
        self._opened_since_check = None
        self._warned_marks = set()      # tags of marks that offloaded nothing, warned once each
        self._deferred = []             # closed groups whose copies wait for the next close (``defer``)

    @property
    def min_bytes(self):
        """Saved tensors smaller than this stay on the device: the section's ``min_bytes``."""
        return self.settings.min_bytes

    def add_params(self, params):
        """Never offload these tensors (weights arrive in pack as plain tensors sharing their storage)."""
        self.weights.add(params)

    def mark_prefetchable(self, key):
        self._prefetchable.add(key)

    def forget(self, key):
        """Drop what is kept per ``key`` (a layer that was unlinked or died); its handles still load on demand."""
        self._prefetchable.discard(key)
        self._gen.pop(key, None)
        self._waiting.pop(key, None)

    def current_group(self):
        return self._stack[-1] if self._stack else None

    def begin_call(self, key):
        self._gen[key] = self._gen.get(key, 0) + 1
        waiting = self._waiting.get(key)
        if waiting:  # groups never prefetched (e.g. forward without backward) whose handles are all gone
            waiting[:] = [g for g in waiting if any(r() is not None for r in g.handles)]

    def _check_weights(self, key):
        # Weights change between passes (an optimizer's set_data, a checkpoint reload), never inside one:
        # check them at the first outermost group of each forward pass, not at every layer's (one
        # data_ptr per parameter each time). A pass ends at a backward (the first unpack) or when an
        # outermost key comes again (a forward without backward).
        seen = self._opened_since_check
        if seen is None or key in seen:
            self.weights.refresh()
            self._opened_since_check = seen = set()
        seen.add(key)

    # --- groups ------------------------------------------------------------------------
    def open_group(self, key, mode="all", exclude=(), policy_fn=None, check_fn=None, on_first_unpack=None):
        """Start a region whose saved tensors follow ``mode``: 'all' (every candidate, filtered by
        ``policy_fn(tensor) -> CheckpointPolicy``), 'check' (``check_fn(tensor) -> bool``), 'marked'
        (only ``swap_tensor_wrapper`` tensors; inside another group it follows that group's rule)."""
        parent = self.current_group()
        if parent is None:
            self._check_weights(key)
        excl = set(exclude) | self.extra_exclude
        if parent is not None:
            excl |= parent.exclude
            if mode == "marked" and parent.mode != "marked":
                mode, policy_fn, check_fn = parent.mode, parent.policy_fn, parent.check_fn
        g = _Group(key, self._gen.get(key, 0), mode, policy_fn, check_fn, excl, on_first_unpack)
        g.hooks = ms.saved_tensors_hooks(self._pack, self._unpack)
        g.hooks.__enter__()
        self._stack.append(g)
        return g

    def close_group(self, g, failed=False, outputs=None, defer=False):
        """End the region: finish its copies, drop device references.

        ``outputs``: what the region returned. A saved tensor of the same
        storage as an output found in it (a tensor, tuples, lists, dicts:
        no object is searched) stays on the device (kept reason ``output``):
        the code after the region holds it anyway, so a copy would be
        wasted. Any other offloaded tensor the code after the region holds
        and writes (in a dataclass, a cache) is seen by its stamp
        (``executor.SavedStorage``): without AC the backward reads the
        storage an ``ops.assign_add`` wrote, and so does the load (rule W6s
        of docs/exactness.md).

        ``defer``: the region's outputs are unknown (``async_save_on_cpu``
        brackets a block, not a call): its copies are finished when the next
        group closes or backward starts, so that they hold what the next block
        wrote into them (rule W6s), as MindSpeed's copy of a block completes
        during the next one.

        Raises RuntimeError if a backend that copied at pack finds a saved
        tensor modified in place since, or if ``g`` is not the innermost open
        group (regions must nest).

        ``failed=True``: the region's forward raised (any exception, Ctrl-C
        included). Groups opened inside it and still open are closed first,
        nothing is raised (the original error must propagate, and this may run
        while it does), and the abandoned groups are not queued for prefetch:
        their forward produced no graph, so nothing will unpack them.
        """
        if failed:
            if g in self._stack:
                while self._stack:
                    if self._close_top(failed=True) is g:
                        break
            return
        if self.current_group() is not g:
            raise RuntimeError(f"swap group {g.key!r} closed out of order; swap regions must nest "
                               "(open and close groups with construct_patch.bracket_calls, which closes on every exit path)")
        self._close_top(failed=False, outputs=outputs, defer=defer)

    def _close_top(self, failed, outputs=None, defer=False):
        """Close the innermost group; returns it. Raises the first copy error unless ``failed``."""
        g = self._stack.pop()
        g.hooks.__exit__(None, None, None)
        g.hooks = None   # the hooks hold the scheduler: a graph kept past its step keeps the group, not them
        if outputs is not None and g.pending:
            self._keep_outputs(g, outputs)
        error = self.finish_deferred()
        if defer and not failed and g.pending:
            self._deferred.append(g)
        else:
            error = self._finish(g) or error
        g.seen.clear()
        if g.marked and not failed:
            self._note_unsaved(g)
        g.marked.clear()
        g.digests.clear()
        g.unfollowed.clear()
        self._report_bytes(g)
        if failed:
            return g
        if g.handles and g.key in self._prefetchable:
            self._waiting.setdefault(g.key, []).append(g)
        if error is not None:
            raise error
        return g

    def _report_bytes(self, g):
        """Close ``g``'s ledger into its layer's step figures (a failed forward's too: its copies were made)."""
        totals = g.ledger.close()
        stats = g.stats
        if stats is None:   # nothing was packed
            return
        stats.offloaded_bytes += totals.swapped
        stats.num_offloaded += totals.num_swapped
        stats.resident_bytes += totals.kept
        stats.num_resident += totals.num_kept

    def _finish(self, g):
        """Finish ``g``'s pending copies and drop their device tensors; returns the first copy error."""
        error = None
        try:
            self.executor.finish_offloads(g.pending)
        except RuntimeError as err:
            error = err
        self.report.release(g.pending_bytes)
        g.pending_bytes = 0
        g.pending.clear()
        g.pending_ptrs.clear()
        return error

    def finish_deferred(self):
        """Finish the copies of the groups closed with ``defer``; returns the first copy error."""
        error = None
        deferred, self._deferred = self._deferred, []
        for g in deferred:
            error = self._finish(g) or error
        return error

    def _keep_outputs(self, g, outputs):
        """Keep on the device the pending offloads of ``g`` that share storage with what it returned."""
        out_ptrs = tensor_storage_ptrs(outputs)
        if out_ptrs.isdisjoint(g.pending_ptrs):
            return
        stats = self.report.layers[g.key]
        still = []
        for h in g.pending:
            device = h.device
            sptr, snbytes = h.storage if device is not None else (None, 0)   # noted by _pack
            if sptr not in out_ptrs:
                still.append(h)
                continue
            self.executor.keep_on_device(h)
            g.pending_bytes -= h.nbytes
            self.report.release(h.nbytes)
            g.ledger.unswap(h)
            if g.ledger.keep_bytes(sptr, snbytes):
                stats.kept_reasons["output"] += 1
        g.pending[:] = still
        g.pending_ptrs.difference_update(out_ptrs)

    def _note_unsaved(self, g):
        unsaved = g.unsaved()
        if not unsaved:
            return
        stats = self.report.layers[g.key]
        for tag, why in unsaved:
            stats.unsaved_marks[tag] += 1
            if tag not in self._warned_marks:
                self._warned_marks.add(tag)
                logger.warning("mindformers_ac: swap_tensor_wrapper(tag=%r) in %s offloaded nothing: %s "
                               "(report: unsaved_marks)", tag, g.key, why)

    def prefetch(self, key, trigger=None):
        """Start loading the latest call of ``key``; returns the number of loads issued (none once the executor
        is closed: a backward recorded before ``remove_ac`` loads its tensors on demand)."""
        groups = self._waiting.pop(key, None)
        if not groups or self.executor.closed:
            return 0
        gen = max(g.gen for g in groups)
        older = [g for g in groups if g.gen != gen]
        if older:
            self._waiting[key] = older
        self.report.events.append(("prefetch", key, trigger))
        issued = 0
        # Backward unpacks in reverse pack order: issue the last-saved tensors first.
        for g in reversed([g for g in groups if g.gen == gen]):
            for ref in reversed(g.handles):
                h = ref()
                if h is not None and self.executor.prefetch(h):
                    issued += 1
        return issued

    # --- hooks -------------------------------------------------------------------------
    def _keep_reason(self, g, t, sptr):
        if sptr in g.exclude:
            return "input"
        if g.mode == "marked":
            return None if sptr in g.marked or (g.marked and g.follow(t, sptr) is not None) else "unmarked"
        if g.mode == "check":
            # the user's rule decides whatever the size (async_save_on_cpu's custom_check_fn: True offloads;
            # its default rule is the size threshold)
            return None if g.check_fn(t) else "check_fn"
        if g.policy_fn is not None:
            decision = g.policy_fn(t)
            if not isinstance(decision, CheckpointPolicy):
                raise TypeError(f"swap policy_fn must return a CheckpointPolicy, got {decision!r}")
            # An explicit MUST_SWAP overrides the size threshold; anything else keeps the tensor.
            return None if decision is CheckpointPolicy.MUST_SWAP else "policy"
        return "small" if t.nbytes < self.min_bytes else None

    def _pack(self, t):
        # Runs once per tensor saved for backward: at a dispatch-bound shape its Python is the cost of
        # swap, so the common case (no user rule) is decided inline.
        stack = self._stack
        if not stack:
            return t
        g = stack[-1]
        ptr = t.data_ptr()
        params = self.param_ptrs
        if ptr in params:
            return t
        info = t.param_info
        if info is not None:
            # A Parameter's own tensor (MindSpore marks it, whichever cell holds it: one added after the
            # install, or reached through a lambda); learnt, so that views of its storage stay too.
            if info.obj is not None:
                self.weights.learn(info.obj)
            return t
        sptr, snbytes = storage_info(t)
        if sptr in params:
            return t
        stats = g.stats
        if stats is None:
            stats = g.stats = self.report.layers[g.key]
        view = (ptr, t.shape, t.dtype)
        prev = g.seen.get(view)
        if prev is not None:
            prev.refs += 1
            stats.dedup_hits += 1
            return prev
        if g.plain:
            reason = "input" if sptr in g.exclude else ("small" if t.nbytes < self.settings.min_bytes else None)
        else:
            reason = self._keep_reason(g, t, sptr)
        if reason is None:
            marked = g.marked.get(sptr) if g.marked else None
            h = self.executor.start_offload(t, g.key, marked[1] if marked is not None else None)
            if h is not None:
                if marked is not None:
                    g.saved_marks.add(marked[2])
                h.owner = g
                h.storage = (sptr, snbytes)
                g.pending_ptrs.add(sptr)
                g.seen[view] = h
                g.pending.append(h)
                g.handles.append(weakref.ref(h))
                nbytes = h.nbytes
                g.pending_bytes += nbytes
                g.ledger.swap_bytes(h, nbytes)
                self.report.hold(nbytes)
                return h
            reason = "over_budget"
        return self._keep(g, t, sptr, snbytes, reason, stats)

    def _keep(self, g, t, sptr, nbytes, reason, stats):
        if g.ledger.keep_bytes(sptr, nbytes):
            stats.kept_reasons[reason] += 1
            if reason == "over_budget":
                stats.over_budget_bytes += nbytes
        self.report.add_resident(sptr, nbytes)
        return _Kept(_untracked(t), g, self.report, sptr)

    def _unpack(self, packed):
        if isinstance(packed, SwapHandle):
            g = packed.owner
            if g is not None and not g.unpacked:
                self._first_unpack(g)
            tensor = self.executor.load(packed)
            packed.refs -= 1
            if packed.refs <= 0:
                packed.drop_loaded()   # autograd holds it now
            return tensor
        if isinstance(packed, _Kept):
            g = packed.group
            if g is not None:
                packed.group = None
                if not g.unpacked:
                    self._first_unpack(g)
            return packed.tensor
        return packed

    def _first_unpack(self, g):
        g.unpacked = True
        error = self.finish_deferred()   # a forward that ended with a deferred group: its backward starts here
        if error is not None:
            raise error
        waiting = self._waiting.get(g.key)
        if waiting and g in waiting:   # its backward has started (loads on demand): a prefetch now takes an older call
            waiting.remove(g)
        self._opened_since_check = None   # a backward: the optimizer may change the weights next
        if g.on_first_unpack is not None:
            g.on_first_unpack()

    def close(self):
        """Finish the deferred copies; stop the executor if this scheduler created it."""
        self.finish_deferred()
        if self.owns_executor:
            self.executor.close()
