"""apply_ac end to end: exact gradients for every mode, counts, bytes, safety, removal."""
import gc
import logging
import types

import mindspore as ms
import pytest
from mindspore import nn, ops

import mindformers_ac as mac
from mindformers_ac.accounting import StepMeter, measure_step
from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.meter import SavedTensorMeter

from conftest import model_fingerprint

LAYERS, HIDDEN, SEQ, BATCH, VOCAB = 4, 32, 16, 2, 64


class StandInAllGather(nn.Cell):
    """Identity with a custom bprop: a single-process stand-in for a collective."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def construct(self, x):
        self.calls += 1
        return ops.mul(x, 1.0)

    def bprop(self, x, out, dout):
        return (dout,)


def _comm_mlp_construct(self, x):
    return self.linear_fc2(self.activation_func(self.linear_fc1(self._comm_ops["all_gather"](x))))


def make_model(comm=False, dropout=0.1):
    model = build_gpt(num_layers=LAYERS, hidden_size=HIDDEN, num_heads=2, seq_length=SEQ,
                      vocab_size=VOCAB, dropout=dropout, seed=3)
    if comm:
        for layer in model.decoder.layers:
            layer.mlp._comm_ops = {"all_gather": StandInAllGather()}
            layer.mlp.construct = types.MethodType(_comm_mlp_construct, layer.mlp)
    return model


def train(model, steps=3):
    """Per-step loss bytes and gradient bytes after an SGD update each step."""
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(model, None, optimizer.parameters)
    history = []
    for step in range(steps):
        tokens, labels = synthetic_batch(BATCH, SEQ, VOCAB, seed=step)
        loss, grads = grad_fn(tokens, labels)
        optimizer(grads)
        history.append((loss.asnumpy().tobytes(), tuple(g.asnumpy().tobytes() for g in grads)))
    return history


@pytest.fixture(scope="module")
def baseline():
    return train(make_model())


@pytest.fixture(scope="module")
def comm_baseline():
    return train(make_model(comm=True))


MODES = {
    "full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-3"]}},
    "select_mlp": {"recompute": {"mode": "select", "select_module": {".*mlp": ["0-3"]}}},
    "select_core_attention": {"recompute": {"mode": "select", "select_module": {".*core_attention": ["0-3"]}}},
    "select_op_output": {"recompute": {"mode": "select",
                                       "select_module": {r"mlp\.activation_func": ["0-3"],
                                                         r".*\.softmax": [1]}}},
    "select_plus_full": {"recompute": {"mode": "select", "full_recompute_layer": [0],
                                       "select_module": {".*attention": ["1-2"], ".*mlp": [3]}}},
    "full_exclude_names": {"recompute": {"mode": "full", "full_recompute_layer": ["0-3"],
                                         "exclude_op": ["MatMul"]}},
    "full_exclude_paths": {"recompute": {"mode": "full", "full_recompute_layer": ["0-3"],
                                         "exclude_op": {r".*core_attention": ["0-1"], r"mlp\.linear_fc1": [2]}}},
    "layer_swap": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-2"]}]}},
    "layer_swap_prefetch2": {"swap": {"enable": True, "default_prefetch": 2, "layer_swap": [{"layers": ["0-1"]}]}},
    "op_swap": {"swap": {"enable": True, "op_swap": [{"op_name": ".*mlp", "layers": ["0-2"]}]}},
    "recompute_and_swap": {"recompute": {"mode": "full", "full_recompute_layer": [0, 3]},
                           "swap": {"enable": True, "layer_swap": [{"layers": ["1-2"]}]}},
    "select_and_op_swap_same_layer": {"recompute": {"mode": "select", "select_module": {".*core_attention": [1]}},
                                      "swap": {"enable": True, "op_swap": [{"op_name": "mlp", "layers": [1]}]}},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_gradients_bitwise_equal_with_dropout(baseline, mode):
    model = make_model()
    mac.apply_ac(model, config=MODES[mode])
    assert train(model) == baseline


def test_comm_recompute_bitwise_equal_and_reruns_only_the_collective(comm_baseline):
    model = make_model(comm=True)
    plan = mac.apply_ac(model, config={"recompute_comm": {"enable": True,
                                                          "select_module": {r".*\.all_gather": ["0-1"]}}})
    assert plan.layers[0].recompute_comm == ("mlp.all_gather",)
    assert train(model) == comm_baseline
    calls = [layer.mlp._comm_ops["all_gather"].calls for layer in model.decoder.layers]
    assert calls == [6, 6, 3, 3]  # 3 steps: forward + re-run in layers 0-1, forward only in 2-3
    stats = mac.ac_state(model).recompute_stats
    assert stats[0].ops_rerun >= 1 and stats[0].recompute_calls >= 1


def test_full_recompute_with_exclude_keeps_collective_outputs(comm_baseline):
    model = make_model(comm=True)
    mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-3"],
                                              "exclude_op": ["Mul"]}})
    assert train(model) == comm_baseline


def _one_step_stats(config):
    model = make_model()
    mac.apply_ac(model, config=config)
    tokens, labels = synthetic_batch(BATCH, SEQ, VOCAB)
    memory = measure_step(model, ms.value_and_grad(model, None, model.trainable_params()), tokens, labels)
    return model, memory, mac.ac_state(model).recompute_stats


def test_exclude_op_keeps_matmul_outputs_and_cuts_reruns():
    _, _, plain = _one_step_stats(MODES["full"])
    _, _, excluded = _one_step_stats(MODES["full_exclude_names"])
    matmuls = sum(n for name, n in plain[0].rerun_by_op.items() if "matmul" in name.lower())
    assert matmuls > 0
    assert excluded[0].ops_rerun == plain[0].ops_rerun - matmuls
    assert not any("matmul" in name.lower() for name in excluded[0].rerun_by_op)
    assert excluded[0].kept_bytes > plain[0].kept_bytes


def test_full_recompute_keeps_only_the_layer_inputs():
    _, memory, stats = _one_step_stats(MODES["full"])
    layer_input = BATCH * SEQ * HIDDEN * 4 + SEQ * SEQ * 4   # hidden states and the attention mask
    for i in range(LAYERS):
        assert stats[i].kept_bytes <= 1.1 * layer_input
        assert memory.layers[i].kept_bytes == stats[i].kept_bytes
        assert stats[i].ops_rerun > 10


def test_accounting_matches_an_independent_meter_on_the_baseline():
    model = make_model()
    tokens, labels = synthetic_batch(BATCH, SEQ, VOCAB)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    memory = measure_step(model, grad_fn, tokens, labels)
    meter = SavedTensorMeter(model.trainable_params())
    with meter.hooks():
        grad_fn(tokens, labels)
    assert memory.kept_bytes == meter.peak > 0
    assert len({memory.layers[i].kept_bytes for i in range(LAYERS)}) == 1


def test_kept_bytes_ordering_full_select_baseline():
    figures = {}
    for name in ("full", "select_mlp", "layer_swap"):
        _, memory, _ = _one_step_stats(MODES[name])
        figures[name] = memory
    model = make_model()
    tokens, labels = synthetic_batch(BATCH, SEQ, VOCAB)
    plain = measure_step(model, ms.value_and_grad(model, None, model.trainable_params()), tokens, labels)
    assert figures["full"].kept_bytes < figures["select_mlp"].kept_bytes < plain.kept_bytes
    for i in range(3):   # swapped layers keep at most 5% of their baseline bytes on the device
        assert figures["layer_swap"].layers[i].kept_bytes <= 0.05 * plain.layers[i].kept_bytes
        assert figures["layer_swap"].layers[i].offloaded_bytes > 0.9 * plain.layers[i].kept_bytes


@pytest.mark.slow
def test_no_growth_over_fifty_steps():
    from mindformers_ac.recompute.region import Region
    model = make_model()
    mac.apply_ac(model, config={"recompute": {"mode": "select", "full_recompute_layer": [0],
                                              "select_module": {".*mlp": ["1-3"]}}})
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    meter = StepMeter(model)
    tokens, labels = synthetic_batch(BATCH, SEQ, VOCAB)
    gc.collect()
    before = sum(type(o) is Region for o in gc.get_objects())   # another test's, when run after it in this process
    kept, live = [], []
    for _ in range(50):
        with meter.step() as memory:
            grad_fn(tokens, labels)
        gc.collect()
        kept.append(memory.kept_bytes)
        live.append(sum(type(o) is Region for o in gc.get_objects()) - before)
    assert len(set(kept[5:])) == 1
    assert max(live[5:]) == live[5] == 0


def test_apply_twice_is_an_error_and_remove_restores_the_model(caplog):
    model = make_model()
    before = model_fingerprint(model)
    names = [p.name for p in model.get_parameters()]
    with caplog.at_level(logging.DEBUG, logger="mindformers_ac"):   # per-layer detail is debug level
        mac.apply_ac(model, config=MODES["recompute_and_swap"])
    assert "Set full recompute at layer 0" in caplog.text
    assert "Set layer swap at layer 1, prefetched when layer 2 starts backward" in caplog.text
    assert [p.name for p in model.get_parameters()] == names
    with pytest.raises(mac.ConfigError, match="^model: apply_ac was already applied"):
        mac.apply_ac(model, config=MODES["full"])
    mac.remove_ac(model)
    assert model_fingerprint(model) == before
    mac.apply_ac(model, config=MODES["full"])   # a fresh apply after removal works
    mac.remove_ac(model)
    with pytest.raises(mac.ConfigError, match="was not applied"):
        mac.remove_ac(model)


def test_rejected_config_leaves_the_model_untouched():
    model = make_model()
    before = model_fingerprint(model)
    bad = {"recompute": {"mode": "full", "full_recompute_layer": [0, 1]},
           "swap": {"enable": True, "layer_swap": [{"layers": [1]}]}}
    with pytest.raises(mac.ConfigError, match=r"^swap\.layer_swap\[0\]\.layers: layer 1 overlaps full recompute"):
        mac.apply_ac(model, config=bad)
    assert model_fingerprint(model) == before and mac.ac_state(model) is None


def test_failure_while_installing_rolls_back(monkeypatch):
    import mindformers_ac.actions.layer_swap as layer_swap_module
    model = make_model()
    before = model_fingerprint(model)

    def broken(*args, **kwargs):
        raise RuntimeError("installer failed")
    monkeypatch.setattr(layer_swap_module, "install_layer_swap", broken)
    with pytest.raises(RuntimeError, match="installer failed"):
        mac.apply_ac(model, config=MODES["recompute_and_swap"])
    assert model_fingerprint(model) == before and mac.ac_state(model) is None


def test_is_in_recompute_only_during_backward_rerun():
    seen = []
    model = make_model(dropout=0.0)
    layer = model.decoder.layers[0]
    original = layer.mlp.activation_func
    layer.mlp.activation_func = lambda x: (seen.append(mac.is_in_recompute()), original(x))[1]
    mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": [0]}})
    tokens, labels = synthetic_batch(BATCH, SEQ, VOCAB)
    ms.value_and_grad(model, None, model.trainable_params())(tokens, labels)
    assert seen == [False, True] and not mac.is_in_recompute()


class _StridedAllGather(nn.Cell):
    """No custom bprop: one would save the output itself for its bprop, which output recompute drops."""

    def construct(self, x):
        return ops.mul(x.swapaxes(0, 1), 1.0).swapaxes(0, 1)   # a strided view: consumers copy it


def test_output_recompute_that_drops_nothing_says_why(caplog):
    model = make_model(comm=True)
    for layer in model.decoder.layers:
        layer.mlp._comm_ops["all_gather"] = _StridedAllGather()
    mac.apply_ac(model, config={"recompute_comm": {"enable": True, "select_module": {r".*\.all_gather": [0]}}})
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        train(model, steps=1)
    assert "output recompute of MLP.all_gather saves nothing" in caplog.text
    assert "return a contiguous tensor" in caplog.text
    assert mac.ac_state(model).recompute_stats[0].ops_rerun == 0
