"""Custom autograd functions (``_Function``: ctx, ``save_for_backward``, ctx attributes, class-level
state read in backward) inside recomputed and swapped layers stay bitwise equal to the model
without AC, alone and with several models stepping in one process in changing orders.

The functions and the MoE GPT that routes its aux loss through them are in
``custom_function_models.py``.
"""
import random

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import mindformers_ac as mac
from mindformers_ac.recompute.side_effects import RebindSlot
from mindformers_ac.swap import install_layer_swap

from custom_function_models import (
    FUNCTIONS,
    AttrAuxLossAutoScaler,
    AuxLossAutoScaler,
    ScaledSilu,
    build_function_moe,
    function_batch,
    reset_function_state,
)
from steps import assert_acted, first_difference, run_steps

pytestmark = pytest.mark.usefixtures("fresh_function_state")

CONFIGS = {
    "full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"]}},
    "select": {"recompute": {"mode": "select", "select_module": {r"mlp\.router": ["0-2"],
                                                                  r"mlp\.experts": ["0-2"]}}},
    "select_op": {"recompute": {"mode": "select",
                                "select_module": {r"mlp\.shared_experts\.activation_func": ["0-2"]}}},
    "layer_swap": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-2"]}]}},
    "op_swap": {"swap": {"enable": True, "op_swap": [{"op_name": "mlp", "layers": ["0-2"]}]}},
}
MODE_KIND = {"full": "full", "select": "select_cell", "select_op": "select_op", "layer_swap": "layer_swap",
             "op_swap": "op_swap"}


@pytest.fixture
def fresh_function_state():
    reset_function_state()
    yield
    reset_function_state()


def _with_ac(mode, scaler=AuxLossAutoScaler):
    model = build_function_moe(scaler)
    if mode is not None:
        mac.apply_ac(model, config=mac.AcConfig.from_dict(CONFIGS[mode]))
    return model


@pytest.mark.parametrize("scaler", [AuxLossAutoScaler, AttrAuxLossAutoScaler], ids=["saved", "ctx_attr"])
@pytest.mark.parametrize("mode", sorted(CONFIGS))
def test_functions_in_recomputed_and_swapped_layers_are_bitwise(mode, scaler):
    base = run_steps(_with_ac(None, scaler), function_batch, steps=3)
    calls = [fn.backward_calls for fn in FUNCTIONS]
    assert calls[FUNCTIONS.index(scaler)] == 3 * 4 and calls[FUNCTIONS.index(ScaledSilu)] > 0
    reset_function_state()
    model = _with_ac(mode, scaler)
    history = run_steps(model, function_batch, steps=3)
    diff = first_difference(base, history)
    assert diff is None, f"{mode}: {diff}"
    assert [fn.backward_calls for fn in FUNCTIONS] == calls   # each backward ran once per step, as without AC
    assert_acted(MODE_KIND[mode], model, None)


def test_the_aux_loss_reaches_the_router_only_through_the_scaler():
    """Control: the scaler's gradient is what trains the router against the load imbalance."""
    model = build_function_moe()
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    _, grads = grad_fn(*function_batch(0))
    AuxLossAutoScaler.set_loss_scale(0.0)    # in place: the aux loss's gradient is switched off
    _, grads_off = grad_fn(*function_batch(0))
    router = [i for i, p in enumerate(model.trainable_params()) if p.name.endswith("router.weight")]
    assert router and all(not np.array_equal(grads[i].asnumpy(), grads_off[i].asnumpy()) for i in router)


@pytest.mark.parametrize("mode", ["layer_swap", "op_swap"])
def test_global_aux_loss_counters_with_swap_are_bitwise(mode):
    """MindFormers' global aux loss updates two non-trainable Parameters in every router's forward
    (``+=``, which gives them new storage): swapped, they count once per step, as without swap."""
    base = run_steps(build_function_moe(global_aux=True), function_batch, steps=4)
    model = build_function_moe(global_aux=True)
    mac.apply_ac(model, config=mac.AcConfig.from_dict(CONFIGS[mode]))
    diff = first_difference(base, run_steps(model, function_batch, steps=4))
    assert diff is None, f"{mode}: {diff}"
    assert float(model.decoder.layers[0].mlp.router.ga_steps.asnumpy()) == 4
    assert_acted(MODE_KIND[mode], model, None)


