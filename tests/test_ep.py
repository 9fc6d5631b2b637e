"""Expert parallelism (2 ranks under msrun) on the reference MoE GPT: AC configs bitwise, all-to-all re-runs
counted per op, equivalence with the single-process model, and ``train --moe --ep`` end to end.

One msrun job (``scripts/ep_worker.py``) trains every config below against one shared run without AC, and
checks the equivalence: msrun and communication init cost more than the runs on 2 cores. The model: 4
layers, MoE in layers 0 and 2 (dense layers 1 and 3), 4 experts (2 per rank), top-2, capacity factor 1,
router jitter 0.05, dropout 0.1.
"""
import json
import os

import pytest
from test_tp import ENV, ROOT, _cli, _tail

from mindformers_ac.harness.launch import launch_msrun

WORKER = os.path.join(ROOT, "scripts", "ep_worker.py")
MOE_LAYERS = 2   # layers 0 and 2

# name -> (config, collectives re-run in backward per step, named as the engine counts them)
CONFIGS = {
    "full": ("recompute:\n  mode: full\n  full_recompute_layer: [0-3]\n", {"AllToAll": 2 * MOE_LAYERS}),
    "full_exclude_alltoall": ("recompute:\n  mode: full\n  full_recompute_layer: [0-3]\n  exclude_op: [AllToAll]\n",
                              {}),
    "select_experts": ("recompute:\n  mode: select\n  select_module:\n    '.*experts': [0-3]\n", {}),
    "select_router": ("recompute:\n  mode: select\n  select_module:\n    '.*router': [0-3]\n", {}),
    "select_shared_experts": ("recompute:\n  mode: select\n  select_module:\n    '.*shared_experts': [0-3]\n", {}),
    "recompute_comm": ("recompute_comm:\n  enable: true\n  select_module:\n    '.*all_to_all': [0-3]\n",
                       {"MoEAlltoAllTokenDispatcher.dispatch_all_to_all": MOE_LAYERS,
                        "MoEAlltoAllTokenDispatcher.combine_all_to_all": MOE_LAYERS}),
    "layer_swap": ("swap:\n  enable: true\n  layer_swap:\n    - layers: [0, 2]\n", {}),
    # layer 0 full without its all-to-alls, layer 1 swapped, layer 2: shared expert recomputed, all-to-alls
    # re-run (not '.*experts' there: that region keeps its inputs, the dispatch all-to-all's outputs)
    "mixed": ("recompute:\n  mode: select\n  full_recompute_layer: [0]\n  select_module:\n"
              "    '.*shared_experts': [2]\n"
              "  exclude_op: [AllToAll]\nrecompute_comm:\n  enable: true\n  select_module:\n"
              "    '.*all_to_all': [2]\nswap:\n  enable: true\n  layer_swap:\n    - layers: [1]\n",
              {"MoEAlltoAllTokenDispatcher.dispatch_all_to_all": 1,
               "MoEAlltoAllTokenDispatcher.combine_all_to_all": 1}),
}


@pytest.fixture(scope="module")
def ep_job(tmp_path_factory):
    """One 2-rank job: every config of ``CONFIGS`` and the equivalence check; returns the output dir."""
    tmp = tmp_path_factory.mktemp("ep")
    argv = [WORKER, "--out", str(tmp / "out"), "--equivalence", "--layers", "4", "--moe-layer-freq", "2"]
    for name, (text, _) in CONFIGS.items():
        (tmp / f"{name}.yaml").write_text(text)
        argv += ["--config", f"{name}={tmp / f'{name}.yaml'}"]
    res = launch_msrun(argv, nproc=2, timeout_s=600, log_dir=tmp / "logs", env=ENV)
    assert res.returncode == 0, _tail(res)
    return tmp / "out"


def _results(out, name):
    return [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(2)]


def _check_config(out, name):
    expected_rerun = CONFIGS[name][1]
    for rank, result in enumerate(_results(out, name)):
        s = result["summary"]
        assert s["verdict"] == "equal", (rank, s["first_difference"])
        assert s["losses_match_bitwise"] and s["grads_match_bitwise"] and s["params_match_bitwise"]
        collectives = s["collectives_per_step"]
        assert collectives["baseline"]["forward"] == {"AllToAll": 2 * MOE_LAYERS}
        assert collectives["baseline"]["backward"] == {"AllToAll": 2 * MOE_LAYERS}
        assert collectives["ac"]["forward"] == collectives["baseline"]["forward"]
        assert collectives["ac"]["backward"] == collectives["baseline"]["backward"]
        assert collectives["baseline"]["rerun_in_backward"] == {}
        assert collectives["ac"]["rerun_in_backward"] == expected_rerun, rank
    return _results(out, name)


