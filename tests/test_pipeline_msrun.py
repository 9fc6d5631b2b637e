"""``mindformers-ac train --pp 2 --microbatches 4`` under msrun: two ranks, one stage each, GPipe order.

Each rank trains its stage without and with AC and prints its own verdict and per-stage peaks; the
pipeline without AC is also compared with the unsplit model trained with gradient accumulation. The
command itself runs the config that swaps layers on both stages; full recompute and a mix run in one
more job (``parallel_worker.py``, one communication set-up for both).
"""
import json
import os
import sys

import pytest

from mindformers_ac.harness.launch import launch_msrun

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
DIMS = ["--layers", "8", "--hidden", "16", "--heads", "2", "--seq", "8", "--vocab", "64", "--batch", "2",
        "--steps", "2", "--dropout", "0.1"]
SWAP = "swap: {enable: True, default_prefetch: 1, layer_swap: [{layers: [0-2]}, {layers: [4-6]}]}\n"
OTHERS = {
    "full": "recompute: {mode: full, full_recompute_layer: [0-7]}\n",
    "mix": ("recompute: {mode: select, full_recompute_layer: [0, 5], select_module: {'.*mlp': [1, 6]}}\n"
            "swap: {enable: True, layer_swap: [{layers: [2, 4]}], op_swap: [{op_name: '.*attention', "
            "layers: [6]}]}\n"),
}


def _cli():
    script = os.path.join(os.path.dirname(sys.executable), "mindformers-ac")
    if not os.path.exists(script):
        import shutil
        script = shutil.which("mindformers-ac")
    return script


def _log(path):
    with open(path, errors="replace") as f:
        return "\n".join(line for line in f.read().splitlines() if "[WARNING]" not in line and "[INFO]" not in line)


def _check_stage(rank, summary, layers):
    assert summary["verdict"] == "equal", summary
    p = summary["pipeline"]
    assert p["stage"] == rank and p["layers"] == [4 * rank, 4 * rank + 3] and p["microbatches"] == 4
    assert p["unsplit_matches"], p   # the pipeline without AC is the unsplit model's gradient accumulation
    assert p["peak_in_flight_bytes"]["ac"] < p["peak_in_flight_bytes"]["baseline"]
    rows = {row["layer"]: row for row in layers}
    assert set(rows) == {str(i) for i in range(4 * rank, 4 * rank + 4)} | {"other"}
    return rows


@pytest.mark.slow
def test_train_pp2_swapping_layers_on_both_stages_prints_bitwise_on_both_ranks(tmp_path):
    config = tmp_path / "swap.yaml"
    config.write_text(SWAP)
    res = launch_msrun([_cli(), "train", str(config), "--pp", "2", "--microbatches", "4", *DIMS,
                        "--report", str(tmp_path / "report")],
                       nproc=2, timeout_s=300, log_dir=tmp_path / "logs", env=ENV)
    logs = [_log(path) for path in sorted(res.worker_logs())]
    assert res.returncode == 0, "\n".join(logs)[-4000:]
    for rank, log in enumerate(logs):
        assert f"pipeline stage {rank} (rank {rank} of 2):" in log
        assert "losses, gradients and all parameters bitwise equal in every step: yes" in log
        assert f"pipeline stage {rank} of 2 (layers {4 * rank}-{4 * rank + 3}), 4 microbatches in flight (GPipe)" in log
        report = json.loads((tmp_path / "report" / f"stage{rank}" / "report.json").read_text())
        rows = _check_stage(rank, report["summary"], report["layers"])
        swapped = [str(i) for i in range(4 * rank, 4 * rank + 3)]   # every microbatch's tensors prefetched
        assert all(rows[i]["offloaded_bytes"] > 0 and rows[i]["on_demand_bytes"] == 0 for i in swapped)


@pytest.mark.slow
def test_full_recompute_and_a_mix_on_two_stages_are_bitwise(tmp_path):
    paths = []
    for name, text in OTHERS.items():
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(text)
    res = launch_msrun([os.path.join(HERE, "parallel_worker.py"), "pp", str(tmp_path), *map(str, paths)],
                       nproc=2, timeout_s=300, log_dir=tmp_path / "logs", env=ENV)
    assert res.returncode == 0, "\n".join(_log(p) for p in res.worker_logs())[-4000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for path in paths:
            rows = _check_stage(rank, results[str(path)]["summary"], results[str(path)]["layers"])
            if path.stem == "full":
                assert all(rows[str(i)]["recomputed_bytes"] > 0 for i in range(4 * rank, 4 * rank + 4))
