"""Training steps the exactness tests compare, and the check that an AC mode acted.

``run_steps`` trains a model with SGD and records, per step, the loss, every
gradient and every parameter (trainable or not) as bytes; ``first_difference``
names the first place two such histories differ. ``install_api`` routes a
pattern model's layer calls through ``checkpoint`` / ``swap`` (the API modes);
``assert_acted`` fails a mode that silently did nothing.
"""
import collections

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.utils import MsDispatchMode

import mindformers_ac as mac
from mindformers_ac.harness.pipeline import summed
from mindformers_ac.mindspore_compat import pynative_executor
from mindformers_ac.recompute.dispatch import op_name_of

from model_patterns import RECOMPUTE_MODES, SWAP_MODES, InjectedFailure, mode_config


def _record(model, loss, grads):
    return (loss.asnumpy().tobytes(), [g.asnumpy().tobytes() for g in grads],
            [(name, p.asnumpy().tobytes()) for name, p in model.parameters_and_names()])


def run_steps(model, batch, steps=3, skip_nonfinite=False, fail_at=None):
    """Per step: loss bytes, every gradient's bytes, and every parameter's (name, bytes) after the update.

    ``skip_nonfinite``: a step whose loss is NaN/Inf updates nothing (what a loss scaler does).
    ``fail_at``: before that step, a forward that raises ``InjectedFailure`` inside layer 1 (its
    ``fail`` flag) is caught and the executor cleared, as a loop that skips a bad batch does.
    """
    model.set_train(True)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history = []
    for step in range(steps):
        if step == fail_at:
            _failed_forward(model, grad_fn, batch(step))
        loss, grads = grad_fn(*batch(step))
        if not skip_nonfinite or np.isfinite(loss.asnumpy()).all():
            opt(grads)
        history.append(_record(model, loss, grads))
    return history


def _failed_forward(model, grad_fn, inputs):
    layer = model.layers[1]
    layer.fail = True
    try:
        grad_fn(*inputs)
    except InjectedFailure:
        failed = True
    else:
        failed = False
    finally:
        layer.fail = False
    assert failed, "the injected failure did not raise"
    pynative_executor.clear_res()   # docs/exactness.md's failure path, as without AC


def run_steps_removing_ac(model, batch, steps=3):
    """``run_steps`` through ``ms.vjp``; the last step's forward runs with AC, then ``remove_ac`` (a
    callback or a ``finally:`` that turns AC off), then its backward."""
    model.set_train(True)
    params = model.trainable_params()
    opt = nn.SGD(params, learning_rate=0.05)
    history = []
    for step in range(steps):
        first, *rest = batch(step)   # only the float input is differentiated (the others are int and bool)
        loss, vjp_fn = ms.vjp(lambda x: model(x, *rest), first, weights=params)
        if step == steps - 1 and mac.ac_state(model) is not None:
            mac.remove_ac(model)
        _, grads = vjp_fn(ms.Tensor(1.0, ms.float32))
        opt(grads)
        history.append(_record(model, loss, grads))
    return history


def run_steps_gpipe(model, batch, steps=2, microbatches=4):
    """GPipe order in one process: every microbatch's forward (``ms.vjp``, batches ``batch(step * M + k)``) before
    any backward, the backwards last microbatch first, the gradients summed in that order, one SGD step. Per
    step the record holds the microbatches' losses (stacked), the summed gradients and every parameter."""
    model.set_train(True)
    params = model.trainable_params()
    opt = nn.SGD(params, learning_rate=0.05)
    history = []
    for step in range(steps):
        in_flight = []
        for k in range(microbatches):
            first, *rest = batch(step * microbatches + k)   # the float input is differentiated, as in ms.vjp's use
            in_flight.append(ms.vjp(lambda x, rest=rest: model(x, *rest), first, weights=params))
        total = None
        for _, vjp_fn in reversed(in_flight):
            _, grads = vjp_fn(ms.Tensor(1.0, ms.float32))
            total = summed(total, grads)
        opt(total)
        history.append(_record(model, ms.ops.stack([loss for loss, _ in in_flight]), total))
        del in_flight
    return history


def train_pattern(pattern, model, steps=3):
    """``model`` trained as ``pattern.loop`` says (see ``model_patterns.Pattern``)."""
    if pattern.loop == "gpipe":
        # one step: 4 forwards of each nn.Dropout already, and its CPU kernel repeats its draws in a second
        # build for 5 calls only (harness.models.use_nn_dropout), so more steps would compare two builds' masks
        return run_steps_gpipe(model, pattern.batch, steps=1)
    if pattern.loop == "remove_mid_step":
        return run_steps_removing_ac(model, pattern.batch, steps)
    return run_steps(model, pattern.batch, steps, skip_nonfinite=pattern.loop == "skip_nonfinite",
                     fail_at=1 if pattern.loop == "failed_forward" else None)


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


