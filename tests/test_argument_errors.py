"""Unclear errors and silent acceptance (issue 29, point 11): each case is refused before any work, with a
message naming the argument or flag (exit 2 for the CLI), or (``swap_tensor_wrapper``) behaves the same
inside a swap group as outside one."""
import os
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import mindformers_ac as mac
from mindformers_ac.harness.cli import main
from mindformers_ac.harness.models import build_gpt

from conftest import model_fingerprint
from steps import first_difference, run_steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, BATCH = 32, 4


# --- swap_tensor_wrapper: anything but a Tensor comes back as it is, in a group and outside ------------

class Block(nn.Cell):
    def __init__(self, rng):
        super().__init__()
        self.dense1 = nn.Dense(HIDDEN, 4 * HIDDEN,
                               weight_init=Tensor(rng.standard_normal((4 * HIDDEN, HIDDEN), np.float32) * 0.1))
        self.dense2 = nn.Dense(4 * HIDDEN, HIDDEN,
                               weight_init=Tensor(rng.standard_normal((HIDDEN, 4 * HIDDEN), np.float32) * 0.1))
        self.seen = []

    def construct(self, x):
        h = mac.swap_tensor_wrapper(ops.tanh(self.dense1(x)), tag="h")
        # an optional output that is None, a number, a tuple: returned as they are, nothing marked
        self.seen.append((mac.swap_tensor_wrapper(None, tag="none"), mac.swap_tensor_wrapper(3),
                          mac.swap_tensor_wrapper(("a", 1))))
        return x + self.dense2(h)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        ms.set_seed(0)   # the Dense biases: the same in both twins
        rng = np.random.default_rng(0)
        self.layers = nn.CellList([Block(rng) for _ in range(3)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return ops.mean(ops.square(x))


def _batch(step):
    return (Tensor(np.random.default_rng(step).standard_normal((BATCH, HIDDEN)).astype(np.float32)),)


def test_swap_tensor_wrapper_passes_non_tensors_through_inside_a_linked_layer(fresh_swap_manager):
    base = run_steps(Net(), _batch)   # outside any group: a no-op
    model = Net()
    keys = [mac.SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1]) for i in (0, 1)]
    history = run_steps(model, _batch)
    assert first_difference(base, history) is None
    assert all(seen == (None, 3, ("a", 1)) for layer in model.layers for seen in layer.seen)
    report = mac.SwapManager().report
    for key in keys:   # the marked tensor of every linked layer was offloaded: exactly one per call, 3 steps
        assert report.layers[key].offloaded_bytes == 3 * BATCH * 4 * HIDDEN * 4


# --- async_save_on_cpu: block_idx / depth checked when called -----------------------------------------

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(block_idx=5, depth=4), ValueError, r"block_idx must be in \[0, depth - 1\] = \[0, 3\], got 5"),
    (dict(block_idx=4, depth=4), ValueError, r"block_idx must be in \[0, depth - 1\] = \[0, 3\], got 4"),
    (dict(block_idx=-1, depth=4), ValueError, r"block_idx must be in .*got -1"),
    (dict(block_idx=0, depth=0), ValueError, r"depth \(the number of blocks\) must be >= 1, got 0"),
    (dict(block_idx=0, depth="4"), TypeError, r"depth must be an int, got str '4'"),
    (dict(block_idx=1.0, depth=4), TypeError, r"block_idx must be an int, got float 1.0"),
    (dict(block_idx=True, depth=4), TypeError, r"block_idx must be an int, got bool True"),
    (dict(block_idx=0, depth=2, custom_check_fn="big"), TypeError, r"custom_check_fn must be a callable"),
])
def test_async_save_on_cpu_refuses_bad_blocks_when_called(fresh_swap_manager, kwargs, error, message):
    with pytest.raises(error, match="async_save_on_cpu: " + message):
        mac.async_save_on_cpu(**kwargs)   # at the call, before ``with``: nothing was opened
    assert mac.SwapManager().scheduler.current_group() is None


def test_async_save_on_cpu_takes_numpy_ints(fresh_swap_manager):
    x = Tensor(np.ones((2, 2), np.float32))
    with mac.async_save_on_cpu(block_idx=np.int64(0), depth=np.int64(2)):
        assert mac.SwapManager().scheduler.current_group() is not None
        ops.tanh(x)
    assert mac.SwapManager().scheduler.current_group() is None


# --- plan_ac refuses the user's wrappers on a cell the config recomputes, as apply_ac does -------------

FULL = {"recompute": {"mode": "full", "full_recompute_layer": [0, 1]}}
SELECT_MLP = {"recompute": {"mode": "select", "select_module": {"mlp": [0, 1]}}}


