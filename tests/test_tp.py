"""Tensor-parallel GPT: whitelist of comm ops (single process), 2-rank msrun numerics and collective
counts, and the launcher's behaviour when a rank fails. Tiny model: 2 layers, hidden 32, seq 16."""
import json
import os
import sys
import time

import numpy as np
import pytest

from mindformers_ac.harness import tp as T
from mindformers_ac.harness.launch import launch_msrun
from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.whitelist import get_single_layer_whitelist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "scripts", "tp_worker.py")
DIMS = dict(num_layers=2, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.0, seed=0)
LAYERS = DIMS["num_layers"]
ENV = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ----------------------------------------------------------------------------- single process

def test_tp_layer_whitelist_shows_comm_ops_without_comm_init():
    model = T.build_tp_gpt(2, 0, **DIMS)  # tp=2 cells, communication never initialised
    paths = get_single_layer_whitelist(model.decoder.layers[0])
    for p in ("self_attention.linear_qkv.all_gather", "self_attention.linear_proj.reduce_scatter",
              "mlp.linear_fc1.all_gather", "mlp.linear_fc2.reduce_scatter"):
        assert p in paths
    # the same cell names as the single-process model
    ref_paths = get_single_layer_whitelist(build_gpt(**DIMS).decoder.layers[0])
    assert set(ref_paths) <= set(paths)
    assert {p.name for p in model.get_parameters()} == {p.name for p in build_gpt(**DIMS).get_parameters()}

    plain = T.build_tp_gpt(2, 1, **DIMS, sequence_parallel=False)
    paths = get_single_layer_whitelist(plain.decoder.layers[1])
    assert "mlp.linear_fc1.copy_to_tp" in paths and "mlp.linear_fc2.all_reduce" in paths
    assert not any(p.endswith("all_gather") for p in paths)


