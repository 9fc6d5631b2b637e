"""A whole training run with AC against the same script without it, bitwise at every step.

``training_run_worker.py`` is the script a user would write: a LLaMA-style
decoder with the rotary tables passed to every layer as a per-step tuple,
int32 position ids and a bool mask; mixed precision (amp O2 applied
before ``apply_ac``; ``to_float(float16)`` on every layer after it); ``nn.TrainOneStepCell`` with
a loss scale and Adam; an EMA ``copy.deepcopy`` of the model, updated every
step; eval of both between steps; a checkpoint after step 3, then a fresh
process that builds the model, applies AC, loads the checkpoint and resumes to
step 6. The state compared at every step is the loss, every parameter and
optimizer slot of the train cell (trainable or not), every EMA parameter, and
both eval losses. The reference is the script without AC, uninterrupted; the
same script without AC but resumed must match it too (else the comparison
would prove nothing about resuming).
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from training_run_worker import MODES, SAVE_AT, STEPS  # noqa: E402

pytestmark = pytest.mark.slow

AC_MODES = [m for m in MODES if m != "none"]
RECOMPUTE = ("full", "select_cell", "select_op", "exclude_op", "recompute_comm", "mixed")
SWAP = ("layer_swap", "op_swap", "mixed")


def run_phase(phase, precision, workdir, modes):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "training_run_worker.py"), phase, precision,
                           str(workdir), *modes], capture_output=True, text=True, timeout=900, check=False,
                          cwd=HERE)
    assert proc.returncode == 0, f"{phase} {precision}: {proc.stderr[-3000:]}"


def load(workdir, mode, phase):
    with open(os.path.join(workdir, f"{mode}.{phase}.json"), encoding="utf-8") as f:
        return json.load(f)


def first_difference(expected, got):
    for want, have in zip(expected, got):
        for key in want:
            if want[key] != have[key]:
                if isinstance(want[key], dict):
                    names = [n for n in want[key] if want[key][n] != have[key].get(n)]
                    return f"step {want['step']}: {key} differs in {names[:5]} ({len(names)} in all)"
                return f"step {want['step']}: {key} differs"
    return None if len(expected) == len(got) else f"{len(got)} steps instead of {len(expected)}"


@pytest.fixture(scope="module", params=["amp_o2", "layers_fp16"])
def training_runs(request, tmp_path_factory):
    """Both phases of every mode, two processes per phase (the second is a fresh process)."""
    workdir = tmp_path_factory.mktemp(f"run_{request.param}")
    run_phase("first", request.param, workdir, MODES)
    run_phase("resume", request.param, workdir, MODES)
    return request.param, workdir


def test_resume_without_ac_matches_uninterrupted(training_runs):
    _, workdir = training_runs
    uninterrupted = load(workdir, "none", "first")["history"]
    assert len(uninterrupted) == STEPS
    assert first_difference(uninterrupted[SAVE_AT:], load(workdir, "none", "resume")["history"]) is None


@pytest.mark.parametrize("mode", AC_MODES)
def test_training_run_bitwise(training_runs, mode):
    precision, workdir = training_runs
    reference = load(workdir, "none", "first")["history"]
    first, resumed = load(workdir, mode, "first"), load(workdir, mode, "resume")
    diff = first_difference(reference, first["history"] + resumed["history"])
    assert diff is None, f"{mode} ({precision}): {diff}"
    for record in (first, resumed):
        assert record["ema_has_own_ac"]
        if mode in RECOMPUTE:
            assert record["acted"]["ops_rerun"] > 0, record
        if mode in SWAP:
            assert record["acted"]["offloaded"] > 0, record