def _ops_rerun(result, layer):
    return next(row["ops_rerun"] for row in result["layers"] if row["layer"] == str(layer))


@pytest.mark.slow
def test_ep2_full_recompute_reruns_both_all_to_alls_of_each_moe_layer(ep_job):
    results = _check_config(ep_job, "full")
    assert all(_ops_rerun(r, layer) > 0 for r in results for layer in range(4))


@pytest.mark.slow
def test_ep2_full_recompute_excluding_alltoall_runs_none_again(ep_job):
    results = _check_config(ep_job, "full_exclude_alltoall")
    assert all(_ops_rerun(r, layer) > 0 for r in results for layer in range(4))
    # the all-to-all primitives sit in dicts of cells held in _comm_ops: kept there, the layers go light
    for r in results:
        for row in r["layers"]:
            if row["layer"] != "other":
                assert row["intercepted_calls"] == 1 and row["light_calls"] > 0, row
                assert not row["intercept_reasons"], row["intercept_reasons"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["select_experts", "select_router", "select_shared_experts"])
def test_ep2_select_moe_modules(ep_job, name):
    results = _check_config(ep_job, name)
    for r in results:   # the MoE layers re-ran ops; the dense layer 1 has no such module
        assert _ops_rerun(r, 0) > 0 and _ops_rerun(r, 2) > 0 and _ops_rerun(r, 1) == _ops_rerun(r, 3) == 0
        assert r["plan"]["1"] == r["plan"]["3"] == []


@pytest.mark.slow
def test_ep2_recompute_comm_reruns_the_all_to_alls_only(ep_job):
    _check_config(ep_job, "recompute_comm")


@pytest.mark.slow
def test_ep2_layer_swap_of_moe_layers(ep_job):
    for r in _check_config(ep_job, "layer_swap"):
        assert r["summary"]["offloaded_bytes"] > 0
        assert r["plan"]["0"] and r["plan"]["2"] and not r["plan"]["1"]


@pytest.mark.slow
def test_ep2_mixed_config(ep_job):
    for r in _check_config(ep_job, "mixed"):
        assert r["summary"]["offloaded_bytes"] > 0
        assert _ops_rerun(r, 0) > 0 and _ops_rerun(r, 2) > 0


@pytest.mark.slow
def test_ep2_matches_the_single_process_model(ep_job):
    """Mean of the ranks' losses = the single-process mean loss over the same batches (TP test tolerance);
    every synced gradient, the local experts' included, = the single-process gradient."""
    for rank in range(2):
        steps = json.loads((ep_job / f"equivalence_rank{rank}.json").read_text())["steps"]
        assert len(steps) == 3 and len({round(s["loss"], 6) for s in steps}) == 3   # it trains
        for step in steps:
            assert step["loss"] == pytest.approx(step["ref_loss"], rel=1e-5), step
            assert step["grad_max_rel_diff"] < 1e-4, step
            assert step["expert_grad_max_rel_diff"] < 1e-4, step


@pytest.mark.slow
def test_train_cli_ep2_prints_table_and_collectives(tmp_path):
    config = tmp_path / "full.yaml"
    config.write_text(CONFIGS["full"][0])
    res = launch_msrun([_cli(), "train", str(config), "--moe", "--ep", "2", "--layers", "4", "--moe-layer-freq",
                        "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--batch", "2",
                        "--steps", "3", "--report", str(tmp_path / "report")],
                       nproc=2, timeout_s=400, log_dir=tmp_path / "logs", env=ENV)
    assert res.returncode == 0, _tail(res)
    with open(os.path.join(res.log_dir, "worker_0.log"), errors="replace") as f:
        log0 = f.read()
    with open(os.path.join(res.log_dir, "worker_1.log"), errors="replace") as f:
        log1 = f.read()
    assert "collectives in the last step (expert parallel):" in log0
    assert "re-run in backward {'AllToAll': 4}" in log0
    assert "bitwise equal in every step: yes" in log0
    assert "collectives in the last step" not in log1   # rank 0 prints
    s = json.loads((tmp_path / "report" / "report.json").read_text())["summary"]
    assert s["verdict"] == "equal" and s["collectives_per_step"]["ac"]["rerun_in_backward"] == {"AllToAll": 4}
