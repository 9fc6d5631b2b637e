"""Measure what each per-layer AC option costs on a model: the planner's input.

``profile_model(factory, ...)`` builds one fresh model per candidate option
with the same factory (``factory() -> (model, make_inputs)``, the contract of
``--model``: ``model(*make_inputs(step))`` is the loss), applies that option
to every layer where it is allowed (``apply_ac``), and steps it with
``training.TrainingRun``, the step runner ``train``'s runs use too
(``value_and_grad`` + SGD, ``StepMeter`` around the step). The models are
stepped round-robin, so slow phases of a shared machine hit every option
alike, and each option's step time is the median of its steps.

From those runs, per layer and option:

* ``mem``: bytes kept for backward at the end of forward (``StepMeter``'s
  per-layer ``kept_bytes``, the same accounting ``train`` reports);
* ``time``: seconds the option adds to one step, the step-time difference to
  the baseline divided evenly over the layers it was applied to (assumes the
  layers are alike: a transformer stack);
* ``transient``: bytes a recompute rebuilds in backward (``recomputed_bytes``).

The swap cost is the measured step-time difference of the swap run, shared
among the swapped layers in proportion to their offloaded bytes. Beside it,
for ``plan``'s report only (the solver doesn't read them): the host copy
bandwidth, one ``np.copyto`` of 32 MiB between two host buffers on this
thread (not the swap backend itself: the CPU backend copies with
``ctypes.memmove``, splitting large tensors between two threads, and a
device backend copies over the device link); ``swap_copy_s``, the time the
offloaded bytes take to copy twice at that bandwidth (out in forward, back
in backward, although the CPU backend's load copies nothing: it aliases the
host buffer); and ``swap_overlap``, the fraction of that time hidden behind
compute (1 - swap cost / copy time, clipped to [0, 1]). All three are
estimates from a host copy, not measurements of the backend.

Run it in synchronous PyNative mode (``mindspore_compat.synchronous_pynative()``, as
``mindformers-ac plan`` does): asynchronous
step times on CPU are bimodal, useless for a cost model. Like every function
of the package, it leaves MindSpore's context to its caller.
"""
import dataclasses
import statistics
import time

import numpy as np

from ..budget.options import OptionSample, applied_layers, candidate_options, interquartile_range, profile_from_samples
from ..budget.solver import OptionKind
from ..errors import ConfigError
from ..layer_specs import swappable_layers
from ..training import TrainingRun


def host_copy_bandwidth(nbytes=32 * 2 ** 20, repeats=7):
    """Bytes per second of ``np.copyto`` between two host buffers (median of ``repeats``)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


class OptionRun:
    """One fresh model with one option applied, stepped by ``training.TrainingRun`` as ``train``'s runs are."""

    def __init__(self, factory, option, config, lr, layers=None, check_loss=None):
        self.option = option
        model, self.make_inputs = factory()
        self.training = TrainingRun(model, config, lr, layers=layers)
        self.model = model
        self.check_loss = check_loss
        self.times, self.memory = [], None   # memory: the recorded step with the most kept bytes

    def step(self, k, record=True):
        loss, _, memory, seconds = self.training.step(self.make_inputs(k))
        if k == 0 and self.check_loss is not None:
            self.check_loss(loss)
        if record:
            self.times.append(seconds)
            # train reports its peak step, so the profile keeps the same one
            if self.memory is None or memory.kept_bytes > self.memory.kept_bytes:
                self.memory = memory

    def close(self):
        from ..apply import ac_state, remove_ac
        if ac_state(self.model) is not None:
            remove_ac(self.model)


