"""One model of what a region's forward writes (docs/exactness.md, rules W1-W7): every kind of write, in every
recompute path that meets it, trains bitwise against its plain twin or is refused with a RecomputeError.

The models are in ``write_cases.py``. Each exact case trains 3 steps and compares loss, every gradient and
every parameter, trainable or not, with the same model without AC, and checks that the mode acted; the
refused case (a tensor a layer saved, written by the next layer) runs in a subprocess, since it raises
inside backward.
"""
import os
import subprocess
import sys

import pytest
import write_cases as wc

import mindformers_ac as mac

from model_patterns import hidden_batch
from steps import first_difference, run_steps

TESTS = os.path.dirname(os.path.abspath(__file__))


def _exclude_api(*names):
    """The checkpoint API with HyperParallel's exclude policy around every layer."""
    def install(model):
        stats = mac.RecomputeStats()
        policy = mac.recompute.exclude_policy(names)
        object.__setattr__(model, "run_layer",
                           lambda layer, *a, **k: mac.checkpoint(layer, *a, policy_fn=policy, stats=stats, **k))
        return stats
    return install


def _plain_api(model):
    stats = mac.RecomputeStats()
    object.__setattr__(model, "run_layer", lambda layer, *a, **k: mac.checkpoint(layer, *a, stats=stats, **k))
    return stats


# case -> (builder, {mode: apply_ac config dict, or an installer of the checkpoint API})
CASES = {
    # W2: a kept output written later in its layer (PyTorch's test_checkpointing_without_reentrant_saved_
    # object_identity writes a saved output the same way), by an Inplace op and by a side-effect op
    "kept_output_copy": (lambda: wc.build_layers(wc.KeptCopyLayer),
                         {"exclude_op": wc.exclude("MatMul"), "checkpoint_api": _exclude_api("MatMul")}),
    "kept_output_assign_add": (lambda: wc.build_layers(wc.KeptAssignAddLayer),
                               {"exclude_op": wc.exclude("MatMul"), "checkpoint_api": _exclude_api("MatMul")}),
    # W3: a kept op that writes its own argument (all_reduce(t) in place under exclude_op: [AllReduce])
    "kept_op_writes_argument": (lambda: wc.build_layers(wc.KeptWriterLayer),
                                {"exclude_op": wc.exclude("InplaceCopy"), "checkpoint_api": _exclude_api("InplaceCopy")}),
    # W4: Parameters rebound in forward: slice assignment, assign_value, a trainable weight's set_data
    "buffer_slice_write": (lambda: wc.build_layers(wc.SliceBufferLayer),
                           {"full": wc.FULL, "group": wc.GROUP, "exclude_op": wc.exclude("MatMul"),
                            "checkpoint_api": _plain_api}),
    # issue 49's slice assignment into a kept output, a model's Parameter handed to every layer and rebound
    # there, and one-slot buffer write: patterns of the catalogue (model_patterns.py), in every mode
    # the five buffer patterns exact at b21fa7c (issue 49): copied, not refused by a size heuristic
    "shared_counter": (wc.build_shared_counter, {"full": wc.FULL, "exclude_op": wc.exclude("MatMul")}),
    "spectral_norm_assigned": (lambda: wc.build_layers(wc.spectral_norm_by("assign")),
                               {"full": wc.FULL, "exclude_op": wc.exclude("MatMul")}),
    "spectral_norm_replaced": (lambda: wc.build_layers(wc.spectral_norm_by("set_data")),
                               {"full": wc.FULL, "exclude_op": wc.exclude("MatMul")}),
    "assign_trainable_weight": (lambda: wc.build_layers(wc.AssignTrainableLayer),
                                {"full": wc.FULL, "exclude_op": wc.exclude("MatMul")}),
    "buffer_assign_value": (lambda: wc.build_layers(wc.AssignValueBufferLayer),
                            {"full": wc.FULL, "group": wc.GROUP, "checkpoint_api": _plain_api}),
    "trainable_weight_rebound": (lambda: wc.build_layers(wc.ReboundWeightLayer),
                                 {"full": wc.FULL, "group": wc.GROUP, "exclude_op": wc.exclude("MatMul"),
                                  "checkpoint_api": _plain_api}),
    # W5: a write between two grouped layers (a setitem rebinds, a copy_ writes)
    "write_between_group_members_setitem": (lambda: wc.init_weights(wc.WriteBetweenModel("setitem")),
                                            {"group": wc.GROUP, "full": wc.FULL}),
    "write_between_group_members_copy": (lambda: wc.init_weights(wc.WriteBetweenModel("copy")),
                                         {"group": wc.GROUP, "full": wc.FULL}),
    # W6: a marker-guarded side effect that keeps a tracked tensor (MindFormers 2.1.0's MoE aux-loss tracker)
    "tracker_keeps_attached_loss": (lambda: wc.build_layers(wc.TrackerLayer),
                                    {"full": wc.FULL, "group": wc.GROUP, "exclude_op": wc.exclude("MatMul"),
                                     "checkpoint_api": _plain_api}),
    # nested regions with replay metadata: a checkpoint_wrapper inside a recomputed layer
    "nested_region_metadata": (wc.build_nested, {"full": wc.FULL, "group": wc.GROUP}),
}


