"""The recompute engine: drop activations in forward, rebuild them exactly in backward.

Public (``__all__``): HyperParallel's checkpoint API with PyTorch's keywords, MindFormers' marker API and output
recompute of one op; ``CheckpointPolicy`` lives in ``mindformers_ac.checkpoint_policy`` (the swap engine reads it too).
Each mechanism, why it exists and its invariant: docs/architecture.md, "The recompute engine's mechanisms".

A recompute that can't rebuild what its forward dropped raises ``RecomputeError`` (a ``RuntimeError``) in backward.
"""
from ..checkpoint_policy import CheckpointPolicy
from ..errors import RecomputeError
from .api import (
                  checkpoint,
                  checkpoint_wrapper,
                  exclude_policy,
                  get_checkpoint_stats,
                  is_checkpoint_wrapped,
                  unwrap,
)
from .dispatch import OP_NAME_ATTR, op_name_of
from .markers import get_recompute_metadata, is_in_recompute, save_for_recompute
from .output import OpOutputHandle, wrap_op_output
from .random_ops import RANDOM_OP_PATTERN, REPLAYABLE_ATTR, is_random_op_name
from .stats import RecomputeStats
from .tracking import OpContext

__all__ = [
    "CheckpointPolicy", "OP_NAME_ATTR", "OpContext", "OpOutputHandle", "RANDOM_OP_PATTERN", "REPLAYABLE_ATTR",
    "RecomputeError", "RecomputeStats",
    "checkpoint", "checkpoint_wrapper", "exclude_policy", "get_checkpoint_stats", "get_recompute_metadata",
    "is_checkpoint_wrapped", "is_in_recompute", "is_random_op_name", "op_name_of", "save_for_recompute", "unwrap",
    "wrap_op_output",
]
