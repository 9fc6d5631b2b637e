"""Subprocess worker for test_model_patterns: scenarios that raise inside MindSpore's grad.

An exception inside ``value_and_grad`` can leave the PyNative executor broken
for the rest of the process, so these run here, one process per test:

* ``interrupt MODE``: for each of RuntimeError, KeyboardInterrupt and
  SystemExit raised in forward, in a backward tensor hook and (recompute
  modes) during the recompute, in step 1 of 3 of the batchnorm pattern; prints
  one JSON line with what held afterwards;
* ``divergence``: a region reading a tensor from outside its arguments that
  requires grad in forward only (the recompute must name the op);
* ``kept_write_read_before``: a recomputed read of a table that a kept (too
  large to copy) ScatterUpdate writes later (must raise, naming both ops).
"""
import json
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore._c_expression import _DispatchGuardStack
from mindspore.graph.api import _pynative_executor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mindformers_ac as mac  # noqa: E402
from mindformers_ac.mindspore_compat import synchronous_pynative  # noqa: E402

synchronous_pynative("CPU")
from mindformers_ac.recompute.state import ENGINE  # noqa: E402

from conftest import model_fingerprint  # noqa: E402
from model_patterns import PATTERNS, init_weights, mode_config  # noqa: E402
from steps import first_difference, run_steps  # noqa: E402

PATTERN = PATTERNS["batchnorm"]
FAIL_STEP = 1


class Injector:
    """Stands in for ``mlp.act`` (gelu) of layer 1; raises ``exc`` at ``where`` when armed."""

    def __init__(self, where, exc):
        self.where, self.exc, self.armed = where, exc, False

    def raise_it(self, *_):
        self.armed = False   # once: the model must train on afterwards
        raise self.exc("injected")

    def make(self):
        def act(x):
            if not self.armed:
                return ops.gelu(x)
            if self.where == "forward" and not mac.is_in_recompute():
                self.raise_it()
            if self.where == "recompute" and mac.is_in_recompute():
                self.raise_it()
            out = ops.gelu(x)
            if self.where == "backward" and not mac.is_in_recompute():
                out.register_hook(self.raise_it)
            return out
        return act


def train_with_failure(model, injector, steps=3):
    """``run_steps`` with the injected error armed in step ``FAIL_STEP``, which updates nothing and is
    left out of the history (forward-time writes such as BatchNorm's statistics stay).

    Returns (history, name of what was raised or None).
    """
    model.set_train(True)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history, raised = [], None
    for step in range(steps):
        injector.armed = step == FAIL_STEP
        try:
            loss, grads = grad_fn(*PATTERN.batch(step))
        except BaseException as exc:   # pylint: disable=broad-exception-caught  # what we test
            raised = type(exc).__name__
            _pynative_executor.clear_res()
            continue
        finally:
            injector.armed = False
        if step == FAIL_STEP:
            continue   # a twin without AC that did not fail (no recompute) drops this step too
        opt(grads)
        history.append((loss.asnumpy().tobytes(), [g.asnumpy().tobytes() for g in grads],
                        [(n, p.asnumpy().tobytes()) for n, p in model.parameters_and_names()]))
    return history, raised


def _with_injector(where, exc):
    model = PATTERN.build()
    injector = Injector(where, exc)
    model.layers[1].mlp.act = injector.make()
    return model, injector


def interrupt(modes):
    """Each mode's failures, one after the other in this process: ``{mode: [result, ...]}`` on stdout."""
    reference = run_steps(PATTERN.build(), PATTERN.batch, steps=1)   # this process, before any failure
    print(json.dumps({mode: interrupt_mode(mode, reference) for mode in modes}))


def interrupt_mode(mode, reference):
    wheres = ["forward", "backward"] + (["recompute"] if mode in ("full", "select_op") else [])
    results = []
    for exc in (RuntimeError, KeyboardInterrupt, SystemExit):
        for where in wheres:
            plain, plain_injector = _with_injector(where, exc)
            plain_history, _ = train_with_failure(plain, plain_injector)
            model, injector = _with_injector(where, exc)
            cells_before = model_fingerprint(model)[0]
            mac.apply_ac(model, config=mode_config(mode, PATTERN), layers=PATTERN.layers)
            history, raised = train_with_failure(model, injector)
            results.append({
                "exc": exc.__name__, "where": where, "raised": raised,
                "hook_active": bool(_pynative_executor.is_saved_tensor_hook_active()),
                "dispatch_depth": int(_DispatchGuardStack.depth()),
                "engine_clean": ENGINE.top() is None and not ENGINE.in_recompute(),
                "same_as_plain": first_difference(plain_history, history),
                "fresh_model_clean": first_difference(reference, run_steps(PATTERN.build(), PATTERN.batch,
                                                                           steps=1)) is None,
            })
            mac.remove_ac(model)
            results[-1]["removed_clean"] = model_fingerprint(model)[0] == cells_before
    return results


def divergence():
    """Layer 0 multiplies by ``gate``, an attribute its caller sets: tracked in forward, a constant after."""
    class Gated(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = mint.nn.Linear(8, 8)
            self.gate = Tensor(np.ones(8, np.float32))

        def construct(self, x):
            return ops.gelu(self.fc(x) * self.gate)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Gated(), Gated()])

        def construct(self, x, gate):
            layer = self.layers[0]
            layer.gate = gate                        # read from outside the region's arguments
            x = layer(x)
            layer.gate = Tensor(np.ones(8, np.float32))
            return (self.layers[1](x) ** 2).mean()

    net = init_weights(Net())
    mac.apply_ac(net, config={"recompute": {"mode": "full", "full_recompute_layer": [0]}})
    grad_fn = ms.value_and_grad(net, None, net.trainable_params())
    grad_fn(Tensor(np.ones((2, 8), np.float32)), Tensor(np.full(8, 0.5, np.float32)))


def kept_write_read_before():
    class Memory(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = mint.nn.Linear(8, 8)
            self.table = Parameter(Tensor(np.ones((1024, 8), np.float32)), name="table", requires_grad=False)
            self.update = ops.ScatterUpdate()

        def construct(self, x, slot):
            h = self.fc(x) * ops.gather(self.table, slot, 0)    # reads the table ...
            self.update(self.table, slot, ops.stop_gradient(h))  # ... then writes it
            return ops.gelu(h)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Memory(), Memory()])

        def construct(self, x, slot):
            for layer in self.layers:
                x = layer(x, slot)
            return (x ** 2).mean()

    net = init_weights(Net())
    mac.apply_ac(net, config={"recompute": {"mode": "full", "full_recompute_layer": [0]}})
    grad_fn = ms.value_and_grad(net, None, net.trainable_params())
    grad_fn(Tensor(np.ones((2, 8), np.float32)), Tensor(np.array([1, 3], np.int32)))


if __name__ == "__main__":
    {"interrupt": lambda: interrupt(sys.argv[2:]), "divergence": divergence,
     "kept_write_read_before": kept_write_read_before}[sys.argv[1]]()
