"""The reference MoE GPT in one process (ep=1): routing, capacity drops, aux loss, and routing under recompute.

The matrix of AC modes on the MoE model is in test_model_patterns.py (pattern ``moe``); the
expert-parallel runs under msrun are in test_ep.py.
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import mindformers_ac as mac
from mindformers_ac.accounting import ENGINE_REGIONS
from mindformers_ac.harness.models import synthetic_batch
from mindformers_ac.harness.moe import build_moe_gpt, check_moe_config, moe_config
from mindformers_ac.recompute import is_in_recompute
from mindformers_ac.whitelist import get_single_layer_whitelist

from steps import run_steps

DIMS = dict(num_layers=2, hidden_size=16, num_heads=2, seq_length=8, vocab_size=24, dropout=0.1, num_experts=4,
            top_k=2, capacity_factor=0.5)
BATCH = 4


def _batch(step):
    return synthetic_batch(BATCH, DIMS["seq_length"], DIMS["vocab_size"], seed=step)


def _train(model, steps=2, config=None):
    """``run_steps`` (loss, gradients and parameters per step), after applying ``config`` if given."""
    if config is not None:
        mac.apply_ac(model, config=config)
    return run_steps(model, _batch, steps)


def test_layout_names_and_moe_layer_frequency():
    model = build_moe_gpt(**{**DIMS, "num_layers": 4, "moe_layer_freq": 2})
    assert [layer.is_moe_layer for layer in model.decoder.layers] == [True, False, True, False]
    paths = get_single_layer_whitelist(model.decoder.layers[0])
    for path in ("mlp.router", "mlp.experts.local_experts.3.linear_fc1", "mlp.experts.local_experts.0.linear_fc2",
                 "mlp.shared_experts", "mlp.token_dispatcher.dispatch_all_to_all",
                 "mlp.token_dispatcher.combine_all_to_all"):
        assert path in paths
    assert "mlp.router" not in get_single_layer_whitelist(model.decoder.layers[1])
    names = {p.name for p in model.trainable_params()}
    assert "decoder.layers.0.mlp.router.weight" in names
    assert "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_reaches_the_loss_and_capacity_drops_tokens(score_func):
    dims = {**DIMS, "dropout": 0.0, "score_func": score_func}
    tokens, labels = _batch(0)
    with_aux = build_moe_gpt(**dims)
    without = build_moe_gpt(**dims, aux_loss_coeff=0.0)
    grads = ms.grad(with_aux, grad_position=None, weights=with_aux.trainable_params())(tokens, labels)
    grads_plain = ms.grad(without, grad_position=None, weights=without.trainable_params())(tokens, labels)
    router = [i for i, p in enumerate(with_aux.trainable_params()) if p.name.endswith("router.weight")]
    assert float(with_aux(tokens, labels).asnumpy()) > float(without(tokens, labels).asnumpy())
    assert any(not np.array_equal(grads[i].asnumpy(), grads_plain[i].asnumpy()) for i in router)
    # capacity 0.5 of an even share: at most half of the top-2 choices fit
    mlp = with_aux.decoder.layers[0].mlp
    x = Tensor(np.random.RandomState(0).randn(BATCH * DIMS["seq_length"], DIMS["hidden_size"]).astype(np.float32))
    weights, indices, _ = mlp.router(x)
    dispatch, combine = mlp.token_dispatcher.routing_masks(weights, indices)
    t = x.shape[0]
    capacity = mlp.token_dispatcher.capacity(t)
    assert capacity == t * 2 // 4 // 2
    d = dispatch.asnumpy().reshape(t, 4, capacity)
    assert d.sum() == 4 * capacity < t * 2          # every slot filled, the rest dropped
    assert d.sum(0).max() == 1                      # one token per slot
    assert set(np.unique(d.sum((1, 2)))) <= {0, 1, 2}
    if score_func == "sigmoid":   # renormalised over the k chosen
        np.testing.assert_allclose(weights.asnumpy().sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("field, value, message", [
    ("top_k", 5, "top_k: must be in"), ("capacity_factor", 0.0, "capacity_factor: must be > 0"),
    ("moe_layer_freq", 0, "moe_layer_freq: must be"), ("score_func", "relu", "score_func: must be")])
def test_bad_moe_settings_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        check_moe_config(moe_config(**{field: value}))
    with pytest.raises(ValueError, match="ep: 3 must divide num_experts 4"):
        check_moe_config(moe_config(), ep=3)


def _near_tied(model):
    """Router rows 0-2 equal up to ~1e-7: every token's top-2 is a near tie among three experts."""
    rng = np.random.RandomState(3)
    for layer in model.decoder.layers:
        base = rng.randn(DIMS["hidden_size"]).astype(np.float32)
        rows = [base * np.float32(1 + k * 1e-7) for k in range(3)] + [-base]
        layer.mlp.router.weight.set_data(Tensor(np.stack(rows)))
    return model


