"""Layer groups (``recompute.group_layers``): consecutive layers recomputed together, keeping only the first one's
inputs (MindSpeed's ``--recompute-method uniform``).

A member after the first, called on the previous member's output (``x = layer(x, ...)``, or by keyword), does not
keep that argument but holds the previous member's region (``rerun.ChainedInput``), whose re-run output rebuilds it:
less is kept at the end of forward, more is alive inside backward. A member not called on the previous one's output,
or out of order, is refused with a ``RecomputeError`` naming the layers; one whose chained argument was written
between the two keeps it as an ungrouped layer does (rule W5 of docs/exactness.md).
"""
import weakref

from mindspore import Tensor

from ..mindspore_compat import tensor_stamp
from . import messages


def first_output(out):
    """The output a next member receives first: ``out`` itself, or the first item of a tuple output."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    return first if isinstance(first, Tensor) else None


class LayerChain:
    """The members of one group (their global layer ids, in call order) and the forward in progress."""

    __slots__ = ("layer_ids", "_next", "_region", "_output", "_stamp")

    def __init__(self, layer_ids):
        self.layer_ids = tuple(layer_ids)
        self._reset()

    def _reset(self):
        self._next, self._region, self._output, self._stamp = 0, None, None, None

    def link(self, index, args, kwargs=None):
        """Member ``index`` starts its forward on ``args`` and ``kwargs``: ``(the previous member's region, where
        its output went: a position or a keyword)``, None for the first member, or when the previous member's output
        was written since it returned (then this member keeps it)."""
        if index == 0:
            self._reset()
            self._next = 1
            return None
        if self._next != index:
            self._reset()
            raise messages.group_not_chained(self.layer_ids, index, "ran without the group's previous layer "
                                                                    "right before it")
        region = self._region() if self._region is not None else None
        output = self._output() if self._output is not None else None
        # where the output went: the first position or keyword holding that very tensor
        where = next((k for k, a in (*enumerate(args), *(kwargs or {}).items()) if output is not None and a is output),
                     None)
        if region is None or where is None:
            self._reset()
            raise messages.group_not_chained(self.layer_ids, index, "did not receive the previous layer's output "
                                                                    "as an argument")
        if tensor_stamp(output) != self._stamp:
            return None
        return region, where

    def done(self, index, region, out):
        """Member ``index`` returned ``out``: the next member must receive its first output."""
        first = first_output(out)
        if index == len(self.layer_ids) - 1 or first is None:
            self._reset()
            return
        self._next, self._region, self._output = index + 1, weakref.ref(region), weakref.ref(first)
        self._stamp = tensor_stamp(first)
