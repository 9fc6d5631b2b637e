"""`mindformers-ac train` end to end on a tiny model (subprocesses, as a user runs it)."""
import json
import subprocess
import sys

import pytest

TINY = ["--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "3"]

RECOMPUTE = """
recompute:
  mode: select
  full_recompute_layer: [0-1]
  select_module:
    '.*mlp': [2]
"""
SWAP = """
swap:
  enable: true
  default_prefetch: 1
  layer_swap:
    - layers: [0-2]
"""


def run_train(tmp_path, config_text, *extra):
    config = tmp_path / "ac.yaml"
    config.write_text(config_text)
    return subprocess.run([sys.executable, "-m", "mindformers_ac.harness.cli", "train", str(config), *TINY, *extra],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name, text", [("recompute", RECOMPUTE), ("swap", SWAP)])
def test_train_matches_losses_and_saves_memory(tmp_path, name, text):
    out = tmp_path / "report"
    proc = run_train(tmp_path, text, "--report", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "losses and gradients bitwise equal in every step: yes" in proc.stdout
    assert "peak activation memory" in proc.stdout and "ops re-run" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    assert s["losses_match_bitwise"] and s["grads_match_bitwise"]
    assert s["ac_peak_activation_bytes"] < 0.75 * s["baseline_peak_activation_bytes"]
    assert 0 < s["activation_saving_pct"] < 100 and s["step_time_ratio"] > 0
    assert s["baseline_vm_hwm_bytes"] > 0 and s["ac_vm_hwm_bytes"] > 0
    assert len(report["baseline"]["losses"]) == len(report["ac"]["losses"]) == 3
    rows = {row["layer"]: row for row in report["layers"]}
    assert set(rows) == {"0", "1", "2", "3", "other"}
    for key in ("applied", "baseline_kept_bytes", "kept_bytes", "recomputed_bytes", "offloaded_bytes",
                "prefetched_bytes", "on_demand_bytes", "ops_rerun"):
        assert key in rows["0"]
    if name == "recompute":
        assert rows["0"]["applied"] == ["full recompute"] and rows["0"]["ops_rerun"] > 0
        assert rows["2"]["recomputed_bytes"] > 0 and rows["3"]["recomputed_bytes"] == 0
    else:
        assert rows["0"]["offloaded_bytes"] > 0.9 * rows["0"]["baseline_kept_bytes"]
        assert rows["0"]["prefetched_bytes"] + rows["0"]["on_demand_bytes"] == rows["0"]["offloaded_bytes"]
        assert rows["3"]["offloaded_bytes"] == 0
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_config_exits_non_zero_with_the_field_path(tmp_path):
    proc = run_train(tmp_path, "swap:\n  enable: true\n  layer_swap:\n    - layers: [3]\n")
    assert proc.returncode == 2
    assert "swap.layer_swap[0].layers: layer 3 + default_prefetch 1 must be < num_layers 4" in proc.stderr
    assert "Traceback" not in proc.stderr
