"""Exactness on the models users write: every AC mode x a catalogue of model patterns.

For each cell of the matrix, 3 SGD steps with AC must leave the loss, every
gradient and **every parameter, trainable or not** (BatchNorm moving
statistics, forward-time counters and buffers) bitwise equal to the same model
trained without AC, and the mode must have acted (ops re-run, tensors
offloaded), or the config is refused up front with a ``ConfigError`` naming
what is unsupported, leaving the model untouched, or (``Pattern.raises``) the
training is refused with a ``RecomputeError`` naming the region's cell path and
the op, in the step the pattern names and before that step's optimizer update
(checked in one subprocess). The patterns are in
``model_patterns.py``; the failure-path checks (exceptions, Ctrl-C and
SystemExit in forward and backward) run in subprocesses, in
``interrupt_worker.py``.
"""
import json
import logging
import os
import re
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from mindspore.graph.api import _pynative_executor

import mindformers_ac as mac
from mindformers_ac.recompute import wrap_op_output
from mindformers_ac.recompute.state import ENGINE
from mindformers_ac.tensors import storage_nbytes

from conftest import model_fingerprint
from isolated import run_isolated
from model_patterns import MODES, PATTERNS, B, Draws, H, S, init_weights, mode_config, recorded_draws
from steps import ac_counters, assert_acted, first_difference, install_mode, run_steps, train_pattern

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")   # each test starts from an empty SwapManager


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def baselines():
    """The pattern's history without AC, trained once per pattern and module."""
    cache = {}

    def get(name):
        if name not in cache:
            pattern = PATTERNS[name]
            model = pattern.build()
            if pattern.prepare is not None:
                pattern.prepare(model)
            cache[name] = train_pattern(pattern, model)
        return cache[name]
    return get


def _cells(raising):
    """The (pattern, mode) cells of the matrix: those that train (``raising`` False) or those refused while
    training (``Pattern.raises``), an engine bug a cell meets marked ``xfail(strict=True)``."""
    for name in sorted(PATTERNS):
        pattern = PATTERNS[name]
        for mode in MODES:
            if (pattern.modes is not None and mode not in pattern.modes) or (mode in pattern.raises) != raising:
                continue
            marks = [pytest.mark.xfail(strict=True, reason=pattern.xfail[mode])] if mode in pattern.xfail else []
            yield pytest.param(name, mode, marks=marks, id=f"{name}-{mode}")


@pytest.mark.parametrize("name, mode", list(_cells(raising=False)))
def test_whole_training_state_bitwise_or_refused(baselines, name, mode):
    pattern = PATTERNS[name]
    model = pattern.build()
    config = mode_config(mode, pattern)
    refused = pattern.refused.get(mode)
    if refused is not None:
        before = model_fingerprint(model)
        with pytest.raises(mac.ConfigError, match=refused):
            mac.apply_ac(model, config=config, layers=pattern.layers)
        assert model_fingerprint(model) == before
        return
    counter = install_mode(mode, pattern, model)
    if pattern.prepare is not None:
        pattern.prepare(model)
    counters = ac_counters(model)
    history = train_pattern(pattern, model)
    assert not _pynative_executor.is_saved_tensor_hook_active()
    assert ENGINE.top() is None and not ENGINE.in_recompute()
    if pattern.replay_draws:   # the plain twin replays what this run's forwards drew
        try:
            base = train_pattern(pattern, recorded_draws())
        finally:
            Draws.replay = None
    else:
        base = baselines(name)
    diff = first_difference(base, history)
    assert diff is None, f"{name} with {mode}: {diff}"
    assert_acted(mode, model, counter, counters)
    if pattern.never_rerun and mode in ("exclude_op", "hyper_api"):   # kept (MUST_SAVE) means never run again
        stats = [counter] if counter is not None else counters[0].values()
        rerun = {op for s in stats for op in s.rerun_by_op}
        assert not set(pattern.never_rerun) & rerun, rerun
    if config is not None and mac.ac_state(model) is not None:
        mac.remove_ac(model)
        assert all("construct" not in cell.__dict__ for _, cell in model.cells_and_names())


# -- refused while training: on the first backward that meets it, before that step's optimizer update -----------