def profile_model(factory, *, layers=None, prefetch=1, steps=12, warmup=2, lr=0.05, options=None,
                  description="", check_loss=None):
    """Profile every option of ``candidate_options`` (or ``options``) on models from ``factory``.

    ``factory()`` must return ``(model, make_inputs)``: a fresh model with the
    same weights each call, and ``make_inputs(step)`` the tuple the model is
    called with in step ``step`` (``model(*make_inputs(step))`` is the loss).
    ``layers`` names the layer list when ``find_layer_stack`` can't find it.
    ``check_loss(loss)`` (optional) sees the loss of each model's first step,
    the very first step of the profile included, and may raise to stop it.
    ``steps`` timed steps per option after ``warmup`` untimed ones. Returns a
    ``Profile``. Raises ``ConfigError`` for a ``prefetch`` outside
    ``[1, num_layers - 1]`` or if ``plan_ac`` rejects an option on this model
    (e.g. a layer list it can't find).
    """
    from ..budget.solver import option_sections
    from ..layers import find_layer_stack
    probe, _ = factory()
    stack = find_layer_stack(probe, layers)
    num_layers = stack.num_layers
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 1 <= prefetch <= max(1, num_layers - 1):
        raise ConfigError("swap.default_prefetch", f"must be in [1, {max(1, num_layers - 1)}] for a model with "
                                                   f"{num_layers} layers, got {prefetch!r}")
    if options is None:
        options = candidate_options(stack.cell(stack.layer_ids[0]))
    options = [o for o in options if not (o.kind == OptionKind.SWAP and not swappable_layers(num_layers, prefetch))]
    del probe
    runs = []
    try:
        for option in options:
            applied = applied_layers(option, num_layers, prefetch)
            config = option_sections({i: option for i in applied}, prefetch) if applied else None
            runs.append(OptionRun(factory, option, config, lr, layers, check_loss))
        _step_interleaved(runs, warmup, steps)
        return _profile_from_runs(runs, num_layers, prefetch, description)
    finally:
        for run in runs:
            run.close()


def _step_interleaved(runs, warmup, steps):
    # One step of each run in turn, so load changes on shared cores hit every run alike;
    # the order alternates so that no run always goes first.
    for k in range(warmup + steps):
        for run in runs if k % 2 == 0 else runs[::-1]:
            run.step(k, record=k >= warmup)


def measure_configs(factory, configs, *, layers=None, steps=12, warmup=2, lr=0.05):
    """Train one fresh model per config (``None``: no AC) side by side, interleaved step by step.

    ``factory`` and ``layers`` as in ``profile_model``. Returns
    ``[(median step seconds, peak kept bytes)]`` in ``configs`` order: the
    measurement ``plan``'s predictions are checked against.
    """
    runs = [OptionRun(factory, None, config, lr, layers) for config in configs]
    try:
        _step_interleaved(runs, warmup, steps)
        return [(statistics.median(run.times), run.memory.kept_bytes) for run in runs]
    finally:
        for run in runs:
            run.close()


def _profile_from_runs(runs, num_layers, prefetch, description):
    samples = [OptionSample(r.option, applied_layers(r.option, num_layers, prefetch), statistics.median(r.times),
                            r.memory) for r in runs]
    profile = profile_from_samples(samples, num_layers, prefetch, description)
    offloaded = sum(r.memory.layers[i].offloaded_bytes for r, s in zip(runs, samples)
                    if r.option.kind == OptionKind.SWAP for i in s.applied)
    bandwidth = host_copy_bandwidth()
    swap_delta = sum(np.nansum(profile.time[:, k]) for k, r in enumerate(runs) if r.option.kind == OptionKind.SWAP)
    raw_copy = 2 * offloaded / bandwidth   # offload in forward + load back in backward
    overlap = float(np.clip(1 - swap_delta / raw_copy, 0, 1)) if raw_copy > 0 else None
    return dataclasses.replace(profile, host_bandwidth=bandwidth, swap_overlap=overlap,
                               swap_copy_s=raw_copy if raw_copy > 0 else None,
                               swap_cost_s=swap_delta if raw_copy > 0 else None,
                               time_spread_s=max(interquartile_range(r.times) for r in runs))