def layer_list(model, path="layers"):
    """The layer list at the dotted ``path`` of ``model``."""
    for part in path.split("."):
        model = getattr(model, part)
    return list(model)


def install_api(mode, model, pattern=None):
    """Route every layer call through ``checkpoint`` or ``swap``, each layer call a block of
    ``async_save_on_cpu`` (``run_layer``), or wrap each layer with ``checkpoint_wrapper`` and HyperParallel's
    ``exclude_policy`` of ``pattern.kept_ops`` (``hyper_api``); returns what counts its work."""
    if mode == "checkpoint_api":
        stats = mac.RecomputeStats()
        object.__setattr__(model, "run_layer", lambda layer, *a, **k: mac.checkpoint(layer, *a, stats=stats, **k))
        return stats
    if mode == "hyper_api":
        stats = mac.RecomputeStats()
        policy = mac.recompute.exclude_policy(list(pattern.kept_ops) if pattern is not None else ["MatMul"])
        for layer in dict.fromkeys(layer_list(model, pattern.layers if pattern is not None else "layers")):
            mac.checkpoint_wrapper(layer, policy_fn=policy, stats=stats)
        return stats
    if mode == "async_save_on_cpu":
        layers = layer_list(model, pattern.layers if pattern is not None else "layers")

        def run_layer(layer, *args, **kwargs):
            if layer not in layers:   # a block outside the layer list (an MTP layer): as it is
                return layer(*args, **kwargs)
            with mac.async_save_on_cpu(block_idx=layers.index(layer), depth=len(layers), params=model):
                return layer(*args, **kwargs)
        object.__setattr__(model, "run_layer", run_layer)
        return mac.SwapManager().report
    object.__setattr__(model, "run_layer", lambda layer, *a, **k: mac.swap(layer, *a, **k))
    return mac.SwapManager().report


def install_mode(mode, pattern, model):
    """``mode`` on ``model``: apply_ac's ``mode_config`` or the API (``install_api``); returns the API's
    counter (None for apply_ac)."""
    config = mode_config(mode, pattern)
    if config is None:
        return install_api(mode, model, pattern)
    mac.apply_ac(model, config=config, layers=pattern.layers)
    return None


def offloaded(report):
    return sum(s.num_offloaded for s in report.layers.values()) if report is not None else 0


def ac_work(model):
    """(ops re-run, tensors offloaded) counted by the model's own AC state ((0, 0) without AC)."""
    state = mac.ac_state(model)
    if state is None:
        return 0, 0
    return sum(s.ops_rerun for s in state.recompute_stats.values()), offloaded(state.swap_report)


def ac_counters(model):
    """``(recompute_stats, swap_report)`` of the model's AC, taken before training for ``assert_acted``
    (``remove_ac`` detaches them from the model); None without AC."""
    state = mac.ac_state(model)
    return None if state is None else (state.recompute_stats, state.swap_report)


def assert_acted(mode, model, counter, counters=None):
    """A mode that silently did nothing must fail: count what was re-run or offloaded. ``counters``:
    ``ac_counters(model)`` taken before a ``remove_ac``."""
    if mode in ("checkpoint_api", "hyper_api"):
        assert counter.ops_rerun > 0 and counter.recompute_calls > 0, counter
        if mode == "hyper_api":
            assert counter.ops_reused > 0, counter   # the policy kept ops
        return
    if mode in ("swap_api", "async_save_on_cpu"):
        assert offloaded(counter) > 0, counter.as_dict()
        return
    recompute_stats, swap_report = counters if counters is not None else ac_counters(model)
    if mode in RECOMPUTE_MODES:
        stats = recompute_stats.values()
        assert sum(s.ops_rerun for s in stats) > 0 and sum(s.recompute_calls for s in stats) > 0, \
            [s.as_dict() for s in stats]
    if mode == "group":   # the later members did not keep their first argument
        assert sum(s.chained_calls for s in recompute_stats.values()) > 0, [s.as_dict() for s in stats]
    if mode in ("exclude_op", "mixed"):
        assert sum(s.ops_reused for s in recompute_stats.values()) > 0
    if mode in SWAP_MODES:
        assert offloaded(swap_report) > 0, swap_report.as_dict()


class CountOps(MsDispatchMode):
    """Counts every op dispatched while it is entered, by name (``counts``): an outer dispatch mode sees the
    ops a recompute re-runs too, so what really ran is counted."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __ms_dispatch__(self, func, args, kwargs=None):
        self.counts[op_name_of(func, args)] += 1
        return func(*args, **(kwargs or {}))
