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
import statistics
import time

import numpy as np

from ..errors import ConfigError
from ..layer_specs import swappable_layers
from ..training import TrainingRun
from .solver import Option, OptionKind, Profile

# Class names whose outputs "full recompute, keep matmul outputs" keeps: the
# expensive ops of a transformer layer, whose outputs are small next to what
# the layer saves in total.
_MATMUL_CELLS = ("Linear", "Dense")
_MATMUL_OPS = ("MatMul", "BatchMatMul", "MatMulExt")


def candidate_options(layer):
    """The options tried on every layer of a stack whose layers look like ``layer``.

    Select recompute of every composite sub-cell (one with sub-cells of its
    own) up to depth 2, plus all depth-1 composites together; full recompute;
    full recompute keeping the outputs of the layer's matmuls (Linear/Dense
    cells and MatMul primitives, as an ``exclude_op`` dict); layer swap.
    """
    from ..whitelist import layer_inventory
    cells = dict(layer.cells_and_names())
    entries = layer_inventory(layer)
    composites = [e.path for e in entries if e.kind == "cell" and e.path.count(".") <= 1
                  and len(list(cells[e.path].cells_and_names())) > 1]
    options = [Option("none", OptionKind.NONE)]
    options += [Option(f"select {p}", OptionKind.SELECT, select=(p,)) for p in composites]
    top = tuple(p for p in composites if "." not in p)
    if len(top) > 1:
        options.append(Option("select " + " + ".join(top), OptionKind.SELECT, select=top))
    options.append(Option("full", OptionKind.FULL))
    keep = []
    for e in entries:
        if e.kind == "cell" and type(cells[e.path]).__name__ in _MATMUL_CELLS:
            keep.append(e.path)
        elif e.kind == "op" and not any(e.path.startswith(k + ".") for k in keep):
            owner = cells[e.owner_path] if e.owner_path else layer
            if type(getattr(owner, e.attr, None)).__name__ in _MATMUL_OPS:
                keep.append(e.path)
    if keep:
        options.append(Option("full, keep matmuls", OptionKind.FULL, exclude=tuple(keep)))
    options.append(Option("layer swap", OptionKind.SWAP))
    return options


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


def _applied_layers(option, num_layers, prefetch):
    if option.kind == OptionKind.NONE:
        return []
    if option.kind == OptionKind.SWAP:
        return list(swappable_layers(num_layers, prefetch))
    return list(range(num_layers))


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
    from ..layers import find_layer_stack
    from .solver import option_sections
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
            applied = _applied_layers(option, num_layers, prefetch)
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
    base = next(r for r in runs if r.option.kind == OptionKind.NONE)
    base_time = statistics.median(base.times)
    k_opts = len(runs)
    mem = np.full((num_layers, k_opts), np.nan)
    cost = np.full((num_layers, k_opts), np.nan)
    transient = np.zeros((num_layers, k_opts))
    offloaded = 0
    for k, run in enumerate(runs):
        applied = _applied_layers(run.option, num_layers, prefetch) if run.option.kind != OptionKind.NONE \
            else list(range(num_layers))
        delta = statistics.median(run.times) - base_time
        layers = run.memory.layers
        weights = np.array([layers[i].offloaded_bytes for i in applied], float) \
            if run.option.kind == OptionKind.SWAP else np.ones(len(applied))
        if run.option.kind == OptionKind.SWAP:
            offloaded = float(weights.sum())
        weights = weights / weights.sum() if weights.sum() > 0 else np.full(len(applied), 1 / len(applied))
        for w, i in zip(weights, applied):
            mem[i, k] = layers[i].kept_bytes
            transient[i, k] = layers[i].recomputed_bytes
            cost[i, k] = 0.0 if run.option.kind == OptionKind.NONE else delta * w
    bandwidth = host_copy_bandwidth()
    swap_delta = sum(np.nansum(cost[:, k]) for k, r in enumerate(runs) if r.option.kind == OptionKind.SWAP)
    raw_copy = 2 * offloaded / bandwidth   # offload in forward + load back in backward
    overlap = float(np.clip(1 - swap_delta / raw_copy, 0, 1)) if raw_copy > 0 else None
    return Profile(options=[r.option for r in runs], mem=mem, time=cost, transient=transient,
                   other_bytes=int(base.memory.layers["other"].kept_bytes), baseline_step_s=base_time,
                   prefetch=prefetch, host_bandwidth=bandwidth, swap_overlap=overlap,
                   swap_copy_s=raw_copy if raw_copy > 0 else None, swap_cost_s=swap_delta if raw_copy > 0 else None,
                   step_times={r.option.name: statistics.median(r.times) for r in runs},
                   description=description)
