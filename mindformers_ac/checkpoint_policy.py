"""What to do with one op's output inside a checkpointed region (HyperParallel's enum).

A module of its own at the package's top: the recompute engine returns it
from a ``policy_fn`` and the swap engine reads it from a swap ``policy_fn``
(MUST_SWAP), and neither engine imports the other for it; both check a
``policy_fn`` argument with ``check_policy_fn`` when it is given.
"""
import enum

from .errors import quote


class CheckpointPolicy(enum.Enum):
    """Per-op decision returned by a ``policy_fn``.

    The engine applies every decision as returned, MUST_* and PREFER_* alike,
    with one exception: a random op whose second call would draw different
    numbers (``Dropout`` and the like, unless its primitive is marked
    ``mac_replayable``) is never run again, so a recompute decision for it is
    overridden and its output (or, for Dropout, its mask) is kept. The MUST/PREFER
    distinction is kept for policies written against HyperParallel's API.
    """

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"
    MUST_SWAP = "must_swap"

    @property
    def recomputes(self):
        return self in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


POLICY_SIGNATURE = "(ctx, op, *args, **kwargs) -> CheckpointPolicy"


def check_policy_fn(where, policy_fn, signature=POLICY_SIGNATURE, arg="policy_fn"):
    """TypeError naming ``arg`` unless ``policy_fn`` is None or callable (checked when given, not at the
    first op)."""
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"{where}: {arg} must be a callable {signature} or None, "
                        f"got {type(policy_fn).__name__} {quote(policy_fn)}")
