"""Data parallel on MindSpore's own reducer (``nn.DistributedGradReducer``), under msrun on CPU:

* ``mindformers-ac train configs/full_swap.yaml --dp 2``: each rank on its own batches, gradients averaged,
  every rank prints the bitwise verdict against the same data-parallel run without AC and its memory, a
  report.json per rank;
* ``--dp 2 --tp 2`` and ``--dp 2 --pp 2`` (4 ranks, tiny models) with recompute in a layer group, ``exclude_op`` on
  the collectives and layer swap, bitwise on every rank;
* the library needs nothing data-parallel (``dp_library_worker.py``): ``apply_ac`` before or after the reducer
  is built, gradient accumulation before the reduce;
* the layout, the flags' refusals and ``plan --budget --dp`` without msrun.
"""
import json
import os
import sys

import pytest

from mindformers_ac.harness import cli
from mindformers_ac.harness.data_parallel import DataParallelLayout
from mindformers_ac.harness.launch import launch_msrun

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
TINY = ["--hidden", "16", "--heads", "2", "--seq", "8", "--vocab", "64", "--batch", "2", "--steps", "2",
        "--dropout", "0.1"]
# a layer group of full recompute keeping the collectives' outputs, and a swapped layer (4 layers)
COMPOSED = os.path.join(ROOT, "configs", "dp_composed.yaml")


def _cli():
    script = os.path.join(os.path.dirname(sys.executable), "mindformers-ac")
    if not os.path.exists(script):
        import shutil
        script = shutil.which("mindformers-ac")
    return script


def _logs(res):
    text = []
    for path in res.worker_logs():
        with open(path, errors="replace") as f:
            text.append("\n".join(line for line in f.read().splitlines()
                                  if "[WARNING]" not in line and "[INFO]" not in line))
    return text


def _check_rank(report, rank, dp_ranks):
    s = report["summary"]
    assert s["verdict"] == "equal" and s["losses_match_bitwise"] and s["grads_match_bitwise"], s
    dp = s["data_parallel"]
    assert dp["rank"] == rank and dp["dp_group_ranks"] == dp_ranks and dp["averaged_grads_differ_from_local"]
    assert s["ac_peak_activation_bytes"] < s["baseline_peak_activation_bytes"]   # per-rank memory, AC acted
    return s, {row["layer"]: row for row in report["layers"]}