_REFUSALS = """
import json
import mindspore as ms
from mindspore import nn
import mindformers_ac as mac
from mindformers_ac.mindspore_compat import pynative_executor
from model_patterns import PATTERNS
from steps import _record, first_difference, install_mode, run_steps

results = {}
for name in NAMES:
    pattern = PATTERNS[name]
    base = run_steps(pattern.build(), pattern.batch)
    for mode in sorted(pattern.raises):
        model = pattern.build()
        counter = install_mode(mode, pattern, model)
        stats = [counter] if counter is not None else list(mac.ac_state(model).recompute_stats.values())
        model.set_train(True)
        opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
        grad_fn = ms.value_and_grad(model, None, opt.parameters)
        history, result = [], {"step": None}
        for step in range(3):
            before = [p.asnumpy().tobytes() for p in model.trainable_params()]
            try:
                loss, grads = grad_fn(*pattern.batch(step))
            except Exception as exc:   # noqa: BLE001
                pynative_executor.clear_res()
                result = {"step": step, "error": f"{type(exc).__name__}: {exc}",
                          "unchanged": before == [p.asnumpy().tobytes() for p in model.trainable_params()],
                          "earlier_steps": first_difference(base[:step], history),
                          "light_calls": sum(s.light_calls for s in stats)}
                break
            opt(grads)
            history.append(_record(model, loss, grads))
        results[f"{name}-{mode}"] = result
print("RESULTS", json.dumps(results))
"""


@pytest.fixture(scope="module")
def refusals():
    """Every cell of ``Pattern.raises`` trained in one subprocess (the error is raised inside backward), each
    after the others' refusals."""
    names = sorted(name for name, pattern in PATTERNS.items() if pattern.raises)
    res = run_isolated(f"NAMES = {names!r}\n" + _REFUSALS, timeout=600)
    assert "RESULTS" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(res.stdout.split("RESULTS", 1)[1])


@pytest.mark.parametrize("name, mode", list(_cells(raising=True)))
def test_refused_on_the_first_backward_naming_the_op_and_the_cell(refusals, name, mode):
    """A cell the engine can't make exact raises a RecomputeError naming the region's cell path and the op
    in the step the pattern says (the earlier steps bitwise), with no parameter changed by that step."""
    step, message, *path = PATTERNS[name].raises[mode]
    got = refusals[f"{name}-{mode}"]
    assert got["step"] == step, got
    assert got["error"].startswith("RecomputeError: ") and re.search(message, got["error"]), got["error"]
    assert got["unchanged"] and got["earlier_steps"] is None, got
    if path:   # which path the refused re-run took: the light one (calls so far on it) or the intercepting one
        assert (got["light_calls"] > 0) == (path[0] == "light"), got


# -- stateful ops: written once, re-run on copies, memory kept low -------------------------------

def _rerun_by_op(model):
    total = {}
    for stats in mac.ac_state(model).recompute_stats.values():
        for op, n in stats.rerun_by_op.items():
            total[op] = total.get(op, 0) + n
    return total


@pytest.mark.parametrize("name, writers", [("batchnorm", {"BatchNorm": 3}),
                                           ("assign_counters", {"Assign": 3, "AssignAdd": 3, "InplaceCopy": 3})])
def test_stateful_ops_are_rerun_on_copies_and_write_once(name, writers):
    pattern = PATTERNS[name]
    model = pattern.build()
    mac.apply_ac(model, config=mode_config("full", pattern), layers=pattern.layers)
    run_steps(model, pattern.batch, steps=1)
    rerun = _rerun_by_op(model)
    assert {op: rerun.get(op, 0) for op in writers} == writers   # re-run once per layer, not kept
    if name == "assign_counters":
        assert [layer.calls.asnumpy().tolist() for layer in model.layers] == [[1.0]] * 3


@pytest.mark.parametrize("name, child", [("batchnorm", "bn"), ("assign_counters", "attn")])
def test_nested_regions_write_once(baselines, name, child):
    """A region inside a region: the parent's recompute replays the child. BatchNorm writes in the
    child (replayed, then recomputed), the counters in the parent: each must still write once per step."""
    pattern = PATTERNS[name]
    model = pattern.build()
    stats = mac.RecomputeStats()
    for layer in model.layers:
        mac.checkpoint_wrapper(getattr(layer, child), stats=stats)
        mac.checkpoint_wrapper(layer, stats=stats)
    assert first_difference(baselines(name), run_steps(model, pattern.batch)) is None
    assert stats.recompute_calls > 0
    for layer in model.layers:
        mac.unwrap(layer)
        mac.unwrap(getattr(layer, child))


