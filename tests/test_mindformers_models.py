"""MindFormers' own model code under AC: its recompute marker, replay metadata and functional Dropout.

The model (``mindformers_models.py``) guards a module-level aux-loss tracker
and an in-place ``tokens_per_expert`` write with a recompute marker, hands
host-side routing lists to its re-run with replay metadata, and uses
MindFormers' Dropout cell (a functional dropout held as an attribute). Every
mode must train it bitwise equal to the plain model (loss, every gradient,
every parameter) from step 0, and the tracker must hold the plain run's
values every step, whether the model asks mindformers_ac's marker or
MindFormers' (the stand-in, bridged by ``apply_ac``'s default ``context_fn``).
"""
import logging

import mindformers_standin as mf
import mindspore as ms
import numpy as np
import pytest
from mindformers_models import VOCAB, build_mindformers_moe
from mindspore import Tensor, nn, ops

import mindformers_ac as mac
from mindformers_ac.mindspore_compat import RandomState

from isolated import run_isolated
from model_patterns import ALL, PATTERNS, B, H, S, mode_config, token_batch
from steps import assert_acted, first_difference, install_api, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")

BATCH = token_batch(VOCAB)
MODES = ("full", "select_cell", "exclude_op", "layer_swap", "mixed", "checkpoint_api")


def _train(model, steps=3):
    """run_steps, plus the tracker's values after each step."""
    trackers = []

    def batch(step):
        if step > 0:
            trackers.append(model.tracker.snapshot())
        return BATCH(step)
    history = run_steps(model, batch, steps)
    trackers.append(model.tracker.snapshot())
    return history, trackers


@pytest.fixture(scope="module")
def plain():
    cache = {}

    def get(marker):
        if marker not in cache:
            with mf.installed():
                cache[marker] = _train(build_mindformers_moe(marker))
        return cache[marker]
    return get


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("marker", ["ours", "mindformers"])
def test_bitwise_from_step_0_and_the_tracker_logs_once(plain, marker, mode):
    base, base_trackers = plain(marker)
    with mf.installed():
        model = build_mindformers_moe(marker)
        pattern = PATTERNS["mindformers_moe"]
        config = mode_config(mode, pattern)
        if config is None:
            counter = install_api(mode, model)
            if marker == "mindformers":   # the API takes MindFormers' context_fn as MindFormers passes it
                object.__setattr__(model, "run_layer", lambda layer, *a, **k: mac.checkpoint(
                    layer, *a, stats=counter, context_fn=mf.recompute_context_fn, **k))
        else:
            mac.apply_ac(model, config=config, layers=pattern.layers)
            counter = None
        history, trackers = _train(model)
    assert first_difference(base, history) is None, f"{marker} {mode}: {first_difference(base, history)}"
    for step, (a, b) in enumerate(zip(base_trackers, trackers)):
        assert np.array_equal(a, b), f"step {step}: tracker {b} vs plain {a}"
    assert_acted(mode, model, counter)


def test_the_bridge_is_said_once(caplog):
    """With MindFormers' marker module loaded, apply_ac enters its context_fn, and its summary says so once."""
    config = {"recompute": {"mode": "full", "full_recompute_layer": [ALL]}}
    with mf.installed(), caplog.at_level(logging.INFO, logger="mindformers_ac"):
        bridged = build_mindformers_moe("mindformers")
        mac.apply_ac(bridged, config=config, layers="decoder.layers")
    said = [r.getMessage() for r in caplog.records if "recompute_context_fn" in r.getMessage()]
    assert len(said) == 1 and "context_fn=False" in said[0] and said[0].startswith("apply_ac: full recompute")
    assert mac.ac_state(bridged).context_fn is mf.recompute_context_fn