@pytest.fixture(scope="module")
def baselines():
    cache = {}

    def get(case):
        if case not in cache:
            cache[case] = run_steps(CASES[case][0](), hidden_batch)
        return cache[case]
    return get


@pytest.mark.parametrize("case, mode", [(c, m) for c in CASES for m in CASES[c][1]])
def test_write_trains_bitwise(baselines, case, mode):
    build, modes = CASES[case]
    wc.TRACKER.clear()
    model = build()
    how = modes[mode]
    if callable(how):
        stats = [how(model)]
    else:
        mac.apply_ac(model, config=mac.AcConfig.from_dict(how))
        stats = list(mac.ac_state(model).recompute_stats.values())
    history = run_steps(model, hidden_batch)
    assert first_difference(baselines(case), history) is None, first_difference(baselines(case), history)
    assert sum(s.ops_rerun for s in stats) > 0 and sum(s.recompute_calls for s in stats) > 0
    if mode == "exclude_op" or case.startswith("kept"):
        assert sum(s.ops_reused for s in stats) > 0   # the kept ops were kept, not re-run


def test_kept_writes_keep_the_region_intercepted():
    """A write into a kept output is invisible to the light path: the checking call says why it stays off."""
    model = wc.build_layers(wc.KeptCopyLayer)
    mac.apply_ac(model, config=mac.AcConfig.from_dict(wc.exclude("MatMul")))
    run_steps(model, hidden_batch, steps=2)
    stats = list(mac.ac_state(model).recompute_stats.values())
    assert sum(s.light_calls for s in stats) == 0
    reasons = {r for s in stats for r in s.intercept_reasons}
    assert any("writes the kept output of op" in r and "MatMul" in r for r in reasons), reasons


def test_group_member_after_a_write_keeps_its_input():
    """W5: the member after the write keeps its argument (it is not chained); the others still chain."""
    model = wc.init_weights(wc.WriteBetweenModel("copy"))
    mac.apply_ac(model, config=mac.AcConfig.from_dict(wc.GROUP))
    run_steps(model, hidden_batch, steps=1)
    chained = {layer: s.chained_calls for layer, s in mac.ac_state(model).recompute_stats.items()}
    assert chained == {0: 0, 1: 0, 2: 1}, chained


_SAVED_WRITTEN = """
import sys
sys.path.insert(0, {tests!r})
import conftest
import mindformers_ac as mac
import write_cases as wc
from model_patterns import hidden_batch
model = wc.build_layers(wc.WritesInputLayer, first=wc.SavesOutputLayer)
if {ac}:
    mac.apply_ac(model, config=mac.AcConfig.from_dict({{"recompute": {{"mode": "full", "full_recompute_layer": [0]}}}}))
wc.print_one_step_outcome(model, hidden_batch)
"""


