"""``MUST_SWAP`` and swapped inputs: offloaded in forward once per storage and op, loaded back on demand."""
from mindspore import Tensor

from ...tensors import output_tensors
from .. import messages
from ..rerun import SwappedTensor
from ..state import ENGINE
from .base import Rule


class MustSwap(Rule):
    """The region's swap executor (None: a ``MUST_SWAP`` op is kept instead, with a warning) and what it holds."""

    __slots__ = ("executor", "inputs", "holders")

    def __init__(self, region, executor, swap_inputs):
        super().__init__(region)
        self.executor, self.inputs = executor, swap_inputs
        self.holders = {}   # (op index, ptr) -> SwappedTensor: one offload per storage and op
        if swap_inputs:
            self.keeps_intercepted("swap_inputs", "its inputs are swapped")

    def available(self):
        if self.executor is None:
            ENGINE.warnings.warning("must_swap", messages.MUST_SWAP_WITHOUT_EXECUTOR)
        return self.executor is not None

    def offload(self, run, t, key=None):
        key = key if key is not None else (run.current_op(), t.data_ptr())
        holder = self.holders.get(key)
        if holder is None:
            with run.engine_ops():   # the executor may run ops: they are not part of the region
                holder = SwappedTensor(self.executor, t)
            self.holders[key] = holder
            self.region.bytes.swap(t)
        return holder

    def input_offloader(self, run):
        """How ``save_inputs`` keeps the region's inputs: offloaded (``swap_inputs``) or None (on the device)."""
        if self.inputs and self.executor is None:
            ENGINE.warnings.warning("swap_inputs", messages.SWAP_INPUTS_WITHOUT_EXECUTOR)
        if not self.inputs or self.executor is None:
            return None
        return lambda t, ptr: self.offload(run, t, key=("input", ptr))

    def keep_output(self, run, idx, out):
        self.region.kept.cache[idx] = (tuple(self.offload(run, t) if isinstance(t, Tensor) else t
                                             for t in output_tensors(out)), isinstance(out, (tuple, list)))

    @staticmethod
    def load(held):
        items, is_seq = held
        items = tuple(t.load() if isinstance(t, SwappedTensor) else t for t in items)
        return items if is_seq else items[0]
