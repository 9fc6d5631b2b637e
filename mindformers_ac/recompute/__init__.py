"""The recompute engine: drop activations in forward, rebuild them exactly in backward.

* ``api``: ``checkpoint``, ``checkpoint_wrapper``/``unwrap``, ``exclude_policy``,
  ``is_in_recompute`` (HyperParallel's checkpoint API);
* ``policy``: ``CheckpointPolicy``, the per-op decision;
* ``region``: one checkpointed call, from its forward to its recompute;
* ``light``: the light path of a wrapped cell (saved-tensor hooks only, no per-op interception);
* ``dispatch``: op numbering and decisions inside a region run;
* ``tracking``: the cell path and op attribute a policy sees;
* ``saved``: what a region leaves in the autograd graph instead of a tensor;
* ``random_ops``: which ops can't be run again, and Dropout's exact rebuild;
* ``side_effects``: ops that write parameters (BatchNorm, Assign ...), written once per step;
* ``output``: output recompute of one op (``recompute_comm``, op paths);
* ``stats``: ``RecomputeStats``; ``state``: the per-thread engine state.
"""
from .api import (checkpoint, checkpoint_wrapper, exclude_policy, get_checkpoint_stats, is_checkpoint_wrapped,
                  is_in_recompute, unwrap)
from .dispatch import OP_NAME_ATTR, op_name_of
from .output import OpOutputHandle, wrap_op_output
from .policy import CheckpointPolicy
from .random_ops import RANDOM_OP_PATTERN, REPLAYABLE_ATTR, is_random_op_name
from .stats import RecomputeStats
from .tracking import OpContext

__all__ = [
    "CheckpointPolicy", "OP_NAME_ATTR", "OpContext", "OpOutputHandle", "RANDOM_OP_PATTERN", "REPLAYABLE_ATTR", "RecomputeStats",
    "checkpoint", "checkpoint_wrapper", "exclude_policy", "get_checkpoint_stats", "is_checkpoint_wrapped",
    "is_in_recompute", "is_random_op_name", "op_name_of", "unwrap", "wrap_op_output",
]
