"""The meter sees through saved-tensor hooks a model installs itself, or says it can't.

The innermost saved-tensor hook wins: a model's own hooks (``Cell.register_saved_tensors_hooks`` on a
sub-cell, ``ms.saved_tensors_hooks`` inside ``construct``) used to hide everything packed under them from
``measure_step``. The meter now counts what their packed objects hold, so a hook that keeps the tensor (a
"swap" that moves nothing) measures exactly what the same model without the hook measures, per layer. A
hook whose packed object holds no tensor the meter can see (a host copy) is named in one warning.
"""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

import mindformers_ac as mac
from mindformers_ac.accounting import StepMeter
from mindformers_ac.meter import SavedTensorMeter

from model_patterns import Layer, PatternModel, hidden_batch, init_weights

N_LAYERS = 3


class Ticket:
    """A swap ticket that kept its tensor on the device: what a host backend does with nothing to move."""

    def __init__(self, tensor):
        self.tensor = tensor


def keep_pack(t):
    return Ticket(t)


def keep_unpack(ticket):
    return ticket.tensor


def host_pack(t):
    return t.asnumpy().copy()


def host_unpack(array):
    return Tensor(array)


class Hooked(nn.Cell):
    """Runs ``inner`` under ``ms.saved_tensors_hooks`` opened in its own construct."""

    def __init__(self, inner, pack, unpack):
        super().__init__()
        self.inner = inner
        self.pack, self.unpack = pack, unpack

    def construct(self, *args):
        with ms.saved_tensors_hooks(self.pack, self.unpack):
            return self.inner(*args)


def build(hooks=None, pack=keep_pack, unpack=keep_unpack):
    model = init_weights(PatternModel([Layer() for _ in range(N_LAYERS)]))
    for layer in model.layers:
        if hooks == "registered":
            layer.mlp.register_saved_tensors_hooks(pack, unpack)
            layer.mlp.set_grad(True)   # MindSpore runs a cell's registered hooks only on its slow path
        elif hooks == "in_construct":
            layer.attn = Hooked(layer.attn, pack, unpack)
    model.set_train(True)
    return model


def measure(model):
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    return mac.measure_step(model, grad_fn, *hidden_batch(0))


def per_layer(memory):
    return {k: lm.kept_bytes for k, lm in memory.layers.items()}


@pytest.fixture(scope="module")
def plain():
    return measure(build())


@pytest.mark.parametrize("hooks", ["registered", "in_construct"])
def test_hooks_that_keep_their_tensors_measure_what_the_model_without_them_does(plain, hooks, caplog):
    model = build(hooks)
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        memory = measure(model)
    assert per_layer(memory) == per_layer(plain)
    assert memory.kept_bytes == plain.kept_bytes > 0
    assert "measure_step" not in caplog.text
    hidden = SavedTensorMeter(model.trainable_params())   # the meter alone, without the per-layer split
    with hidden.hooks():
        ms.value_and_grad(model, None, model.trainable_params())(*hidden_batch(0))
    assert hidden.peak == plain.kept_bytes


def test_measuring_leaves_the_models_hooks_working_and_the_executor_as_it_was(plain):
    """The model's hooks still pack and unpack (gradients equal those of a step without the meter), and
    the executor's push is MindSpore's own again after the step."""
    from mindformers_ac.mindspore_compat import pynative_executor
    runs = []
    for metered in (False, True):
        calls = []

        def pack(t, calls=calls):
            calls.append("pack")
            return Ticket(t)

        def unpack(ticket, calls=calls):
            calls.append("unpack")
            return ticket.tensor

        model = build("registered", pack, unpack)
        grad_fn = ms.value_and_grad(model, None, model.trainable_params())
        grads = []

        def step(grad_fn=grad_fn, grads=grads):
            grads.extend(grad_fn(*hidden_batch(0))[1])

        if metered:
            assert mac.measure_step(model, step).kept_bytes == plain.kept_bytes
        else:
            step()
        runs.append((calls, grads))
    assert "push_saved_tensor_hook" not in vars(pynative_executor)
    (calls, grads), (metered_calls, metered_grads) = runs
    assert metered_calls == calls and calls.count("pack") == calls.count("unpack") > 0
    assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(grads, metered_grads))


@pytest.mark.parametrize("hooks, named", [
    ("registered", "cell 'layers.0.mlp' (MLP)"),
    ("in_construct", "cell 'layers.0.attn' (Hooked) at test_meter_foreign_hooks.py:"),
])
def test_a_hook_the_meter_cannot_see_into_is_named_once(plain, hooks, named, caplog):
    model = build(hooks, host_pack, host_unpack)
    meter = StepMeter(model)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        for step in range(2):
            with meter.step() as memory:
                grad_fn(*hidden_batch(step))
            if step == 0:
                first = memory
    assert f"measure_step: the saved-tensor hooks of {named}" in caplog.text, caplog.text
    assert "keep ndarray objects holding no tensor the meter can see" in caplog.text
    assert caplog.text.count("measure_step: ") == 1   # once per hook function and meter, not per step or layer
    assert first.kept_bytes < plain.kept_bytes   # a host copy is not on the device


def test_mindspores_own_recompute_is_named_and_its_backward_rerun_is_not_counted(plain, caplog):
    """``Cell.recompute(use_reentrant=False)`` packs placeholders (its inputs are held elsewhere, out of the
    meter's sight) and packs again in backward while its placeholder unpacks: only the warning says so,
    the step's gradients are unchanged, and the figure stays below the plain model's."""
    grads = []
    for metered in (False, True):
        model = build()
        for layer in model.layers:
            layer.mlp.recompute(use_reentrant=False)
        grad_fn = ms.value_and_grad(model, None, model.trainable_params())
        if not metered:
            grads.append(grad_fn(*hidden_batch(0))[1])
            continue
        with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
            memory = mac.measure_step(model, lambda fn=grad_fn: grads.append(fn(*hidden_batch(0))[1]))
    assert "saved-tensor hooks of cell 'layers.0.mlp' (MLP) (in MindSpore's code, its hook defined at" in caplog.text
    assert "keep _PlaceHolder objects" in caplog.text and caplog.text.count("measure_step: ") == 1
    assert 0 < memory.kept_bytes < plain.kept_bytes
    assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(*grads))