@pytest.mark.slow
@pytest.mark.parametrize("ac", [False, True])
def test_saved_tensor_written_later_is_refused_as_without_ac(ac):
    """W6 (issue 37, case 11): layer 1 writes in place into the output layer 0 saved for backward. MindSpore
    refuses the backward without AC; with layer 0 recomputed the engine refuses it too, naming the tensor."""
    proc = subprocess.run([sys.executable, "-c", _SAVED_WRITTEN.format(tests=TESTS, ac=ac)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert "REFUSED" in out, out + proc.stderr[-2000:]
    if ac:
        assert "RecomputeError" in out and "output #0 of the recomputed region SavesOutputLayer" in out, out
        assert "modified by an in-place operation after the region's forward" in out, out
    else:
        assert "modified by an inplace operation" in out, out


@pytest.mark.slow
def test_inplace_collective_under_exclude_op_on_two_ranks(tmp_path):
    """W3 under msrun (issue 37, case 1): ``mint.distributed.all_reduce(t)`` reduces ``t`` in place and the
    layer goes on with ``t``; full recompute with ``exclude_op: [AllReduce]`` is bitwise on both ranks, and
    the all-reduce is kept, not run again in backward."""
    import json

    from mindformers_ac.harness.launch import launch_msrun
    root = os.path.dirname(TESTS)
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = launch_msrun([os.path.join(TESTS, "inplace_collective_worker.py"), tmp_path], nproc=2, timeout_s=240,
                       log_dir=tmp_path / "logs", env=env)
    assert res.returncode == 0, "\n".join(open(f, errors="replace").read()[-2000:] for f in res.worker_logs())
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["difference"] is None, result
        assert result["reused"] == 6 and not any("AllReduce" in op for op in result["rerun_by_op"]), result


def _preferring(policy):
    """``policy`` with MUST_SAVE turned into PREFER_SAVE: kept unless rule K2 re-runs it."""
    def prefer(ctx, func, *args, **kwargs):
        got = policy(ctx, func, *args, **kwargs)
        return mac.CheckpointPolicy.PREFER_SAVE if got is mac.CheckpointPolicy.MUST_SAVE else got
    return prefer


@pytest.mark.parametrize("block, prefer", [("Attention", False), ("Chain", False), ("Chain", True)])
def test_kept_ops_keep_their_outputs_and_prefer_save_never_keeps_more_than_without_ac(block, prefer):
    """K1/K2 (issue 37, case 9; HyperParallel's and torchtitan's memory tests keep a region's matmuls): keeping
    the matmuls keeps their outputs, not their inputs, on the intercepting call and the light ones; bitwise.
    MUST_SAVE (exclude_op) keeps what it was asked to (issue 49): the Chain's matmul whose output no
    backward reads stays kept, and the bytes beyond the model without AC are reported; PREFER_SAVE lets K2
    re-run it, and never keeps more than without AC."""
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "scripts"))
    import bench_kept_bytes as bench
    build = getattr(bench, block)
    base, none, _ = bench.run_block(build, None)
    policy = mac.recompute.exclude_policy(["matmul"])
    got, kept, stats = bench.run_block(build, _preferring(policy) if prefer else policy)
    assert all(np.array_equal(a, b) for s, t in zip(base, got) for a, b in zip(s, t))
    assert stats.ops_reused > 0
    if block == "Attention":   # every kept call sits in its own slot: the later calls are light
        assert 0 < kept <= none, (kept, none)
        assert stats.light_calls == 2 and stats.kept_over_bytes == 0
    elif prefer:   # K2 re-runs the unread matmul (a per-call policy: intercepted)
        assert 0 < kept <= none, (kept, none)
        assert stats.unread_kept > 0 and stats.kept_over_bytes == 0 and stats.light_calls == 0
    else:   # every matmul kept, none re-run: their slot holds a keep site, the later calls are light
        assert kept > none and stats.kept_over_bytes > 0 and stats.unread_kept == 0, (kept, none)
        assert "MatMul" not in stats.rerun_by_op and stats.light_calls == 2, stats


_OUTPUT_WRITTEN = """
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops
import mindformers_ac as mac
from model_patterns import init_weights

class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(8, 8)

    def construct(self, x):
        return ops.sigmoid(self.fc(x))   # Sigmoid saves its output: the region's output

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([Block()])

    def construct(self, x):
        h = self.layers[0](x)
        ops.assign_add(h, ops.stop_gradient(h) * 0.25)   # same storage, same version
        return (h ** 2).mean()

def grads(ac):
    model = init_weights(Net())
    if ac:
        exec(INSTALL)
    x = Tensor(np.random.RandomState(0).randn(2, 8).astype(np.float32))
    # two calls: the first intercepted, the second on the light path
    return [g.asnumpy() for _ in range(2) for g in ms.grad(model, None, model.trainable_params())(x)]

base = grads(False)
try:
    got = grads(True)
except mac.RecomputeError as exc:
    print("REFUSED", exc)
else:
    print("EXACT" if all(np.array_equal(a, b) for a, b in zip(base, got)) else "SILENT")
"""


@pytest.mark.parametrize("install", ["mac.apply_ac(model, config={'recompute': {'mode': 'full', "
                                     "'full_recompute_layer': [0]}})", "mac.checkpoint_wrapper(model.layers[0])"])
def test_region_output_written_by_assign_add_after_forward_is_exact(install):
    """Rule W6: a recomputed region's output that its own last op saved (a Sigmoid's), written by the caller with
    ``ops.assign_add`` after the forward (storage and version unchanged): without AC the Sigmoid's backward reads
    the written values, so the save is served from the held output, not rebuilt (found by issue 49's catalogue:
    the re-run's values, before the write, trained silently different), on the intercepting and the light path."""
    from isolated import run_isolated
    res = run_isolated(f"INSTALL = {install!r}\n" + _OUTPUT_WRITTEN)
    assert "EXACT" in res.stdout, res.stdout + res.stderr[-2000:]
