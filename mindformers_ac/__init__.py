"""mindformers-ac: activation recompute and swap for MindSpore PyNative training.

Build the model, then call ``apply_ac(model, recompute, recompute_comm, swap)``
with the sections of a MindFormers-style YAML (or ``config=AcConfig``).
``plan_ac`` is the same call as a dry run: it returns the ``AcPlan`` that
``apply_ac`` would execute and changes nothing.
"""
from .config import AcConfig, RecomputeCommConfig, RecomputeConfig, SwapConfig
from .errors import ConfigError
from .layer_specs import parse_layer_specs
from .plan import AcPlan, LayerPlan, plan_ac
from .policy import CheckpointPolicy
from .whitelist import get_single_layer_whitelist

__version__ = "0.1.0"

__all__ = [
    "AcConfig", "AcPlan", "CheckpointPolicy", "ConfigError", "LayerPlan", "RecomputeCommConfig",
    "RecomputeConfig", "SwapConfig", "get_single_layer_whitelist", "parse_layer_specs", "plan_ac",
]