def _trace_routing(model):
    """Record (layer, in recompute, indices, weights, dispatch, combine) of every routing decision."""
    records = []
    for layer in model.decoder.layers:
        dispatcher = layer.mlp.token_dispatcher
        original = dispatcher.routing_masks

        def traced(weights, indices, original=original, layer_id=layer.layer_number):
            dispatch, combine = original(weights, indices)
            records.append((layer_id, is_in_recompute(), indices.asnumpy().copy(), weights.asnumpy().copy(),
                            dispatch.asnumpy().copy(), combine.asnumpy().copy()))
            return dispatch, combine
        object.__setattr__(dispatcher, "routing_masks", traced)
    return records


@pytest.mark.parametrize("jitter", ["none", "replayed", "kept"])
def test_recompute_routes_near_tied_tokens_as_forward_did(jitter):
    dims = dict(DIMS, router_jitter=0.0 if jitter == "none" else 0.01, jitter_replayable=jitter != "kept")
    base = _train(_near_tied(build_moe_gpt(**dims)))
    model = _near_tied(build_moe_gpt(**dims))
    records = _trace_routing(model)
    history = _train(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-1"]}})
    assert history == base   # bitwise: loss, every gradient and every parameter
    forward = [r for r in records if not r[1]]
    again = [r for r in records if r[1]]
    assert len(forward) == len(again) == 2 * 2   # 2 layers x 2 steps, each recomputed once

    def by_step_and_layer(rs):   # backward recomputes the layers in reverse order
        return {(i // 2, r[0]): r[2:] for i, r in enumerate(rs)}
    forward_routes, recomputed_routes = by_step_and_layer(forward), by_step_and_layer(again)
    assert forward_routes.keys() == recomputed_routes.keys()
    for key, routes in forward_routes.items():
        for a, b in zip(routes, recomputed_routes[key]):   # experts, weights, drops, combine weights
            assert np.array_equal(a, b), key
    # the ties are real: every token's top-2 boundary falls among experts 0-2, whose scores differ by
    # rounding only, and which of them wins changes from token to token; tokens were dropped
    for _, _, indices, _, dispatch, _ in forward:
        assert all(len(set(row) & {0, 1, 2}) in (1, 2) for row in indices.tolist())
        assert len({0, 1, 2} & set(indices.ravel().tolist())) >= 2
        assert dispatch.sum() < indices.size
    rerun = {}
    for stats in mac.ac_state(model).recompute_stats.values():
        for op, n in stats.rerun_by_op.items():
            rerun[op] = rerun.get(op, 0) + n
    assert rerun["TopK"] == 2 * 2
    # replayed: re-run every step; kept (not marked replayable): kept on the first, checking call, which
    # measures that the fresh seeded primitive draws again bitwise, so the light calls after it re-run it
    assert rerun.get("UniformReal", 0) == {"replayed": 2 * 2, "kept": 2, "none": 0}[jitter]


# -- command line: --moe, --ep and the MoE flags ---------------------------------------------------------

MOE_FACTORY = "mindformers_ac.harness.moe:reference_moe_model"
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--batch", "2"]


@pytest.mark.parametrize("flags, named", [
    (["--moe", "--ep", "3"], "--ep: 3 must divide num_experts 4"),
    (["--moe", "--top-k", "5"], "--top-k: must be in [1, num_experts=4], got 5"),
    (["--moe", "--num-experts", "2", "--top-k", "3"], "--top-k: must be in [1, num_experts=2], got 3"),
    (["--moe", "--capacity-factor", "0"], "--capacity-factor: must be > 0, got 0.0"),
    (["--moe", "--capacity-factor", "-1.5"], "--capacity-factor: must be > 0, got -1.5"),
    (["--moe", "--moe-layer-freq", "0"], "--moe-layer-freq: must be >= 1"),
    (["--top-k", "1"], "--top-k: applies to the MoE model only; add --moe"),
    (["--ep", "2"], "--ep: expert parallelism needs the MoE model; add --moe"),
    (["--moe", "--tp", "2"], "--tp: tensor parallel trains the dense reference GPT"),
])
def test_bad_moe_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, named):
    from mindformers_ac.harness.cli import main
    config = tmp_path / "full.yaml"
    config.write_text("recompute:\n  mode: full\n  full_recompute_layer: [0-1]\n")
    assert main(["train", str(config), *SMALL, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}"), err


def test_ep_that_does_not_divide_the_ranks_exits_2(tmp_path, capsys, monkeypatch):
    """Checked from msrun's MS_WORKER_NUM before communication init (a rank that fails there would make
    msrun wait for its cluster timeout)."""
    from mindformers_ac.harness.cli import main
    config = tmp_path / "full.yaml"
    config.write_text("recompute:\n  mode: full\n  full_recompute_layer: [0-1]\n")
    monkeypatch.setenv("MS_WORKER_NUM", "3")
    assert main(["train", str(config), *SMALL, "--moe", "--ep", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --ep: 2 does not divide the number of ranks 3")
    monkeypatch.setenv("MS_WORKER_NUM", "4")
    assert main(["train", str(config), *SMALL, "--moe", "--ep", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --ep: 2 but the job has 4 ranks")


def test_explain_on_the_moe_factory(tmp_path, capsys):
    from mindformers_ac.harness.cli import main
    config = tmp_path / "moe.yaml"
    config.write_text("recompute:\n  mode: select\n  select_module:\n    '.*router': [0-7]\n"
                      "recompute_comm:\n  enable: true\n  select_module:\n    '.*all_to_all': [0-7]\n")
    assert main(["explain", str(config), "--model", MOE_FACTORY]) == 0
    out = capsys.readouterr().out
    assert "mlp.router" in out and "mlp.token_dispatcher.dispatch_all_to_all" in out


@pytest.mark.slow
def test_train_on_the_moe_factory_and_with_moe(tmp_path, capsys):
    """Both runs of each ``train`` are subprocesses."""
    from mindformers_ac.harness.cli import main
    config = tmp_path / "moe.yaml"
    config.write_text("recompute:\n  mode: select\n  select_module:\n    '.*router': [0-7]\n"
                      "recompute_comm:\n  enable: true\n  select_module:\n    '.*all_to_all': [0-7]\n")
    assert main(["train", str(config), "--model", MOE_FACTORY, "--steps", "2", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal in every step: yes" in out
    config.write_text("recompute:\n  mode: full\n  full_recompute_layer: [0-1]\n  exclude_op: [AllToAll]\n")
    assert main(["train", str(config), *SMALL, "--moe", "--top-k", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "AllToAll" in out and "bitwise equal in every step: yes" in out


@pytest.mark.slow
def test_plan_on_the_moe_model(tmp_path, capsys):
    from mindformers_ac.config import AcConfig
    from mindformers_ac.harness.cli import main
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--budget", "0.3x", *SMALL, "--moe", "--top-k", "1", "--profile-steps", "1",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "reference MoE GPT: 2 layers" in text and f"wrote {out}" in text
    config = AcConfig.from_yaml(str(out))
    assert config.recompute.enabled or config.swap.enable


def test_comm_output_recompute_reports_what_the_layer_still_keeps():
    """recompute_comm's hooks hide the outer meter: the layer's kept bytes must still be everything it
    saved except the all-to-all outputs it dropped (counted as recomputed)."""
    from mindformers_ac.training import TrainingRun
    batch = _batch(0)
    dims = dict(DIMS, dropout=0.0, capacity_factor=1.0)
    layers = []
    for config in (None, {"recompute_comm": {"enable": True, "select_module": {".*all_to_all": ["0-1"]}}}):
        run = TrainingRun(build_moe_gpt(**dims), config)
        layers.append(run.step(batch)[2].as_dict()["layers"])
    base, comm = layers
    t, h, e = BATCH * DIMS["seq_length"], DIMS["hidden_size"], DIMS["num_experts"]
    buffers = 2 * (e * (t * 2 // e) * h * 4)   # the dispatched and the returned (E * C, h) float32 buffers
    for layer in ("0", "1"):
        assert comm[layer]["recomputed_bytes"] == buffers
        assert comm[layer]["kept_bytes"] == base[layer]["kept_bytes"] - buffers
    assert comm["other"] == base["other"]


@pytest.mark.parametrize("mode, expected", [
    (None, {"mlp", "mlp.router", "mlp.experts", "mlp.shared_experts"}),
    ({"recompute": {"mode": "select", "select_module": {r"mlp\.experts": ["0-1"]}}},
     {"mlp", "mlp.router", "mlp.shared_experts"}),   # the experts' inputs are the dispatcher's, counted there
    ({"recompute": {"mode": "full", "full_recompute_layer": ["0-1"]}}, {ENGINE_REGIONS}),
    ({"swap": {"enable": True, "layer_swap": [{"layers": [0]}]}}, None),
])
def test_the_per_layer_report_says_what_each_mode_keeps_on_a_moe_layer(mode, expected):
    """Kept bytes split by module: router outputs (``mlp.router``), expert activations (``mlp.experts``),
    the dispatcher's buffers (``mlp``: its methods run in the MoE block's own construct), and what the
    recompute regions and swap keep; the parts add up to the layer's kept bytes."""
    model = build_moe_gpt(**dict(DIMS, dropout=0.0))
    if mode is not None:
        mac.apply_ac(model, config=mode)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    memory = mac.measure_step(model, grad_fn, *_batch(0))
    for lm in memory.layers.values():
        assert sum(lm.kept_by_module.values()) == lm.kept_bytes
    layer0 = memory.layers[0].kept_by_module
    if expected is None:   # layer swap: nothing of layer 0's MLP stays on the device
        assert not any(path.startswith("mlp") for path in layer0)
        assert memory.layers[0].offloaded_bytes > 0
        return
    assert expected <= set(layer0), layer0
    if mode is not None and "full" in str(mode):
        assert set(layer0) == {ENGINE_REGIONS}   # a fully recomputed layer keeps its inputs only
    if mode is not None and "experts" in str(mode):
        assert "mlp.experts" not in layer0   # the experts' activations are recomputed
