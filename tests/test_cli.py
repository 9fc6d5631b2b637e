import os
import pathlib
import subprocess
import sys

import pytest

import mindformers_ac as mac
from mindformers_ac.harness.cli import default_config_path, main
from mindformers_ac.harness.models import reference_model

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.yaml"))
SCENARIOS = {"select_mlp", "full_first_half", "full_exclude_op", "full_all", "full_swap",
             "select_attention_mlp", "comm_recompute", "swap_layer_op"}


def test_every_guide_scenario_has_a_config():
    assert SCENARIOS <= {p.stem for p in CONFIGS}


@pytest.fixture(scope="module")
def reference():
    return reference_model()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_plan_on_the_reference_model(path, reference):
    plan = mac.plan_ac(reference, config=mac.AcConfig.from_yaml(path))
    assert plan.num_layers == 8
    if path.stem != "comm_recompute":  # all_gather exists only in the tensor-parallel model
        assert plan.active_layers(), "config plans nothing on the reference model"
    assert main(["validate", str(path), "--num-layers", "8"]) == 0


def test_scenario_contents(reference):
    plans = {p.stem: mac.plan_ac(reference, config=mac.AcConfig.from_yaml(p)) for p in CONFIGS}
    assert all(lp.recompute == ("mlp",) for lp in plans["select_mlp"].layers.values())
    assert [lp.full_recompute for lp in plans["full_first_half"].layers.values()] == [True] * 4 + [False] * 4
    assert plans["full_exclude_op"].layers[0].exclude == ("AllGather", "ReduceScatter", "AllToAll")
    assert all(lp.full_recompute for lp in plans["full_all"].layers.values())
    fs = plans["full_swap"].layers
    assert [fs[i].layer_swap for i in range(8)] == [False] * 4 + [True] * 3 + [False]
    sam = plans["select_attention_mlp"].layers
    assert [sam[i].recompute for i in (0, 4)] == [("self_attention",), ("mlp",)]
    slo = plans["swap_layer_op"].layers
    assert slo[0].layer_swap and slo[2].op_swap == ("mlp",) and slo[2].prefetch_layer == 3


def test_default_config_is_valid_for_the_reference_model(reference):
    plan = mac.plan_ac(reference, config=default_config_path())
    assert any(lp.full_recompute for lp in plan.layers.values())
    assert any(lp.layer_swap for lp in plan.layers.values())


def test_validate_prints_summary(capsys):
    assert main(["validate", str(CONFIGS[0])]) == 0
    assert "OK:" in capsys.readouterr().out