@pytest.mark.slow
def test_train_dp2_full_swap_prints_bitwise_on_both_ranks(tmp_path):
    res = launch_msrun([_cli(), "train", os.path.join(ROOT, "configs", "full_swap.yaml"), "--dp", "2",
                        "--layers", "8", *TINY, "--report", str(tmp_path / "report")],
                       nproc=2, timeout_s=300, log_dir=tmp_path / "logs", env=ENV)
    logs = _logs(res)
    assert res.returncode == 0, "\n".join(logs)[-4000:]
    for rank, log in enumerate(logs):
        assert f"rank {rank} of 2 (data-parallel rank {rank} of 2):" in log
        assert "losses, gradients and all parameters bitwise equal in every step: yes" in log
        assert "peak activation memory:" in log
    reports = [json.loads((tmp_path / "report" / f"rank{r}" / "report.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        s, rows = _check_rank(report, rank, [0, 1])
        assert s["data_parallel"]["replicas_identical"]
        assert rows["0"]["recomputed_bytes"] > 0 and rows["4"]["offloaded_bytes"] > 0
    # each rank trained on its own batches: the losses differ, the averaged gradients do not
    assert reports[0]["baseline"]["losses"] != reports[1]["baseline"]["losses"]
    assert reports[0]["baseline"]["grad_digests"] == reports[1]["baseline"]["grad_digests"]


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["tp", "pp"])
def test_train_dp2_composed_with_tp2_or_pp2_is_bitwise_on_all_four_ranks(tmp_path, inner):
    extra = ["--tp", "2"] if inner == "tp" else ["--pp", "2", "--microbatches", "2"]
    res = launch_msrun([_cli(), "train", COMPOSED, "--dp", "2", *extra, "--layers", "4", *TINY,
                        "--report", str(tmp_path / "report")],
                       nproc=4, timeout_s=400, log_dir=tmp_path / "logs", env=ENV)
    logs = _logs(res)
    assert res.returncode == 0, "\n".join(logs)[-4000:]
    for rank, log in enumerate(logs):
        assert "losses, gradients and all parameters bitwise equal in every step: yes" in log, log[-2000:]
    for rank in range(4):
        report = json.loads((tmp_path / "report" / f"rank{rank}" / "report.json").read_text())
        s, rows = _check_rank(report, rank, [rank % 2, rank % 2 + 2])
        assert s["data_parallel"]["inner_group_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert s["data_parallel"]["replicas_identical"]   # the same TP slice, or the same stage
        if inner == "tp":
            collectives = s["collectives_per_step"]["ac"]
            assert collectives["forward"] == s["collectives_per_step"]["baseline"]["forward"]
            assert not collectives["rerun_in_backward"]   # exclude_op kept every collective's output
            assert "full recompute (group 0-1)" in rows["0"]["applied"] and rows["1"]["recomputed_bytes"] > 0
            assert rows["2"]["offloaded_bytes"] > 0
        else:
            stage = rank % 2
            assert s["pipeline"]["stage"] == stage
            if stage == 0:
                assert rows["1"]["recomputed_bytes"] > 0 and "full recompute (group 0-1)" in rows["0"]["applied"]
            else:
                assert rows["2"]["offloaded_bytes"] > 0


@pytest.mark.slow
def test_the_library_needs_nothing_data_parallel(tmp_path):
    res = launch_msrun([os.path.join(HERE, "dp_library_worker.py"), str(tmp_path)], nproc=2, timeout_s=300,
                       log_dir=tmp_path / "logs", env=ENV)
    assert res.returncode == 0, "\n".join(_logs(res))[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank_results in results:
        for scenario, figures in rank_results.items():
            assert figures["equal"], scenario
            assert figures["rerun"] > 0 and figures["offloaded"] > 0, (scenario, figures)
    for scenario in results[0]:   # the gradients were averaged: the same on both ranks
        assert results[0][scenario]["grad_digest_step1"] == results[1][scenario]["grad_digest_step1"]


# -- without msrun ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank, inner, dp_rank, inner_rank, dp_ranks, inner_ranks", [
    (0, 1, 0, 0, [0, 1], [0]), (1, 1, 1, 0, [0, 1], [1]),
    (1, 2, 0, 1, [1, 3], [0, 1]), (2, 2, 1, 0, [0, 2], [2, 3]), (3, 2, 1, 1, [1, 3], [2, 3]),
])
def test_layout_follows_mindformers_model_parallel_groups_of_consecutive_ranks(rank, inner, dp_rank, inner_rank,
                                                                               dp_ranks, inner_ranks):
    layout = DataParallelLayout(rank, 2, inner)
    assert (layout.dp_rank, layout.inner_rank, layout.dp_ranks, layout.inner_ranks) == (dp_rank, inner_rank,
                                                                                     dp_ranks, inner_ranks)
    assert (layout.dp_group is None) == (inner == 1) and layout.world == 2 * inner


@pytest.mark.parametrize("flags, message", [
    (["--dp", "2", "--model", "x:y"], "--model: can't be combined with --dp"),
    (["--dp", "2", "--ep", "2", "--moe"], "can't be combined with --dp"),
])
def test_dp_refuses_what_it_does_not_combine_with(capsys, flags, message):
    config = os.path.join(ROOT, "configs", "full_swap.yaml")
    assert cli.main(["train", config, *flags]) == 2
    assert message in capsys.readouterr().err


def test_plan_budget_dp_says_the_plan_is_per_rank_and_chooses_what_it_chooses_without(capsys, monkeypatch):
    from mindformers_ac.harness import spec as spec_module
    profiled, profile_spec = [], spec_module.profile_spec

    def profile_once(*args, **kwargs):   # the second command plans from the first one's profile
        if not profiled:
            profiled.append(profile_spec(*args, **kwargs))
        return profiled[0]
    monkeypatch.setattr(spec_module, "profile_spec", profile_once)
    argv = ["plan", "--budget", "0.5x", "--layers", "2", *TINY[:-6], "--batch", "2", "--profile-steps", "2"]
    assert cli.main([*argv, "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "data parallel 2 (MindFormers' data_parallel): this plan is per rank, the same on all 2 ranks" in out
    assert "its own batch of 2 (a global batch of 2 x 2)" in out and "activations don't shrink" in out
    assert "recompute:" in out or "swap:" in out   # the plan's YAML, as without --dp
    assert cli.main(argv) == 0   # the flag changes nothing the choice reads: the same profile, the same plan
    note = next(line for line in out.splitlines() if line.startswith("data parallel 2"))
    assert out.replace(note + "\n", "") == capsys.readouterr().out