@pytest.mark.slow
def test_without_the_bridge_mindformers_marker_is_never_true_and_the_rerun_diverges():
    """``context_fn=False``: MindFormers' marker stays False in the re-run, whose tracker update then runs
    other ops than its forward's (the forward created the tracker): refused, as the issue found."""
    res = run_isolated("""
        import mindformers_ac as mac
        import mindformers_standin as mf
        from mindformers_models import VOCAB, build_mindformers_moe
        from model_patterns import token_batch
        from steps import run_steps
        with mf.installed():
            model = build_mindformers_moe("mindformers")
            mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-2"]}},
                         layers="decoder.layers", context_fn=False)
            assert mac.ac_state(model).context_fn is None
            run_steps(model, token_batch(VOCAB), steps=1)
    """)
    assert res.returncode != 0
    assert "RecomputeError: mindformers_ac: recompute diverged from forward" in res.stderr, res.stderr[-3000:]
    assert "forward ran Zeros" in res.stderr


def test_no_bridge_without_mindformers():
    model = build_mindformers_moe("ours")
    mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": [ALL]}},
                 layers="decoder.layers")
    assert mac.ac_state(model).context_fn is None


def test_context_fn_that_is_not_callable_is_refused_before_anything():
    model = build_mindformers_moe("ours")
    with pytest.raises(TypeError, match="context_fn must be a callable"):
        mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": [ALL]}},
                     layers="decoder.layers", context_fn="yes")
    assert mac.ac_state(model) is None


# -- replay metadata -------------------------------------------------------------------------------

def test_replay_metadata_queues_per_key_in_call_order():
    seen = []

    class Cell(nn.Cell):
        def construct(self, x):
            if mac.is_in_recompute():
                seen.append([mac.get_recompute_metadata("k"), mac.get_recompute_metadata("k"),
                             mac.get_recompute_metadata("other")])
            else:
                seen.append([mac.save_for_recompute("k", 1), mac.save_for_recompute("k", 2),
                             mac.save_for_recompute("other", "x")])
            return ops.sin(ops.cos(x))   # sin saves cos(x): dropped, so backward re-runs the cell

    cell = Cell()
    assert mac.save_for_recompute("k", 0) is False and mac.get_recompute_metadata("k") is None   # no region
    x = Tensor(np.ones((2, 3), np.float32))
    ms.grad(lambda t: mac.checkpoint(cell, t).sum())(x)
    assert seen == [[True, True, True], [1, 2, "x"]]


@pytest.mark.slow
def test_a_key_the_forward_never_saved_is_a_recompute_error():
    res = run_isolated("""
        import numpy as np
        from mindspore import Tensor, nn, ops
        import mindformers_ac as mac

        class Cell(nn.Cell):
            def construct(self, x):
                if mac.is_in_recompute():
                    mac.get_recompute_metadata("splits")
                return ops.sin(ops.cos(x))

        ms.grad(lambda t: mac.checkpoint(Cell(), t).sum())(Tensor(np.ones((2, 3), np.float32)))
    """)
    assert res.returncode != 0
    assert "RecomputeError" in res.stderr and "get_recompute_metadata('splits')" in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
def test_a_context_fn_returning_no_pair_names_itself():
    res = run_isolated("""
        import numpy as np
        from mindspore import Tensor, ops
        import mindformers_ac as mac

        def my_context():
            return None
        ms.grad(lambda t: mac.checkpoint(ops.sin, t, context_fn=my_context).sum())(
            Tensor(np.ones((2, 3), np.float32)))
    """)
    assert res.returncode != 0
    assert "TypeError: context_fn my_context must return a pair (forward_ctx, recompute_ctx)" in res.stderr, \
        res.stderr[-2000:]


# -- functional random ops -----------------------------------------------------------------------------

class _FunctionalRandomLayer(nn.Cell):
    """MindFormers' Dropout cell (the functional dropout held as an attribute), a functional dropout
    called directly, and ops.rand_like: all draw from MindSpore's seed table."""

    def __init__(self, p=0.1):
        super().__init__()
        from mindformers_models import MFDropout
        self.fc1 = nn.Dense(H, H)
        self.fc2 = nn.Dense(H, H)
        self.fc3 = nn.Dense(H, H)
        self.drop = MFDropout(p)
        self.p = p

    def construct(self, x):
        h = self.drop(ops.gelu(self.fc1(x)))
        if self.p:
            # a Dense between the two dropouts: Dropout -> Tanh -> Dropout hangs the intercepting re-run in
            # MindSpore 2.10's dispatch (it did before these changes too; see docs/exactness.md)
            h = ops.dropout(self.fc3(h), self.p) + 0.01 * ops.rand_like(h)
        return x + self.fc2(h)


