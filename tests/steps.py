"""Training steps the exactness tests compare, and the check that an AC mode acted.

``run_steps`` trains a model with SGD and records, per step, the loss, every
gradient and every parameter (trainable or not) as bytes; ``first_difference``
names the first place two such histories differ. ``install_api`` routes a
pattern model's layer calls through ``checkpoint`` / ``swap`` (the API modes);
``assert_acted`` fails a mode that silently did nothing.
"""
import mindspore as ms
import numpy as np
from mindspore import nn

import mindformers_ac as mac

from model_patterns import RECOMPUTE_MODES, SWAP_MODES


def run_steps(model, batch, steps=3):
    """Per step: loss bytes, every gradient's bytes, and every parameter's (name, bytes) after the update."""
    model.set_train(True)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history = []
    for step in range(steps):
        loss, grads = grad_fn(*batch(step))
        opt(grads)
        history.append((loss.asnumpy().tobytes(), [g.asnumpy().tobytes() for g in grads],
                        [(name, p.asnumpy().tobytes()) for name, p in model.parameters_and_names()]))
    return history


def first_difference(base, other):
    """The first difference between two ``run_steps`` histories, in words, or None."""
    for step, ((lb, gb, pb), (lo, go, po)) in enumerate(zip(base, other)):
        if lb != lo:
            return f"step {step}: loss {np.frombuffer(lb, np.float32)} vs {np.frombuffer(lo, np.float32)}"
        for i, (a, b) in enumerate(zip(gb, go)):
            if a != b:
                return f"step {step}: gradient {i} differs"
        if [n for n, _ in pb] != [n for n, _ in po]:
            return f"step {step}: parameter names differ"
        for (name, a), (_, b) in zip(pb, po):
            if a != b:
                return (f"step {step}: parameter {name} differs ({np.frombuffer(a, np.float32)[:3]} vs "
                        f"{np.frombuffer(b, np.float32)[:3]})")
    return None if len(base) == len(other) else "different number of steps"


def install_api(mode, model):
    """Route every layer call through ``checkpoint`` or ``swap``; returns what counts its work."""
    if mode == "checkpoint_api":
        stats = mac.RecomputeStats()
        object.__setattr__(model, "run_layer", lambda layer, *a, **k: mac.checkpoint(layer, *a, stats=stats, **k))
        return stats
    object.__setattr__(model, "run_layer", lambda layer, *a, **k: mac.swap(layer, *a, **k))
    return mac.SwapManager().report


def offloaded(report):
    return sum(s.num_offloaded for s in report.layers.values()) if report is not None else 0


def ac_work(model):
    """(ops re-run, tensors offloaded) counted by the model's own AC state ((0, 0) without AC)."""
    state = mac.ac_state(model)
    if state is None:
        return 0, 0
    return sum(s.ops_rerun for s in state.recompute_stats.values()), offloaded(state.swap_report)


def assert_acted(mode, model, counter):
    """A mode that silently did nothing must fail: count what was re-run or offloaded."""
    if mode == "checkpoint_api":
        assert counter.ops_rerun > 0 and counter.recompute_calls > 0, counter
        return
    if mode == "swap_api":
        assert offloaded(counter) > 0, counter.as_dict()
        return
    state = mac.ac_state(model)
    if mode in RECOMPUTE_MODES:
        stats = state.recompute_stats.values()
        assert sum(s.ops_rerun for s in stats) > 0 and sum(s.recompute_calls for s in stats) > 0, \
            [s.as_dict() for s in stats]
    if mode in ("exclude_op", "mixed"):
        assert sum(s.ops_reused for s in state.recompute_stats.values()) > 0
    if mode in SWAP_MODES:
        assert offloaded(state.swap_report) > 0, state.swap_report.as_dict()
