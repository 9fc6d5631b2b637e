"""mindformers-ac: activation recompute and swap for MindSpore PyNative training.

Build the model, then call ``apply_ac(model, recompute, recompute_comm, swap)``
with the sections of a MindFormers-style YAML (or ``config=AcConfig``).
``plan_ac`` is the same call as a dry run: it returns the ``AcPlan`` that
``apply_ac`` would execute and changes nothing. ``measure_step`` reports the
activation memory of one training step per layer.
"""
from .mindspore_compat import require_mindspore

require_mindspore()   # before any engine import: a clear error instead of a missing attribute later

from . import swap  # the swap engine; callable as swap(fn, *args) (HyperParallel's API)
from .accounting import StepMemory, measure_step
from .apply import ac_state, apply_ac, remove_ac
from .config import AcConfig, RecomputeCommConfig, RecomputeConfig, SwapConfig
from .errors import ConfigError, RecomputeError
from .layer_specs import parse_layer_specs
from .plan import AcPlan, LayerPlan, plan_ac
from .recompute import (
                        CheckpointPolicy,
                        RecomputeStats,
                        checkpoint,
                        checkpoint_wrapper,
                        get_recompute_metadata,
                        is_in_recompute,
                        save_for_recompute,
                        unwrap,
)
from .swap import SwapManager, SwapReport, async_save_on_cpu, remove_swap_wrapper, swap_tensor_wrapper, swap_wrapper
from .whitelist import get_single_layer_whitelist

__version__ = "0.1.0"

# What trainers call (README, MindFormers' apply_ac, HyperParallel's checkpoint/swap API, MindSpeed's
# async_save_on_cpu) and the types they get back; the engines' internals stay in their subpackages.
__all__ = [
    "AcConfig", "AcPlan", "CheckpointPolicy", "ConfigError", "LayerPlan", "RecomputeCommConfig",
    "RecomputeConfig", "RecomputeError", "RecomputeStats", "StepMemory", "SwapConfig", "SwapManager", "SwapReport",
    "ac_state", "apply_ac", "async_save_on_cpu", "checkpoint", "checkpoint_wrapper", "get_recompute_metadata",
    "get_single_layer_whitelist", "is_in_recompute", "measure_step", "parse_layer_specs", "plan_ac", "remove_ac",
    "remove_swap_wrapper", "save_for_recompute", "swap", "swap_tensor_wrapper", "swap_wrapper", "unwrap",
]
