"""``checkpoint(..., debug=True)``: a diverging re-run's error shows both runs' ops side by side (issue 38, point 5).

Scenario of PyTorch's ``checkpoint(..., use_reentrant=False, debug=True)`` (test/test_autograd.py,
TestCheckpoint, the non-deterministic-recompute cases run in debug mode, whose error prints the
forward's and the recomputation's operator traces): a function that takes another branch in its
re-run. The error names the first op that differs, as without debug, then lists both logs with the
Python line of each op. Raised in backward: in a subprocess.
"""
from isolated import run_isolated

SCRIPT = """
    import numpy as np
    from mindspore import Tensor, ops
    import mindformers_ac as mac

    def branchy(x):
        h = ops.exp(x)
        if mac.is_in_recompute():
            h = ops.tanh(h)
        else:
            h = ops.sin(h)   # two lines below the tanh
        return ops.cos(h) * x

    x = Tensor(np.array([0.1, 0.2], np.float32))
    for debug in (False, True):
        try:
            ms.grad(lambda v: mac.checkpoint(branchy, v, use_reentrant=False, debug=debug).sum())(x)
        except mac.RecomputeError as exc:
            print(f"== debug={debug}")
            print(exc)
"""


def test_debug_shows_both_op_logs_with_their_lines():
    proc = run_isolated(SCRIPT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, debug = proc.stdout.split("== debug=True")
    first_line = "recompute diverged from forward at op #1: forward ran Sin, recompute runs Tanh"
    assert first_line in plain and "debug=True:" not in plain and "|" not in plain
    assert first_line in debug
    rows = [r.strip() for r in debug.splitlines() if "|" in r]
    assert rows[0].split() == ["forward", "|", "re-run"]
    exp_fwd, exp_rerun = rows[1].split("|")
    assert exp_fwd.split()[:2] == ["#0", "Exp"] and exp_fwd.split() == exp_rerun.split()   # same op, same line
    sin, tanh = rows[2].split("|")
    assert sin.split()[:2] == ["#1", "Sin"] and tanh.split()[:2] == ["#1", "Tanh"]
    assert tanh.endswith("<< first difference")
    sin_line, tanh_line = int(sin.split()[2].split(":")[1]), int(tanh.split()[2].split(":")[1])
    assert sin.split()[2].startswith("<string>:") and sin_line == tanh_line + 2   # each op's own Python line
    assert rows[3].split()[-3:] == ["|", "(not", "run)"]
