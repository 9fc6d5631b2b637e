"""The one ledger of activation bytes: what a recompute region or a swap group keeps, drops and swaps.

Every engine counts the bytes of a forward it runs here: a recompute region
(both ways into it) and output recompute's scope (``recompute.rerun``,
``recompute.output``), and a swap group (``swap.scheduler``). ``close()``
ends the forward and hands back its ``LedgerTotals``; what reads them adds
what only it knows: ``recompute.stats.RecomputeStats`` holds a region's
totals while the region lives (its backward frees them),
``swap.executor.SwapReport`` adds a group's to its layer's step figures
beside the load figures a backward makes (in time, late, on demand) and the
refcounted bytes resident across groups, and ``accounting.LayerMeter`` reads
those two. One writer counts outside a ledger: ``SwapExecutor.offload``, the
synchronous offload other engines call with no group around it (a recompute
region's swapped inputs), counts into ``SwapReport`` directly, and the
region's own ledger counts the same tensor as swapped
(docs/architecture.md, "The ledger").
"""
from typing import NamedTuple

from mindspore import Tensor

from .tensors import output_tensors, storage_info


class LedgerTotals(NamedTuple):
    """A closed forward's bytes: ``kept`` on the device for backward, ``dropped`` to be rebuilt, ``swapped``
    to host; ``num_kept`` / ``num_swapped`` the entries behind the first and last."""

    kept: int
    dropped: int
    swapped: int
    num_kept: int
    num_swapped: int


class ActivationLedger:
    """Bytes one forward keeps, drops and swaps, each key counted once; weights never.

    ``param_ptrs``: ``data_ptr`` of the forward's weights, which are alive
    anyway (None: the caller has left them out already). Kept and swapped
    tensors are keyed by storage pointer, so a tensor kept twice (a saved
    input that an op saves again) counts once; bytes the caller knows better
    go in under its own keys (``keep_bytes``: a Dropout's mask bits, copies of
    written parameters, a swap group's kept storages; ``swap_bytes``: a swap
    handle, the bytes its view copies). ``close`` returns the totals and frees
    the per-key maps.
    """

    __slots__ = ("param_ptrs", "kept", "dropped", "swapped", "producer", "dropped_total", "rebuilt_bytes")

    def __init__(self, param_ptrs=None):
        self.param_ptrs = param_ptrs
        self.kept, self.dropped, self.swapped = {}, {}, {}
        self.rebuilt_bytes = None   # dropped bytes known as a sum (``rebuilt``), not per storage
        self.producer = {}   # storage ptr -> index of the latest op whose output lives there
        self.dropped_total = 0   # the dropped bytes, once closed (a checking call's, for its light calls)

    # -- kept ------------------------------------------------------------------------------------
    def keep(self, t):
        """``t`` stays alive until backward because the forward keeps it."""
        if self.param_ptrs is not None and t.data_ptr() in self.param_ptrs:
            return
        ptr, nbytes = storage_info(t)
        self.kept[ptr] = nbytes

    def keep_bytes(self, key, nbytes):
        """``nbytes`` kept under the caller's ``key``; whether the key is new."""
        new = key not in self.kept
        self.kept[key] = nbytes
        return new

    def unkeep(self, t):
        """``t`` is no longer kept (a kept op's output no backward read: rule K2)."""
        self.kept.pop(storage_info(t)[0], None)

    def holds(self, key):
        """Whether ``key`` is kept."""
        return key in self.kept

    # -- dropped ---------------------------------------------------------------------------------
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

    # -- swapped ---------------------------------------------------------------------------------
    def swap(self, t):
        """``t`` was handed to a swap executor."""
        ptr, nbytes = storage_info(t)
        self.swapped[ptr] = nbytes

    def swap_bytes(self, key, nbytes):
        """``nbytes`` swapped under the caller's ``key`` (a swap handle: the bytes of the view it copies)."""
        self.swapped[key] = nbytes

    def unswap(self, key):
        """The swap under ``key`` was given up (the tensor stays on the device: keep it too)."""
        self.swapped.pop(key, None)

    # -- closing ---------------------------------------------------------------------------------
    def close(self):
        """The forward's ``LedgerTotals``; only the totals are kept from now on."""
        kept = sum(self.kept.values())
        dropped = self.rebuilt_bytes
        if dropped is None:
            dropped = sum(n for (p, _), n in self.dropped.items() if p not in self.kept)
        swapped = [n for p, n in self.swapped.items() if p not in self.kept]
        totals = LedgerTotals(kept, dropped, sum(swapped), len(self.kept), len(swapped))
        self.kept = self.dropped = self.swapped = self.producer = None
        self.dropped_total = dropped
        return totals