def _layer_input_bytes(pattern, model):
    x, _, pos, mask = pattern.batch(0)
    return sum(storage_nbytes(t) for t in (x, pos, mask, model.scale))


def test_batchnorm_full_recompute_keeps_inputs_and_small_copies_only():
    pattern = PATTERNS["batchnorm"]
    model = pattern.build()
    mac.apply_ac(model, config=mode_config("full", pattern), layers=pattern.layers)
    run_steps(model, pattern.batch, steps=1)
    inputs = _layer_input_bytes(pattern, model)
    copies = 4 * H * 4   # BatchNorm's gamma, beta, moving mean and variance: H float32 each
    bn_output = B * S * H * 4
    for layer_id, stats in mac.ac_state(model).recompute_stats.items():
        assert inputs + copies <= stats.kept_bytes <= 1.2 * inputs + copies, (layer_id, stats.kept_bytes, inputs)
        assert stats.kept_bytes < inputs + copies + bn_output   # BN's output is not kept


def test_large_written_parameter_keeps_the_output_instead_of_copying(caplog):
    """ScatterUpdate on a table larger than its other inputs and than side_effects.SMALL_COPY_BYTES (a 128 KiB
    table): output kept, the table written once."""
    from mindspore import Parameter, Tensor, mint, ops

    class Memory(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = mint.nn.Linear(H, H)
            self.table = Parameter(Tensor(np.zeros((1024, H), np.float32)), name="table", requires_grad=False)
            self.update = ops.ScatterUpdate()

        def construct(self, x, slot):
            h = self.fc(x)
            self.update(self.table, slot, ops.stop_gradient(h))
            return ops.gelu(h)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Memory() for _ in range(2)])

        def construct(self, x, slot):
            for layer in self.layers:
                x = layer(x, slot)
            return (x ** 2).mean()

    def batch(step):
        rng = np.random.RandomState(step)
        return Tensor(rng.randn(2, H).astype(np.float32)), Tensor(np.array([step, step + 5], np.int32))

    base = run_steps(init_weights(Net()), batch)
    model = init_weights(Net())
    mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-1"]}})
    with caplog.at_level(logging.WARNING, logger="mindformers_ac.recompute"):
        other = run_steps(model, batch)
    assert first_difference(base, other) is None
    assert "ScatterUpdate writes parameters larger than its other inputs" in caplog.text
    assert _rerun_by_op(model).get("ScatterUpdate", 0) == 0


@pytest.mark.slow
def test_reading_a_kept_write_before_it_raises_naming_both_ops():
    """A recomputed read of a table that a kept (too large to copy) ScatterUpdate writes later can't be exact."""
    res = _run_worker("kept_write_read_before")
    assert res.returncode != 0
    assert "reads a tensor that op #" in res.stderr and "ScatterUpdate" in res.stderr, res.stderr[-3000:]


def test_output_recompute_of_a_stateful_op_keeps_its_output(baselines, caplog):
    pattern = PATTERNS["batchnorm"]
    model = pattern.build()
    handles = [wrap_op_output(layer, "bn", scope=layer) for layer in model.layers]
    with caplog.at_level(logging.WARNING, logger="mindformers_ac.recompute"):
        history = run_steps(model, pattern.batch)
    assert first_difference(baselines("batchnorm"), history) is None
    assert "write parameters" in caplog.text
    assert all(h.stats.ops_rerun == 0 for h in handles)
    for h in handles:
        h.remove()


# -- a layer called twice per forward ----------------------------------------------------------------

