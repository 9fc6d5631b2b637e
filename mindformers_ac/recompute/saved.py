"""What a region's pack hook leaves in the autograd graph in place of a saved tensor.

A ``Token`` stands for a tensor dropped for recompute (it holds the region,
not the tensor, until backward); a ``SwappedTensor`` for one handed to a swap
executor. ``unpack_saved`` turns either back into a tensor.
"""
from . import messages


class SwappedTensor:
    """A tensor handed to a swap executor; loaded back on unpack."""

    __slots__ = ("executor", "handle")

    def __init__(self, executor, tensor):
        self.executor, self.handle = executor, executor.offload(tensor)

    def load(self):
        return self.executor.load(self.handle)


class Token:
    """Stands in for a dropped saved tensor; holds the region (not the tensor) until backward."""

    __slots__ = ("region", "key", "tensor")

    def __init__(self, region, key):
        self.region, self.key, self.tensor = region, key, None

    def resolve(self):
        if self.tensor is not None:
            return self.tensor
        region = self.region
        region.ensure_recomputed()
        t = region.recomputed.pop(self.key, None)
        if t is None:
            # The recompute checked that it regenerated every dropped tensor (Region.check_recompute) but
            # those of ops it skipped under the marker, so a missing one was skipped or handed out already.
            idx, k = self.key
            if idx in region.skipped:
                raise messages.skipped_op_needed(idx, region.describe_op(idx))
            raise messages.already_used(f"saved tensor #{k} of op #{idx} {region.describe_op(idx)}")
        return t


def unpack_saved(obj):
    """Unpack hook shared by all region forwards."""
    if isinstance(obj, Token):
        return obj.resolve()
    if isinstance(obj, SwappedTensor):
        return obj.load()
    return obj


def keep_saved(obj):
    return obj


def drop_saved(_tensor):
    # The replay graph is never backpropagated: keep nothing alive for it.
    return None