def _small_gpt():
    return build_gpt(num_layers=3, hidden_size=32, num_heads=2, seq_length=8, vocab_size=32, dropout=0.0)


@pytest.mark.parametrize("wrapper, undo", [(mac.checkpoint_wrapper, "unwrap(cell)"),
                                           (mac.swap_wrapper, "remove_swap_wrapper(cell)")],
                         ids=["checkpoint_wrapper", "swap_wrapper"])
@pytest.mark.parametrize("target, config, named", [
    ("layer", FULL, "layer 1 (TransformerLayer)"),
    ("mlp", SELECT_MLP, "layer 1 cell 'mlp' (MLP)"),
], ids=["full", "select"])
def test_plan_ac_refuses_a_cell_the_user_wrapped(wrapper, undo, target, config, named):
    model = _small_gpt()
    layer = model.decoder.layers[1]
    wrapper(layer if target == "layer" else layer.mlp)
    before = model_fingerprint(model)
    for call in (mac.plan_ac, mac.apply_ac):
        with pytest.raises(mac.ConfigError) as info:
            call(model, config=config)
        text = str(info.value)
        assert text.startswith(f"model: {named} is already wrapped by {wrapper.__name__}")
        assert f"mindformers_ac.{undo}" in text
    assert model_fingerprint(model) == before and mac.ac_state(model) is None


def test_plan_ac_still_takes_a_user_wrapper_inside_a_recomputed_layer():
    model = _small_gpt()
    mac.checkpoint_wrapper(model.decoder.layers[0].mlp)   # a nested region: apply_ac takes it
    assert mac.plan_ac(model, config=FULL).layers[0].full_recompute
    mac.apply_ac(model, config=FULL)
    mac.remove_ac(model)


# --- the CLI: --out and the reference GPT's shape, checked before the long part ------------------------

def test_plan_out_is_checked_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").mkdir()
    # --model does not exist: reaching it would be a --model error, so --out was checked first
    cases = {
        "no_such_dir/p.yaml": "error: --out: the directory of 'no_such_dir/p.yaml', 'no_such_dir', does not exist",
        "taken": "error: --out: 'taken' is a directory; --out takes the path of the YAML file to write",
    }
    for out, message in cases.items():
        assert main(["plan", "--budget", "0.5x", "--model", "no_such_module:build", "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and "no_such_module" not in err, err
    (tmp_path / "file").write_text("x")
    assert main(["plan", "--budget", "0.5x", "--model", "no_such_module:build", "--out", "file/p.yaml"]) == 2
    assert "error: --out: the directory of 'file/p.yaml', 'file', is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "no_such_dir").exists()


def test_reference_shape_flags_are_checked():
    import argparse

    from mindformers_ac.harness.spec import add_model_arguments, spec_from_args
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)

    def spec(*argv, **fields):
        return spec_from_args(parser.parse_args(list(argv)), **fields)

    with pytest.raises(mac.ConfigError, match=r"^--hidden: 30 is not a multiple of --heads 4: .* use --hidden 32 "
                                              r"or --heads 3"):
        spec("--hidden", "30", "--heads", "4")
    with pytest.raises(mac.ConfigError, match=r"^--hidden: 128 is not a multiple of --heads 3"):
        spec("--heads", "3")   # the default --hidden
    with pytest.raises(mac.ConfigError, match=r"^--tp: 3 does not divide --heads 4"):
        spec("--hidden", "48", "--heads", "4", "--seq", "6", tp=3)
    with pytest.raises(mac.ConfigError, match=r"^--tp: 2 does not divide --seq 15"):
        spec("--seq", "15", tp=2)
    assert spec("--hidden", "30", "--heads", "3").gpt.hidden_size == 30
    assert spec("--hidden", "48", "--heads", "6", "--seq", "12", tp=3).tp == 3


def _cli(cwd, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mindformers_ac.harness.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_refuses_before_any_work(tmp_path):
    """As a user's shell sees it: status 2, one line naming the flags, no traceback, nothing run."""
    shape = "error: --hidden: 30 is not a multiple of --heads 4"
    for args, message in [
        (["plan", "--budget", "0.5x", "--layers", "2", "--hidden", "30", "--heads", "4"], shape),
        (["train", "--layers", "2", "--hidden", "30", "--heads", "4", "--steps", "2"], shape),
        (["plan", "--budget", "0.5x", "--layers", "2", "--hidden", "32", "--heads", "2", "--out", "nope/p.yaml"],
         "error: --out: the directory of 'nope/p.yaml', 'nope', does not exist"),
    ]:
        proc = _cli(tmp_path, *args)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "[baseline]" not in proc.stderr
        assert "profiled" not in proc.stdout and "AcPlan" not in proc.stdout
