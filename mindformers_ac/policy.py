"""What to do with one op's output inside a checkpointed region (HyperParallel's enum)."""
import enum


class CheckpointPolicy(enum.Enum):
    """Per-op decision returned by a ``policy_fn``.

    MUST_* decisions are never overridden; PREFER_* ones may be (a random op is
    always saved, whatever a policy prefers, because its output cannot be
    reproduced on CPU).
    """

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"
    MUST_SWAP = "must_swap"

    @property
    def saves(self):
        return self in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

    @property
    def recomputes(self):
        return self in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
