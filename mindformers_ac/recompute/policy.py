"""``CheckpointPolicy`` under the recompute engine's name for it: the enum lives in ``checkpoint_policy``
(the swap engine reads it too, without importing this engine)."""
from ..checkpoint_policy import CheckpointPolicy

__all__ = ["CheckpointPolicy"]
