"""A model stepped with plain SGD and measured: the step runner ``train`` and the planner share.

``TrainingRun`` applies a config (``apply_ac``), builds the optimizer and
``value_and_grad``, and times each step while ``accounting.StepMeter``
measures its activation memory per layer.
"""
import time

import mindspore as ms
from mindspore import nn

from .accounting import StepMeter
from .apply import apply_ac


class TrainingRun:
    """One model stepped with plain SGD and measured: what ``train`` and the planner's profile share.

    ``config`` (an ``AcConfig``, dict or YAML path) is applied with ``apply_ac``
    when given; ``plan`` is what it executed, else None. ``layers`` names the
    model's layer list when it is not found automatically (``find_layer_stack``).
    """

    def __init__(self, model, config=None, lr=0.05, layers=None):
        self.model = model
        self.plan = apply_ac(model, config=config, layers=layers) if config else None
        self.optimizer = nn.SGD(model.trainable_params(), learning_rate=lr)
        self.grad_fn = ms.value_and_grad(model, None, self.optimizer.parameters)
        self.meter = StepMeter(model, layers)

    def step(self, inputs, sync_grads=None):
        """One training step on ``model(*inputs)``; returns ``(loss, grads, StepMemory, seconds)``.

        ``sync_grads(params, grads) -> grads`` runs before the update (tensor
        parallel: the partial gradients of replicated parameters); it is timed.
        """
        start = time.perf_counter()
        with self.meter.step() as memory:
            loss, grads = self.grad_fn(*inputs)
        if sync_grads is not None:
            grads = sync_grads(self.optimizer.parameters, grads)
        self.optimizer(grads)
        return loss, grads, memory, time.perf_counter() - start
