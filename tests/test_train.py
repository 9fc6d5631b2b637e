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
    assert "losses, gradients and all parameters bitwise equal in every step: yes" in proc.stdout
    assert "peak activation memory" in proc.stdout and "ops re-run" in proc.stdout
    # synchronous_pynative(): MindSpore's recommended API, so neither process prints a deprecation warning
    assert "deprecated" not in proc.stderr and "pynative_synchronize" not in proc.stderr
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    assert s["losses_match_bitwise"] and s["grads_match_bitwise"] and s["params_match_bitwise"]
    assert s["verdict"] == "equal" and s["first_difference"] is None and not s["baseline_rerun"]
    assert "baseline_again" not in report   # no third run when the two runs agree
    # every parameter of the model, digested after each step
    names = report["baseline"]["param_names"]
    assert "decoder.layers.0.input_layernorm.gamma" in names and len(names) == len(set(names))
    assert [len(d) for d in report["ac"]["param_digests"]] == [len(names)] * 3
    assert s["ac_peak_activation_bytes"] < 0.75 * s["baseline_peak_activation_bytes"]
    saving = 100.0 * (1 - s["ac_peak_activation_bytes"] / s["baseline_peak_activation_bytes"])
    assert s["activation_saving_pct"] == pytest.approx(saving) and s["activation_saving_pct"] > 25
    assert s["step_time_ratio"] == pytest.approx(s["ac_step_time_s"] / s["baseline_step_time_s"])
    # the summary's peaks are the per-layer rows' totals
    assert sum(row["kept_bytes"] for row in report["layers"]) == s["ac_peak_activation_bytes"]
    assert sum(row["baseline_kept_bytes"] for row in report["layers"]) == s["baseline_peak_activation_bytes"]
    assert s["baseline_vm_hwm_bytes"] > 0 and s["ac_vm_hwm_bytes"] > 0
    assert len(report["baseline"]["losses"]) == len(report["ac"]["losses"]) == 3
    rows = {row["layer"]: row for row in report["layers"]}
    assert set(rows) == {"0", "1", "2", "3", "other"}
    for row in rows.values():   # where each layer's bytes are: its modules, the engines
        assert sum(row["kept_by_module"].values()) == row["kept_bytes"]
        assert sum(row["baseline_kept_by_module"].values()) == row["baseline_kept_bytes"]
    assert {"self_attention.core_attention", "mlp"} <= set(rows["3"]["baseline_kept_by_module"])
    assert "kept MiB by module (without AC | with AC):" in proc.stdout
    for key in ("applied", "baseline_kept_bytes", "kept_bytes", "recomputed_bytes", "offloaded_bytes",
                "prefetched_bytes", "on_demand_bytes", "ops_rerun"):
        assert key in rows["0"]
    if name == "recompute":
        assert rows["0"]["applied"] == ["full recompute"] and rows["0"]["ops_rerun"] > 0
        assert rows["2"]["recomputed_bytes"] > 0 and rows["3"]["recomputed_bytes"] == 0
        # which path each call took, over the 3 steps: the first intercepts, the next two go light
        assert (rows["0"]["light_calls"], rows["0"]["intercepted_calls"]) == (2, 1)
        assert (rows["3"]["light_calls"], rows["3"]["intercepted_calls"]) == (0, 0)
        assert "calls light/intercepted" in proc.stdout
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


# --- one vocabulary for the reference GPT's dimensions ---------------------------------------------------


def _parse(*argv, **defaults):
    import argparse

    from mindformers_ac.harness.spec import add_model_arguments
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, **defaults)
    return parser.parse_args(list(argv))


def test_flags_set_gpt_config_fields_and_defaults_come_from_gpt_config():
    from mindformers_ac.harness.models import GPTConfig
    from mindformers_ac.harness.spec import GPT_FLAGS, TrainSpec, spec_from_args
    spec = spec_from_args(_parse("--layers", "3", "--hidden", "48", "--dropout", "0.25", "--batch", "5"), steps=7)
    assert spec.gpt == GPTConfig(num_layers=3, hidden_size=48, dropout=0.25)   # the rest: GPTConfig's defaults
    assert (spec.batch, spec.steps, spec.seed, spec.factory) == (5, 7, TrainSpec().seed, None)
    assert spec_from_args(_parse()) == TrainSpec()
    assert spec_from_args(_parse(layers=4, seq=128)).gpt == GPTConfig(num_layers=4, seq_length=128)
    assert {field for _, field in GPT_FLAGS} | {"ffn_ratio"} == set(GPTConfig.__dataclass_fields__)


def test_a_spec_travels_to_a_worker_as_json():
    import dataclasses

    from mindformers_ac.harness.models import GPTConfig
    from mindformers_ac.harness.spec import TrainSpec
    spec = TrainSpec(gpt=GPTConfig(num_layers=2, vocab_size=64), batch=3, factory="m:f", layer_list="model.stack",
                     data_flags=("seq",))
    assert TrainSpec.from_dict(json.loads(json.dumps(dataclasses.asdict(spec)))) == spec


def test_the_reference_model_is_gpt_config_defaults():
    from mindformers_ac.harness.models import GPTConfig, reference_model
    model = reference_model()
    cfg = GPTConfig()
    assert model.config == cfg and len(model.decoder.layers) == cfg.num_layers
    assert model.embedding.word_embeddings.embedding_table.shape == (cfg.vocab_size, cfg.hidden_size)


def test_synchronous_pynative_uses_the_api_mindspore_recommends_where_it_has_it(monkeypatch):
    import mindspore as ms

    from mindformers_ac.mindspore_compat import synchronous_pynative
    calls = []
    monkeypatch.setattr(ms, "set_context", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ms, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(ms.runtime, "launch_blocking", lambda: calls.append("launch_blocking"))
    synchronous_pynative("CPU")   # MindSpore 2.10: the recommended API, no deprecated context key
    assert calls == [("set_device", "CPU"), {"mode": ms.PYNATIVE_MODE}, "launch_blocking"]
    calls.clear()
    monkeypatch.delattr(ms.runtime, "launch_blocking")   # a release without them: the context keys
    monkeypatch.delattr(ms, "set_device")
    synchronous_pynative("CPU")
    assert calls == [{"device_target": "CPU"}, {"mode": ms.PYNATIVE_MODE}, {"pynative_synchronize": True}]


def test_train_budget_profiles_chooses_and_reports_the_chosen_plan(tmp_path):
    out = tmp_path / "report"
    proc = run_train(tmp_path, "memory_budget:\n  profile_steps: 3\n", "--budget", "0.5x", "--steps", "6",
                     "--report", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "losses, gradients and all parameters bitwise equal in every step: yes" in proc.stdout
    summary = json.loads((out / "report.json").read_text())["summary"]
    budget = summary["memory_budget"]
    assert budget["first_step"] == 3 + budget["replanned"] and budget["phase"] == "settled" and budget["fits"]
    assert f"memory budget 0.5x = {budget['budget_bytes'] / 2 ** 20:.2f} MiB: chosen {budget['chosen']}" in proc.stdout
    assert budget["measured_peak_bytes"] <= budget["budget_bytes"] and "within the budget" in proc.stdout
    # the summary's figures are the chosen plan's, from its first step: kept bytes within the budget
    assert summary["ac_peak_activation_bytes"] <= budget["budget_bytes"]
    assert any("kept bytes and step-time cost per layer" in line for line in budget["describe"])   # the table
    assert "memory_budget:" not in budget["config"] and "recompute:" in budget["config"]   # pins the plan
