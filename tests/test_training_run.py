"""A whole training run with AC against the same script without it, bitwise at every step.

``training_run_worker.py`` is the script a user would write: a LLaMA-style
decoder with the rotary tables passed to every layer as a per-step tuple,
int32 position ids and a bool mask; mixed precision (amp O2 applied
before ``apply_ac``; ``to_float(float16)`` on every layer after it); ``nn.TrainOneStepCell`` with
a loss scale and Adam; an EMA ``copy.deepcopy`` of the model, updated every
step; eval of both between steps; a checkpoint after step 2, then a fresh
process that builds the model, applies AC, loads the checkpoint and resumes to
step 4. The state compared at every step is the loss, every parameter and
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


# amp O2 meets every mode; to_float(float16) on the layers the modes whose saved dtypes differ from
# it (a region's inputs, a kept op output, swapped tensors) - the others meet it in test_mixed_precision
MODES_OF = {"amp_o2": MODES, "layers_fp16": ("none", "full", "select_op", "layer_swap", "mixed")}


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory):
    """``training_runs(precision)``: the workdir holding both phases of that precision's modes, two processes per
    phase (the second is a fresh process); each precision's runs are made once, by the first test that asks."""
    made = {}

    def workdir_of(precision):
        if precision not in made:
            workdir = tmp_path_factory.mktemp(f"run_{precision}")
            run_phase("first", precision, workdir, MODES_OF[precision])
            run_phase("resume", precision, workdir, MODES_OF[precision])
            made[precision] = workdir
        return made[precision]
    return workdir_of


@pytest.mark.parametrize("precision", sorted(MODES_OF))
def test_resume_without_ac_matches_uninterrupted(training_runs, precision):
    workdir = training_runs(precision)
    uninterrupted = load(workdir, "none", "first")["history"]
    assert len(uninterrupted) == STEPS
    assert first_difference(uninterrupted[SAVE_AT:], load(workdir, "none", "resume")["history"]) is None


@pytest.mark.parametrize("precision, mode", [(p, m) for p in sorted(MODES_OF) for m in MODES_OF[p] if m != "none"])
def test_training_run_bitwise(training_runs, precision, mode):
    workdir = training_runs(precision)
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