def test_validate_rejects_with_field_path(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("swap:\n  enable: true\n  layer_swap:\n    - layers: [0-1]\n    - layers: [1]\n")
    assert main(["validate", str(bad)]) == 2
    assert "swap.layer_swap[1].layers: layer 1 is already listed" in capsys.readouterr().err
    assert main(["validate", str(CONFIGS[0].parent / "select_mlp.yaml"), "--num-layers", "4"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_explain_on_a_factory(capsys):
    assert main(["explain", str(pathlib.Path(__file__).parent.parent / "configs" / "select_mlp.yaml"),
                 "--model", "mindformers_ac.harness.models:reference_model"]) == 0
    out = capsys.readouterr().out
    assert "recompute.select_module['.*mlp'] -> layers ['0-7']" in out and "layer 7: mlp" in out


def test_explain_bad_factory(capsys):
    assert main(["explain", "--model", "no_such_module:make"]) == 2
    assert "--model: cannot import module 'no_such_module': not found in the current directory" \
        in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_exits_non_zero_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("recompute:\n  mode: fast\n")
    proc = subprocess.run([sys.executable, "-m", "mindformers_ac.harness.cli", "validate", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "recompute.mode: expected one of None, full, select" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- every option says what it does and its default -----------------------------------------------------


def _subcommand_options():
    import argparse

    from mindformers_ac.harness.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, parser in sub.choices.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                yield command, action


@pytest.mark.parametrize("command, action", list(_subcommand_options()),
                         ids=[f"{c}-{a.option_strings[0] if a.option_strings else a.dest}"
                              for c, a in _subcommand_options()])
def test_every_option_states_its_default_in_help(command, action):
    text = (action.help or "").lower()
    assert "default" in text or "required" in text, f"{command} {action.option_strings or action.dest}: {text!r}"
    if action.required or (not action.option_strings and action.nargs is None):
        assert "required" in text
    elif action.default not in (None, False):
        assert f"default {action.default}" in text   # the value the parser really uses


def test_help_lists_layers_and_layer_list_apart(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--layers LAYERS num_layers (default 8) (reference GPT only)" in out
    assert "--layer-list PATH with --model: attribute path of the model's layer list" in out
    assert "--steps STEPS training steps of each run (default 20)" in out


# --- mistakes caught before the long part ---------------------------------------------------------------


@pytest.mark.parametrize("budget", ["0.5", "0.5B", "512", "0.5KiB", "1536.5"])
def test_a_budget_that_is_no_byte_count_is_refused_before_the_model_is_built(budget, capsys):
    # the --model module does not exist: reaching it would be a --model error, so --budget was checked first
    assert main(["plan", "--budget", budget, "--model", "no_such_module:build"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --budget: '{budget}' reads as ") and "no_such_module" not in err
    if budget.startswith("0.5"):
        assert "did you mean 0.5x, a fraction of the baseline's peak?" in err
    else:
        assert "(0.5x)" in err and "MiB" in err


@pytest.mark.parametrize("argv, message", [
    (["--pp", "3"], "--pp: expected 1 or 2 (two stages of the reference GPT, one per rank), got 3"),
    (["--microbatches", "2"], "--microbatches: needs --pp 2"),
    (["--pp", "2", "--microbatches", "65"], "--microbatches: expected at most 64, got 65"),
    (["--pp", "2", "--tp", "2"], "--tp: can't be combined with --pp"),
    (["--pp", "2", "--layers", "1"], "--layers: --pp 2 cuts the reference GPT at half its layers"),
])
def test_train_refuses_pipeline_flags_it_cannot_run_before_anything_starts(capsys, argv, message):
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0.5x", "--steps", "9"], "--steps: with --budget, expected at least 10"),
    (["--budget", "0.5"], "--budget: '0.5' reads as 0.5 bytes"),
    (["--budget", "2x", "--model", "no_such_module:build", "--steps", "4"], "--steps: with --budget"),
])
def test_train_budget_mistakes_are_caught_before_anything_starts(capsys, argv, message):
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err



@pytest.mark.parametrize("argv, ranks", [
    (["--dp", "2"], 2), (["--tp", "2"], 2), (["--pp", "2"], 2), (["--moe", "--ep", "2"], 2),
    (["--dp", "2", "--tp", "2"], 4), (["--dp", "2", "--pp", "2"], 4), (["--budget", "0.5x", "--tp", "2"], 2),
])
def test_a_parallel_train_without_msrun_says_how_to_launch_it_in_one_line(capsys, monkeypatch, argv, ranks):
    monkeypatch.delenv("MS_WORKER_NUM", raising=False)
    assert main(["train", *argv, "--layers", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    flags = " ".join(a for a in argv if a not in ("--moe", "--budget", "0.5x"))
    assert err.startswith(f"error: {flags}: runs {ranks} ranks under msrun; launch it with: python -m "
                          f"mindformers_ac.harness.launch --nproc {ranks} $(which mindformers-ac) train {' '.join(argv)}")


def test_the_installed_command_prints_the_launcher_line_alone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MS_WORKER_NUM"}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "mindformers_ac.harness.cli", "train", "--dp", "2"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["error: --dp 2: runs 2 ranks under msrun; launch it with: python -m "
                                        "mindformers_ac.harness.launch --nproc 2 $(which mindformers-ac) train --dp 2"]