class _Stack(nn.Cell):
    def __init__(self, p):
        super().__init__()
        self.layers = nn.CellList([_FunctionalRandomLayer(p) for _ in range(3)])

    def construct(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x - y) ** 2).mean()


def _stack(p):
    ms.set_seed(7)   # resets the seed table: every build draws the same numbers
    from model_patterns import init_weights
    return init_weights(_Stack(p))


def _hidden(step):
    rng = np.random.RandomState(step)
    return Tensor(rng.randn(B, S, H).astype(np.float32)), Tensor(rng.randn(B, S, H).astype(np.float32))


def test_functional_random_ops_take_the_light_path_keep_nothing_and_leave_the_seed_table_as_plain():
    base = run_steps(_stack(0.1), _hidden, steps=4)
    table_plain = RandomState().kernel_seeds
    model = _stack(0.1)
    mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-2"]}})
    history = run_steps(model, _hidden, steps=4)
    assert first_difference(base, history) is None
    assert RandomState().kernel_seeds == table_plain   # re-runs advanced the table by nothing
    stats = mac.ac_state(model).recompute_stats
    assert all((s.intercepted_calls, s.light_calls) == (1, 3) for s in stats.values()), \
        {i: (s.intercepted_calls, s.light_calls) for i, s in stats.items()}
    # what a light call keeps: the layer's input, as without dropout (no mask, no output of a random op)
    no_dropout = _stack(0.0)
    mac.apply_ac(no_dropout, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-2"]}})
    run_steps(no_dropout, _hidden, steps=2)
    kept = {i: s.kept_bytes for i, s in stats.items()}
    assert kept == {i: s.kept_bytes for i, s in mac.ac_state(no_dropout).recompute_stats.items()}


@pytest.mark.parametrize("light_path", [True, False], ids=["light", "intercepting"])
def test_functional_random_ops_bitwise_on_both_paths_and_in_select(light_path):
    base = run_steps(_stack(0.1), _hidden, steps=3)
    model = _stack(0.1)
    for layer in model.layers:
        mac.checkpoint_wrapper(layer, light_path=light_path)
    assert first_difference(base, run_steps(model, _hidden, steps=3)) is None
    model = _stack(0.1)
    mac.apply_ac(model, config={"recompute": {"mode": "select", "select_module": {"drop": ["0-2"]}}})
    assert first_difference(base, run_steps(model, _hidden, steps=3)) is None


@pytest.mark.parametrize("config", [
    {"recompute": {"mode": "full", "full_recompute_layer": ["0-3"]}},
    {"recompute": {"mode": "select", "select_module": {r"mlp\.experts": [3]}},
     "swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}},
], ids=["full_with_mtp", "select_mtp_swap_decoder"])
def test_apply_ac_on_the_decoder_with_mtp_block_as_mindformers_parallelize_does(plain, config):
    """``apply_ac(gptmodel.decoder, ..., mtp_block=gptmodel.mtp)``: MTP layer 0 is global layer 3."""
    base, base_trackers = plain("mindformers")
    with mf.installed():
        model = build_mindformers_moe("mindformers")
        plan = mac.apply_ac(model.decoder, config=config, mtp_block=model.mtp)
        history, trackers = _train(model)
    assert first_difference(base, history) is None
    assert all(np.array_equal(a, b) for a, b in zip(base_trackers, trackers))
    assert sorted(plan.layers) == [0, 1, 2, 3] and plan.layers[3].recomputed
    assert mac.ac_state(model.decoder).recompute_stats[3].recompute_calls == 3