def test_shards_are_the_rank_slices_of_the_full_weights():
    full = build_gpt(**DIMS)
    h = DIMS["hidden_size"]
    ranks = [T.build_tp_gpt(2, r, **DIMS, full_model=full) for r in range(2)]
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    shards = [dict((p.name, p) for p in m.get_parameters())[name].asnumpy() for m in ranks]
    assert shards[0].shape == (3 * h // 2, h)
    fq = full.decoder.layers[0].self_attention.linear_qkv.weight.asnumpy()
    np.testing.assert_array_equal(shards[1][: h // 2], fq[h // 2: h])        # q rows of rank 1's head
    np.testing.assert_array_equal(shards[1][h // 2: h], fq[h + h // 2: 2 * h])  # k rows
    for p in full.get_parameters():  # unshard(shard) == full, every parameter
        parts = [dict((q.name, q) for q in m.get_parameters())[p.name].asnumpy() for m in ranks]
        np.testing.assert_array_equal(T.unshard_param(ranks[0], p.name, parts), p.asnumpy())


@pytest.mark.parametrize("sp", [True, False])
def test_tp1_model_matches_reference(sp):
    full = build_gpt(**DIMS)
    model = T.build_tp_gpt(1, 0, **DIMS, sequence_parallel=sp, full_model=full)
    tokens, labels = synthetic_batch(2, DIMS["seq_length"], DIMS["vocab_size"])
    assert float(model(tokens, labels).asnumpy()) == pytest.approx(float(full(tokens, labels).asnumpy()),
                                                                   rel=1e-6)


# ----------------------------------------------------------------------------- 2 ranks under msrun

def _leftovers(marker):
    import psutil
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and marker in " ".join(proc.info["cmdline"] or []):
                found.append((proc.pid, proc.info["cmdline"]))
        except Exception:  # noqa: BLE001
            pass
    return found


def _no_leftovers(marker, bound_s=10):
    """``_leftovers(marker)`` once it is empty, or at ``bound_s`` seconds (a process killed by the launcher
    may take a moment to leave the process table): what is left then."""
    import psutil
    found = _leftovers(marker)
    deadline = time.monotonic() + bound_s
    while found and time.monotonic() < deadline:
        for pid, _ in found:
            try:
                psutil.Process(pid).wait(timeout=max(0.0, deadline - time.monotonic()))
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                pass
        found = _leftovers(marker)
    return found


def _worker_args(out, *extra, steps=3):
    return [WORKER, "--tp", "2", "--layers", str(LAYERS), "--hidden", "32", "--heads", "2", "--seq", "16",
            "--vocab", "64", "--batch", "2", "--steps", str(steps), "--seed", "0", "--out", str(out), *extra]


def _tail(res):
    text = []
    for f in res.worker_logs() + [os.path.join(res.log_dir, "msrun.log")]:
        with open(f, errors="replace") as fh:
            lines = [l for l in fh.read().splitlines() if "[WARNING]" not in l and "[INFO]" not in l]
        text.append(f"--- {f}\n" + "\n".join(lines[-30:]))
    return "\n".join(text)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [True, False], ids=["sequence_parallel", "plain_tp"])
def test_two_rank_loss_grads_and_collectives(tmp_path, sp):
    extra = [] if sp else ["--no-sequence-parallel"]
    res = launch_msrun(_worker_args(tmp_path / "out", *extra), nproc=2, timeout_s=240,
                       log_dir=tmp_path / "logs", env=ENV)
    assert res.returncode == 0, _tail(res)
    result = json.loads((tmp_path / "out" / "tp_result.json").read_text())
    assert result["world_size"] == 2 and len(result["steps"]) == 3
    L = LAYERS
    if sp:   # all_gather fwd / AllReduce+slice bwd (qkv, fc1), reduce_scatter = AllReduce+slice fwd /
             # AllGather bwd (proj, fc2), model: scatter (bwd AllGather), gather before output (fwd)
        prims = {"forward": {"AllGather": 2 * L + 1, "AllReduce": 2 * L},
                 "backward": {"AllReduce": 2 * L, "AllGather": 2 * L + 1},
                 "grad_sync": {"AllReduce": 1}}
        slots = {"all_gather": 2 * L, "reduce_scatter": 2 * L, "model.scatter": 1, "model.all_gather": 1}
    else:    # copy_to_tp: AllReduce bwd; all_reduce: AllReduce fwd
        prims = {"forward": {"AllReduce": 2 * L}, "backward": {"AllReduce": 2 * L}}
        slots = {"copy_to_tp": 2 * L, "all_reduce": 2 * L}
    for step in result["steps"]:
        assert step["loss"] == pytest.approx(step["ref_loss"], rel=1e-5), step
        assert step["grad_max_rel_diff"] < 1e-4, step
        assert step["per_collective"] == prims
        assert step["per_slot"] == {k: {"forward": n, "backward": n} for k, n in slots.items()}
    # the model trains: SGD changes the loss between steps on the same seeds' data
    assert len({round(s["loss"], 6) for s in result["steps"]}) == 3
    shas = [json.loads((tmp_path / "out" / f"grads_rank{r}.json").read_text()) for r in range(2)]
    replicated = "embedding.word_embeddings.embedding_table"
    assert shas[0][0][replicated] == shas[1][0][replicated]
    split = "decoder.layers.0.mlp.linear_fc1.weight"
    assert shas[0][0][split] != shas[1][0][split]


@pytest.mark.slow
@pytest.mark.parametrize("before_init", [False, True], ids=["after_init", "before_init"])
def test_failing_rank_returns_nonzero_quickly_and_leaves_no_process(tmp_path, before_init):
    out = tmp_path / "failout"
    extra = ["--fail-rank", "1"] + (["--fail-before-init"] if before_init else [])
    t0 = time.monotonic()
    res = launch_msrun(_worker_args(out, *extra, steps=1), nproc=2, timeout_s=150,
                       log_dir=tmp_path / "logs", env=ENV)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0 and not res.timed_out, _tail(res)
    assert res.rank_failed
    assert elapsed < 120, elapsed  # bare msrun waits up to --cluster_time_out (600 s) when before init
    assert _no_leftovers(str(out)) == []
    with open(os.path.join(res.log_dir, "worker_1.log"), errors="replace") as f:
        assert "failing" in f.read()


@pytest.mark.slow
def test_launcher_timeout_kills_everything(tmp_path):
    out = tmp_path / "slowout"
    res = launch_msrun(_worker_args(out, steps=1), nproc=2, timeout_s=4, log_dir=tmp_path / "logs", env=ENV)
    assert res.returncode == 124 and res.timed_out
    assert res.elapsed_s < 30
    assert _no_leftovers(str(out)) == []


# ----------------------------------------------------------------------------- AC under msrun

def _cli():
    script = os.path.join(os.path.dirname(sys.executable), "mindformers-ac")
    if not os.path.exists(script):
        import shutil
        script = shutil.which("mindformers-ac")
    return script


AC_MODES = {
    "full": ("recompute:\n  mode: full\n  full_recompute_layer: [0-1]\n",
             {"AllGather": 2 * LAYERS, "AllReduce": 2 * LAYERS}),
    "full_exclude_collectives": ("recompute:\n  mode: full\n  full_recompute_layer: [0-1]\n"
                                 "  exclude_op: [AllGather, ReduceScatter, AllReduce]\n", {}),
    "select_mlp": ("recompute:\n  mode: select\n  select_module:\n    '.*mlp': [0-1]\n",
                   {"AllGather": LAYERS, "AllReduce": LAYERS}),
    "recompute_comm": ("recompute_comm:\n  enable: true\n  select_module:\n    '.*\\.all_gather': [0-1]\n",
                       {"all_gather": 2 * LAYERS}),
}


def _check_tp_comparison(s, expected_rerun):
    assert s["losses_match_bitwise"] and s["grads_match_bitwise"] and s["params_match_bitwise"]
    assert s["verdict"] == "equal"
    collectives = s["collectives_per_step"]
    # AC never changes what forward and backward communicate, only what backward runs again
    assert collectives["ac"]["forward"] == collectives["baseline"]["forward"]
    assert collectives["ac"]["backward"] == collectives["baseline"]["backward"]
    assert collectives["baseline"]["rerun_in_backward"] == {}
    rerun = {}
    for name, n in collectives["ac"]["rerun_in_backward"].items():
        key = "all_gather" if name.endswith("all_gather") else name
        rerun[key] = rerun.get(key, 0) + n
    assert rerun == expected_rerun


@pytest.mark.slow
def test_train_tp2_with_ac_is_bitwise_equal_and_counts_collective_reruns(tmp_path):
    """The command, on the config the memory guide gives tensor parallelism (collectives kept)."""
    text, expected_rerun = AC_MODES["full_exclude_collectives"]
    config = tmp_path / "ac.yaml"
    config.write_text(text)
    res = launch_msrun([_cli(), "train", str(config), "--tp", "2", "--layers", str(LAYERS), "--hidden", "32",
                        "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "3", "--dropout", "0.1",
                        "--report", str(tmp_path / "report")],
                       nproc=2, timeout_s=240, log_dir=tmp_path / "logs", env=ENV)
    assert res.returncode == 0, _tail(res)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    _check_tp_comparison(report["summary"], expected_rerun)
    # the collectives are kept where their cells hold them (keep_sites): after its first step each layer is light
    for row in report["layers"]:
        if row["layer"] != "other":
            assert (row["light_calls"], row["intercepted_calls"]) == (2, 1) and not row["intercept_reasons"], row


@pytest.mark.slow
def test_every_other_ac_mode_under_tp2_is_bitwise_and_reruns_what_it_recomputes(tmp_path):
    """The other modes in one msrun job (``parallel_worker.py``: the same comparison as the command)."""
    modes = [m for m in sorted(AC_MODES) if m != "full_exclude_collectives"]
    paths = []
    for mode in modes:
        paths.append(tmp_path / f"{mode}.yaml")
        paths[-1].write_text(AC_MODES[mode][0])
    res = launch_msrun([os.path.join(ROOT, "tests", "parallel_worker.py"), "tp", str(tmp_path), *map(str, paths)],
                       nproc=2, timeout_s=300, log_dir=tmp_path / "logs", env=ENV)
    assert res.returncode == 0, _tail(res)
    results = json.loads((tmp_path / "rank0.json").read_text())
    for mode, path in zip(modes, paths):
        _check_tp_comparison(results[str(path)]["summary"], AC_MODES[mode][1])
    # MindFormers' own registry form (register_comm_op / _call_comm_op) on the real collectives: exclude_op keeps
    # them (run once, in forward; more kept than plain full), recompute_comm re-runs the all-gather, bitwise
    registry = results["mindformers_registry"]
    assert all(registry[mode]["bitwise"] for mode in ("full", "exclude", "comm")), registry
    assert registry["exclude"]["counts"] == registry["none"]["counts"] == {"allreduce": 2, "allgather": 2}
    assert registry["full"]["counts"] == {"allreduce": 4, "allgather": 4}
    assert registry["comm"]["counts"] == {"allreduce": 2, "allgather": 4}
    assert registry["exclude"]["kept"][-1] > registry["full"]["kept"][-1] and len(set(registry["exclude"]["kept"])) == 1
