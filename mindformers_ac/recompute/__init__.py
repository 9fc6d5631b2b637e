"""The recompute engine: drop activations in forward, rebuild them exactly in backward.

* ``api``: ``checkpoint``, ``checkpoint_wrapper``/``unwrap``, ``exclude_policy``
  (HyperParallel's checkpoint API);
* ``markers``: ``is_in_recompute``, ``save_for_recompute`` / ``get_recompute_metadata``
  (MindFormers' marker API) and the bridge to MindFormers' own marker;
* ``CheckpointPolicy``, the per-op decision, is defined in ``mindformers_ac.checkpoint_policy`` (the swap
  engine reads it too) and re-exported here;
* ``rerun``: what every region shares (run record, saved inputs, Dropout mask bits, the once-only recompute);
* ``region``: the op-intercepting way into a region, with ``dispatch`` (op numbering and decisions);
* ``light``: the light way in (saved-tensor hooks only, tensors matched by position);
* ``path_choice``: which way a wrapped call takes (per call signature, checked by a first call);
* ``keep_sites``: the op slots where a name-based policy's kept ops are kept on the light path;
* ``chain``: layer groups (``recompute.group_layers``), each member rebuilding the next one's input;
* ``messages``: every error and warning text, and ``RecomputeError``'s uses;
* ``tracking``: the cell path and op attribute a policy sees;
* ``op_slot``: ``OpSlot``, the one object standing in an op slot, with its roles (track, keep, dropout,
  output recompute), and the dropout role of ``nn.Dropout`` kernels handed to the running region;
* ``saved``: what a region leaves in the autograd graph instead of a tensor;
* ``random_ops``: which ops can't be run again, and Dropout's exact rebuild;
* ``side_effects``: what a forward writes (rules W1-W7 of docs/exactness.md): ops that write an argument,
  Parameters rebound in forward, each written once per step;
* ``output``: output recompute of one op (``recompute_comm``, op paths);
* ``stats``: ``RecomputeStats``, ``RegionBytes``; ``state``: the per-thread engine state;
* ``options``: PyTorch's and HyperParallel's checkpoint keywords, and the checks of a checkpoint's arguments;
* ``debug_log``: ``debug=True``'s op logs of both runs, side by side in a divergence error.

A recompute that can't rebuild what its forward dropped raises
``RecomputeError`` (a ``RuntimeError``) in backward.
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
