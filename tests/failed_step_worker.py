"""One kind of failed step, caught by the training loop, in every AC mode: prints one JSON line.

Run by ``test_failed_steps.py`` in a fresh interpreter (an exception inside
MindSpore's grad leaves its executor in a state that lasts for the process:
its grad flag stays set). Per mode, a model with AC and the same model
without AC train 4 steps; step 1 fails the same way in both, is caught, and
is not applied (no ``clear_res()``: a loop that skips a bad batch does not
know it). The histories must be bitwise equal, the library must have left
no engine run, saved-tensor hook, dispatch mode or swap group behind, and
the mode must have acted.

The kinds (issue 38, point 1, found by porting HyperParallel's and PyTorch's
checkpoint tests, whose loops go on after a failed step):

* ``before_op``: the model's construct raises before any op;
* ``after_op``: layer 1 raises after its attention (inside a region);
* ``bad_keyword``: layer 1 is called with a keyword its construct lacks
  (a TypeError inside the region's call, after layer 0 ran);
* ``plain_grad``: a plain ``ms.grad`` of a function with no AC raises;
* ``in_backward``: a tensor hook on layer 1's output raises in backward,
  after layer 2's re-run.
"""
import json
import sys

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

import mindformers_ac as mac
from mindformers_ac.mindspore_compat import (
    EXECUTOR_CALLS,
    dispatch_mode_depth,
    pynative_executor,
    synchronous_pynative,
)
from mindformers_ac.recompute.state import ENGINE

from model_patterns import (
    N_LAYERS,
    PATTERNS,
    FailingLayer,
    H,
    InjectedFailure,
    PatternModel,
    hidden_batch,
    init_weights,
    mode_config,
)
from steps import _record, ac_counters, assert_acted, first_difference, install_api

MODES = ("full", "select_cell", "select_op", "exclude_op", "layer_swap", "checkpoint_api")


class RMSNorm(nn.Cell):
    """In place of ``nn.LayerNorm``: after a grad call that raised, MindSpore 2.10's next backward through a
    LayerNorm fails without AC too ("For LayerNormGrad, the index 7 is out of range"), so there would be
    no model without AC to compare with."""

    def __init__(self):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(H, np.float32)), name="weight")

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * self.weight


class StepLayer(FailingLayer):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(), RMSNorm()


class StepModel(PatternModel):
    """``PatternModel`` of ``FailingLayer``s (with RMSNorm) whose construct fails as ``failure`` says."""

    def __init__(self):
        super().__init__([StepLayer() for _ in range(N_LAYERS)])
        self.failure = None

    def construct(self, x, y, pos, mask):
        if self.failure == "before_op":
            raise InjectedFailure("before any op")
        for i, layer in enumerate(self.layers):
            extra = {"bogus": 1} if self.failure == "bad_keyword" and i == 1 else {}
            x = self.run_layer(layer, x, pos, mask, self.scale, **extra)
            if self.failure == "in_backward" and i == 1:
                x = x * 1
                x.register_hook(_raise_in_backward)
        return self.loss(x, y)


def _raise_in_backward(grad):
    raise InjectedFailure("in backward")


def build():
    return init_weights(StepModel())


def fail_once(model, grad_fn, inputs, kind):
    """Run the failing step ``kind``; returns the exception's type name (it must raise)."""
    if kind == "plain_grad":
        def plain(v):
            y = ops.sin(v).sum()
            raise InjectedFailure(f"after an op, no AC ({y.shape})")
        fn, args = ms.grad(plain), (inputs[0],)
    else:
        fn, args = grad_fn, inputs
        if kind == "after_op":
            model.layers[1].fail = True
        else:
            model.failure = kind
    try:
        fn(*args)
    except (InjectedFailure, TypeError, RuntimeError) as exc:
        return type(exc).__name__
    finally:
        model.failure = None
        model.layers[1].fail = False
    raise AssertionError(f"the {kind} step did not raise")


def library_state():
    """What the library could have left behind (all falsy when nothing is)."""
    return {"engine_run": ENGINE.top() is not None, "in_recompute": ENGINE.in_recompute(),
            "saved_tensor_hook": bool(pynative_executor.is_saved_tensor_hook_active()),
            "dispatch_modes": dispatch_mode_depth(),
            "swap_group": mac.SwapManager().scheduler.current_group() is not None,
            # what the higher-order check reads: no grad call counted as running once the failed one is gone
            "grad_calls": EXECUTOR_CALLS.grad_calls(), "grad_forward": EXECUTOR_CALLS.grad_forward_running()}


def train(model, kind, steps=4):
    model.set_train(True)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history, raised, state = [], None, None
    for step in range(steps):
        if step == 1:
            raised = fail_once(model, grad_fn, hidden_batch(step), kind)
            state = library_state()
        loss, grads = grad_fn(*hidden_batch(step))
        opt(grads)
        history.append(_record(model, loss, grads))
    return history, raised, state


def main(kind):
    result = {}
    for mode in MODES:
        base, base_raised, _ = train(build(), kind)
        model = build()
        if mode == "checkpoint_api":
            counter = install_api(mode, model)
        else:
            mac.apply_ac(model, config=mac.AcConfig.from_dict(mode_config(mode, PATTERNS["failed_forward"])))
            counter = None
        counters = ac_counters(model)
        history, raised, state = train(model, kind)
        assert_acted(mode, model, counter, counters)
        result[mode] = {"difference": first_difference(base, history), "raised": raised,
                        "raised_without_ac": base_raised, "left_behind": {k: v for k, v in state.items() if v}}
    print(json.dumps(result))


if __name__ == "__main__":
    synchronous_pynative("CPU")
    main(sys.argv[1])