def test_layer_swap_of_a_layer_called_twice_prefetches_its_latest_call_and_does_not_grow():
    """Two calls of swapped layer 0 per step: the prefetch at layer 1's backward loads the second call
    (the one backward reaches first); the first call loads on demand; nothing accumulates across steps."""
    pattern = PATTERNS["called_twice"]
    model = pattern.build()
    mac.apply_ac(model, config=mode_config("layer_swap", pattern), layers=pattern.layers)
    report = mac.ac_state(model).swap_report
    model.set_train(True)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    snaps = []
    for step in range(4):
        grad_fn(*pattern.batch(step))
        snaps.append(report.end_step())
    for snap in snaps:
        layer0 = snap["layers"][0]
        assert [e for e in snap["events"] if e[0] == "prefetch" and e[1] == 0] == [("prefetch", 0, 1)]
        assert layer0["num_offloaded"] > 0 and layer0["on_demand_bytes"] > 0
        assert layer0["prefetched_bytes"] + layer0["late_bytes"] > 0
        assert layer0["prefetched_bytes"] + layer0["late_bytes"] + layer0["on_demand_bytes"] == \
            layer0["offloaded_bytes"]
    assert len({s["live_resident_bytes"] for s in snaps}) == 1
    mac.remove_ac(model)


# -- a module shared by two layers ------------------------------------------------------------------

def test_a_module_shared_by_two_layers_is_exact_under_whole_layer_modes():
    """Layers 1 and 2 share their MLP (select or op-swap of it is refused by plan_ac, see test_plan):
    whole-layer recompute and swap patch the distinct layer cells and stay exact, and remove_ac restores
    the shared module's op attributes too."""
    pattern = PATTERNS["int_bool_inputs"]

    def build():
        model = pattern.build()
        model.layers[2].mlp = model.layers[1].mlp
        return model

    base = run_steps(build(), pattern.batch)
    for mode in ("full", "layer_swap", "mixed"):
        model = build()
        before = model_fingerprint(model)[0]
        mac.apply_ac(model, config=mode_config(mode, pattern) if mode != "mixed" else
                     {"recompute": {"mode": "full", "full_recompute_layer": [2]},
                      "swap": {"enable": True, "layer_swap": [{"layers": [1]}]}})
        assert first_difference(base, run_steps(model, pattern.batch)) is None, mode
        mac.remove_ac(model)
        assert model_fingerprint(model)[0] == before, mode


# -- diagnostics ----------------------------------------------------------------------------------

def _run_worker(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tests", "interrupt_worker.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_a_real_divergence_names_the_op_and_what_differed():
    """A tensor read from outside the region's arguments that requires grad in forward only."""
    res = _run_worker("divergence")
    assert res.returncode != 0
    assert "recompute diverged from forward at op #" in res.stderr, res.stderr[-3000:]
    assert "saved 2 tensor(s) for backward in forward but 1 in the recompute" in res.stderr


# -- failure paths -------------------------------------------------------------------------------

FAILURE_MODES = ("full", "select_op", "layer_swap", "op_swap")


@pytest.fixture(scope="module")
def failure_results():
    """Every failure-path mode in one worker process, one after the other (one MindSpore start for all)."""
    res = _run_worker("interrupt", *FAILURE_MODES)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", FAILURE_MODES)
def test_failures_in_forward_and_backward_leave_nothing_behind(failure_results, mode):
    """Exception, KeyboardInterrupt and SystemExit in forward, in a backward hook and in the recompute.

    After each: no saved-tensor hook or dispatch mode active, the engine's stacks
    empty, the model trains on bitwise like a model without AC that failed
    alike, a fresh plain model trains like in a clean process, and remove_ac
    restores the cells (each mode after the others' failures: they leave nothing behind for it either).
    """
    results = failure_results[mode]
    wheres = {r["where"] for r in results}
    assert wheres == ({"forward", "backward", "recompute"} if mode in ("full", "select_op")
                      else {"forward", "backward"})
    assert {r["exc"] for r in results} == {"RuntimeError", "KeyboardInterrupt", "SystemExit"}
    for r in results:
        label = f"{mode}/{r['where']}/{r['exc']}"
        assert r["raised"], f"{label}: the injected error did not surface"
        assert r["hook_active"] is False and r["dispatch_depth"] == 0 and r["engine_clean"], (label, r)
        assert r["same_as_plain"] is None, (label, r["same_as_plain"])
        assert r["fresh_model_clean"] and r["removed_clean"], (label, r)
