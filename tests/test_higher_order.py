"""Higher-order gradients (grad of grad) through AC: refused with a clear error where a recompute would run.

The outer gradient differentiates the inner backward, which reads every saved
tensor a second time; a recomputed tensor is handed out once, so recompute
refuses with a ``RuntimeError`` naming the cause instead of the misleading
"backpropagated twice". Swap, and a selected region whose saves are all its
inputs (nothing to recompute), stay exact. Each case runs in a subprocess.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.slow


def run_worker(mode, warm):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "higher_order_worker.py"), mode, warm],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("warm", ["cold", "warm"])   # op-intercepting first call, then the light path
@pytest.mark.parametrize("mode", ["full", "group", "select_op"])
def test_recompute_refuses_grad_of_grad(mode, warm):
    result = run_worker(mode, warm)
    assert "equal" not in result
    assert result["error"].startswith("mindformers_ac: higher-order gradients (a grad of a grad")
    assert result["error_type"] == "RecomputeError"   # what a trainer catches (a RuntimeError)
    assert result["first_order_equal"], "first-order gradients must stay exact after the refusal"


@pytest.mark.parametrize("mode", ["layer_swap", "select_linear"])
def test_grad_of_grad_exact_where_nothing_is_recomputed(mode):
    result = run_worker(mode, "cold")
    assert result == {"mode": mode, "equal": True, "first_order_equal": True}
