"""Counters of recompute regions: bytes kept, dropped and swapped, ops run and re-run, which path ran.

``RegionBytes`` is the one ledger of what a region keeps, drops (to rebuild)
and swaps during its forward: both paths into a region and output recompute's
scope write it; ``RecomputeStats`` sums the ledgers of the regions that are
alive, and ``accounting.LayerMeter``'s step figures read those sums. The swap
engine's report is its own (docs/architecture.md says why).
"""
import collections
import weakref

from mindspore import Tensor

from ..tensors import output_tensors, storage_info


class RegionBytes:
    """Bytes one region forward keeps, drops and swaps, each storage counted once; weights never.

    ``param_ptrs``: ``data_ptr`` of the region's weights, which are alive
    anyway. Keys are storage pointers, so a tensor kept twice (a saved input
    that an op saves again) counts once; engine-owned bytes (mask bits, copies
    of written parameters) go in under their own keys with ``add``. ``close``
    hands the totals to a ``RecomputeStats`` and frees the per-storage maps.
    """

    __slots__ = ("param_ptrs", "kept", "dropped", "swapped", "producer", "dropped_total", "rebuilt_bytes")

    def __init__(self, param_ptrs):
        self.param_ptrs = param_ptrs
        self.kept, self.dropped, self.swapped = {}, {}, {}
        self.rebuilt_bytes = None   # dropped bytes known as a sum (``rebuilt``), not per storage
        self.producer = {}   # storage ptr -> index of the latest op whose output lives there
        self.dropped_total = 0   # the dropped bytes, once closed (a checking call's, for its light calls)

    def keep(self, t):
        """``t`` stays alive until backward because the region keeps it."""
        if t.data_ptr() in self.param_ptrs:
            return
        ptr, nbytes = storage_info(t)
        self.kept[ptr] = nbytes

    def unkeep(self, t):
        """``t`` is no longer kept (a kept op's output no backward read: rule K2)."""
        self.kept.pop(storage_info(t)[0], None)

    def add(self, key, nbytes):
        """Bytes the engine made itself and keeps (a Dropout's mask bits, copies of written parameters)."""
        self.kept[key] = nbytes

    def note_outputs(self, idx, out):
        """Remember which op produced each output storage (see ``drop``)."""
        for t in output_tensors(out):
            if isinstance(t, Tensor):
                self.producer[storage_info(t)[0]] = idx

    def drop(self, t):
        """``t`` was saved by an op and left for the recompute to rebuild."""
        # Dropped storages die during forward and their addresses are reused by later outputs:
        # keying by address alone would count two different activations once.
        ptr, nbytes = storage_info(t)
        self.dropped[(ptr, self.producer.get(ptr))] = nbytes

    def rebuilt(self, nbytes):
        """``nbytes`` more are dropped, counted by the caller (output recompute's settled calls; the light
        path's checking call): they stand for the per-storage drops."""
        self.rebuilt_bytes = (self.rebuilt_bytes or 0) + nbytes

    def swap(self, t):
        """``t`` was handed to a swap executor."""
        ptr, nbytes = storage_info(t)
        self.swapped[ptr] = nbytes

    def close(self, stats, owner):
        """Report the forward's totals to ``stats`` until ``owner`` (the region) is garbage."""
        kept = sum(self.kept.values())
        dropped = self.rebuilt_bytes
        if dropped is None:
            dropped = sum(n for (p, _), n in self.dropped.items() if p not in self.kept)
        swapped = sum(n for p, n in self.swapped.items() if p not in self.kept)
        self.kept = self.dropped = self.swapped = self.producer = None   # only the totals are needed now
        self.dropped_total = dropped
        stats.open_region(owner, kept, dropped, swapped)


class RecomputeStats:
    """Counters of one or more regions (``apply_ac`` shares one per layer).

    ``kept_bytes``: bytes kept for backward by the live regions of this stats
    object, read when the latest region forward ended (storage-deduplicated
    inside a region, weights excluded); ``peak_kept_bytes`` its maximum.
    ``dropped_bytes`` / ``swapped_bytes``: same, for bytes dropped for recompute
    and handed to the swap executor (``dropped_bytes`` is a lower bound: a
    storage freed during the forward and reallocated at the same address is
    counted once). ``live_bytes`` / ``live_regions`` fall back
    to 0 when backward has freed the regions. ``ops_forward``: ops run in region
    forwards; ``ops_rerun``: ops run again in backward (``rerun_by_op`` by name);
    ``ops_reused``: ops whose kept outputs replaced a re-run (policy saves,
    excluded ops, random ops); ``recompute_calls``: backward-time re-runs.
    ``intercepted_calls`` / ``light_calls``: region forwards that ran on the
    op-intercepting path / on the light path (see ``path_choice``); a wrapped
    cell without a per-op decision is intercepted on its first call per call
    signature and light afterwards, so ``light_calls`` staying 0 means it
    never left the slower path. ``chained_calls``: region forwards of a layer
    group's later members, whose first argument was not kept but will be
    rebuilt from the previous member (``chain``). ``unread_kept``: kept ops whose
    outputs no backward read, re-run instead of kept (rule K2 of docs/exactness.md).
    ``intercept_reasons``:
    why calls stayed on the intercepting path (reason -> times found: once per
    checked call signature, once per call of a region that is never checked,
    such as one with a per-call policy), e.g. an excluded op called as a
    Tensor method, where no keep site can hold it (``keep_sites``).
    ``early_stops``: re-runs that stopped after the last op that left a
    dropped tensor (``early_stop``, the intercepting path).
    """

    _COUNTERS = ("kept_bytes", "peak_kept_bytes", "dropped_bytes", "swapped_bytes", "ops_forward",
                 "ops_rerun", "ops_reused", "recompute_calls", "intercepted_calls", "light_calls", "chained_calls",
                 "unread_kept", "live_bytes", "live_regions", "early_stops")

    def __init__(self):
        self._generation = 0
        self.reset()

    def reset(self):
        """Zero every counter; regions still alive no longer report to this object."""
        self._generation += 1
        for name in self._COUNTERS:
            setattr(self, name, 0)
        self._live_dropped = 0
        self._live_swapped = 0
        self.rerun_by_op = collections.Counter()
        self.intercept_reasons = collections.Counter()

    def note_intercepted(self, reasons):
        """A call signature (or an unchecked call) stays intercepted, for these reasons."""
        self.intercept_reasons.update(set(reasons))

    def count_rerun(self, op_name, n=1):
        self.ops_rerun += n
        self.rerun_by_op[op_name] += n

    def open_region(self, owner, kept, dropped, swapped):
        """Account a finished forward; the bytes are released when ``owner`` is garbage."""
        self.live_bytes += kept
        self._live_dropped += dropped
        self._live_swapped += swapped
        self.live_regions += 1
        self.kept_bytes = self.live_bytes
        self.dropped_bytes = self._live_dropped
        self.swapped_bytes = self._live_swapped
        self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)
        fin = weakref.finalize(owner, self._close_region, self._generation, kept, dropped, swapped)
        fin.atexit = False   # nothing to release at interpreter exit

    def _close_region(self, generation, kept, dropped, swapped):
        if generation != self._generation:
            return
        self.live_bytes -= kept
        self._live_dropped -= dropped
        self._live_swapped -= swapped
        self.live_regions -= 1

    def as_dict(self):
        d = {name: getattr(self, name) for name in self._COUNTERS}
        d["rerun_by_op"] = dict(self.rerun_by_op)
        d["intercept_reasons"] = dict(self.intercept_reasons)
        return d

    def __repr__(self):
        return f"RecomputeStats({self.as_dict()})"