@pytest.mark.parametrize("mode", ["full", "select"])
def test_global_aux_loss_counters_under_recompute_are_bitwise(mode):
    """``self.ga_steps += 1`` gives the Parameter the sum's storage (``set_data``, no op writes): the
    re-run starts from the value before its forward and the counters advance once per step, on the
    intercepting path (step 0) and the light path (later steps) alike."""
    base = run_steps(build_function_moe(global_aux=True), function_batch, steps=4)
    model = build_function_moe(global_aux=True)
    mac.apply_ac(model, config=mac.AcConfig.from_dict(CONFIGS[mode]))
    diff = first_difference(base, run_steps(model, function_batch, steps=4))
    assert diff is None, f"{mode}: {diff}"
    router = model.decoder.layers[0].mlp.router
    assert float(router.ga_steps.asnumpy()) == 4
    assert isinstance(vars(router.ga_steps).get("set_data"), RebindSlot)   # put there once by the wrapper
    stats = list(mac.ac_state(model).recompute_stats.values())
    assert all(s.light_calls > 0 and s.recompute_calls == s.light_calls + s.intercepted_calls for s in stats)
    mac.remove_ac(model)
    assert "set_data" not in vars(router.ga_steps)   # and taken off with it


def _orders(num_models, steps, seed=0):
    """Per step, the order the models step in: in turn, then pairs of one model twice in a row (the
    reported case: 100 plain first, 101 swapped first, 102 plain first), then shuffled."""
    rng = random.Random(seed)
    ids = list(range(num_models))
    for step in range(steps):
        if step < steps // 4:
            yield ids[step % num_models:] + ids[:step % num_models]
        elif step < steps // 2:
            yield ids if (step // 2) % 2 == 0 else ids[::-1]
        else:
            order = ids[:]
            rng.shuffle(order)
            yield order


def _trainer(model):
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    return opt, ms.value_and_grad(model, None, opt.parameters)


def _step_in_orders(models, labels, steps):
    """Train ``models`` in one process in the orders of ``_orders``; after each step every model's
    loss, gradients and parameters must equal ``models[0]``'s (plain)."""
    trainers = [_trainer(m) for m in models]
    names = [p.name for p in models[0].trainable_params()]
    for step, order in enumerate(_orders(len(models), steps)):
        batch = function_batch(step)
        seen = {}
        for i in order:
            opt, grad_fn = trainers[i]
            loss, grads = grad_fn(*batch)
            opt(grads)
            seen[i] = (loss.asnumpy().tobytes(), [g.asnumpy().tobytes() for g in grads],
                       [p.asnumpy().tobytes() for p in models[i].get_parameters()])
        base = seen[0]
        for i, label in enumerate(labels[1:], 1):
            loss, grads, params = seen[i]
            assert loss == base[0], f"step {step} (order {order}): {label} loss differs"
            bad = [names[k] for k, (a, b) in enumerate(zip(base[1], grads)) if a != b]
            assert not bad, f"step {step} (order {order}): {label} gradients differ: {bad[:3]}"
            assert params == base[2], f"step {step} (order {order}): {label} parameters differ"


def test_function_state_and_saved_tensors_offloaded_too():
    """With no size threshold every saved tensor of the swapped layers goes to host, the 0-d aux
    losses the scalers save included; two such models and a plain one share the functions'
    class-level state and stay bitwise in changing orders."""
    models = [build_function_moe()]
    installs = []
    for _ in range(2):
        model = build_function_moe()
        installs.append(install_layer_swap(model.decoder.layers, [0, 1, 2], model=model, min_bytes=0))
        models.append(model)
    _step_in_orders(models, ["plain", "swap a", "swap b"], steps=12)
    for inst in installs:
        stats = inst.report.layers
        assert all(stats[i].num_offloaded > 0 and not stats[i].kept_reasons.get("small") for i in (0, 1, 2))
        inst.remove()


@pytest.mark.slow
def test_models_stepping_in_changing_orders_stay_bitwise():
    """A plain model and a layer-swapped one (the reported case) share the functions' class-level
    state and step in one process, in turn, twice in a row and shuffled, 30 steps: every step's
    loss, every gradient and every parameter of each equals the plain model's. (Recompute, op swap
    and a third model are covered by the tests above, over fewer steps.)"""
    modes = [None, "layer_swap"]
    models = [_with_ac(mode) for mode in modes]
    _step_in_orders(models, modes, steps=30)
    for model, mode in zip(models[1:], modes[1:]):
        assert_acted(MODE_KIND[mode], model, None)
    assert AuxLossAutoScaler.backward_calls == 30 * len(models) * 4
