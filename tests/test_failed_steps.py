"""A step that raises inside a grad call leaves nothing behind: the next steps train bitwise as without AC.

Issue 38, point 1: MindSpore 2.10 leaves its grad flag set after a grad call
whose function raised, and the higher-order check used to trust that flag,
so the next step that re-ran a region was refused as a grad of a grad.
Scenario ported from the peers' training loops that skip a bad batch
(PyTorch ``test_autograd.py`` ``TestCheckpoint`` runs its cases one after
the other in one process; HyperParallel's ``tests/torch/activation_checkpoint``
cases share a process too): each kind of failure in a subprocess
(``failed_step_worker.py``), every AC mode in it.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODES = ("full", "select_cell", "exclude_op", "layer_swap", "checkpoint_api")
KINDS = ("before_op", "after_op", "bad_keyword", "plain_grad", "in_backward")


def run_worker(kind):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "failed_step_worker.py"), kind],
                          capture_output=True, text=True, timeout=600, check=False, cwd=HERE,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, HERE])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k != "after_op" else k
                                  for k in KINDS])
def test_a_failed_step_leaves_nothing_behind(kind):
    result = run_worker(kind)
    assert sorted(result) == sorted(MODES)
    expected = "TypeError" if kind == "bad_keyword" else "InjectedFailure"
    for mode, outcome in result.items():
        assert outcome["raised"] == outcome["raised_without_ac"] == expected, (mode, outcome)
        assert outcome["left_behind"] == {}, (mode, outcome)
        assert outcome["difference"] is None, (mode, outcome)
