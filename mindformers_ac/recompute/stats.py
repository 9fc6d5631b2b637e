"""Counters of recompute regions: bytes kept, dropped and swapped (each region's ``ledger.ActivationLedger`` totals,
held while it is alive, summed by ``accounting.LayerMeter``), ops run and re-run, which path ran."""
import collections
import weakref


class RecomputeStats:
    """Counters of one or more regions (``apply_ac`` shares one per layer).

    ``kept_bytes``: bytes kept for backward by the live regions of this stats object, read when the latest region
    forward ended (storage-deduplicated inside a region, weights excluded); ``peak_kept_bytes`` its maximum.
    ``dropped_bytes`` / ``swapped_bytes``: same, for bytes dropped for recompute and handed to the swap executor
    (``dropped_bytes`` is a lower bound: a storage freed during the forward and reallocated at the same address is
    counted once). ``live_bytes`` / ``live_regions`` fall back to 0 when backward has freed the regions.
    ``ops_forward``: ops run in region forwards; ``ops_rerun``: ops run again in backward (``rerun_by_op`` by name);
    ``ops_reused``: ops whose kept outputs replaced a re-run (policy saves, excluded ops, random ops);
    ``recompute_calls``: backward-time re-runs. ``intercepted_calls`` / ``light_calls``: region forwards that ran on
    the op-intercepting path / on the light path (see ``path_choice``); a wrapped cell without a per-op decision is
    intercepted on its first call per call signature and light afterwards, so ``light_calls`` staying 0 means it
    never left the slower path. ``chained_calls``: region forwards of a layer group's later members, whose first
    argument was not kept but will be rebuilt from the previous member (``chain``). ``unread_kept``: kept ops whose
    outputs no backward read, re-run instead of kept (rule K2 of docs/exactness.md, PREFER_SAVE only).
    ``kept_over_bytes``: the most one region's forward kept beyond what it saved for backward (what the model keeps
    without AC), because its policy's MUST_SAVE ops (``exclude_op``) are kept whatever they cost.
    ``intercept_reasons``: why calls stayed on the intercepting path (reason -> times found: once per checked call
    signature, once per call of a region that is never checked, such as one with a per-call policy), e.g. an
    excluded op called as a Tensor method, where no keep site can hold it (``keep_sites``). ``early_stops``: re-runs
    that stopped after the last op that left a dropped tensor (``early_stop``, the intercepting path).
    """

    _COUNTERS = ("kept_bytes", "peak_kept_bytes", "dropped_bytes", "swapped_bytes", "ops_forward",
                 "ops_rerun", "ops_reused", "recompute_calls", "intercepted_calls", "light_calls", "chained_calls",
                 "unread_kept", "kept_over_bytes", "live_bytes", "live_regions", "early_stops")

    def __init__(self):
        self._generation = 0
        self.reset()

    def reset(self):
        """Zero every counter; regions still alive no longer report to this object."""
        self._generation += 1
        for name in (*self._COUNTERS, "_live_dropped", "_live_swapped"):
            setattr(self, name, 0)
        self.rerun_by_op = collections.Counter()
        self.intercept_reasons = collections.Counter()

    def note_intercepted(self, reasons):
        """A call signature (or an unchecked call) stays intercepted, for these reasons."""
        self.intercept_reasons.update(set(reasons))

    def note_kept_over(self, nbytes):
        self.kept_over_bytes = max(self.kept_over_bytes, nbytes)

    def count_rerun(self, op_name, n=1):
        self.ops_rerun += n
        self.rerun_by_op[op_name] += n

    def open_region(self, owner, totals):
        """Account a finished forward (its ledger's ``LedgerTotals``); the bytes are released when ``owner`` is
        garbage."""
        kept, dropped, swapped = totals.kept, totals.dropped, totals.swapped
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
