"""What the budget planners try on a layer, and the ``Profile`` built from steps measured under each option.

``candidate_options(layer)`` lists the options (``solver.Option``) for every
layer of a stack whose layers look like ``layer``. ``profile_from_samples``
turns one measured step per option (an ``OptionSample``: which option, on
which layers, the step time, the step's ``StepMemory``) into the solver's
``Profile``; ``profile_with_noise`` does so from the steps of a user's run
(``memory_budget``), where an option may have several (the median time), and
fills the profile's ``time_spread_s`` from what those steps measured of their
own noise. The offline profiler (``planner.profile``, a fresh model per
option) and the ``memory_budget`` controller (the user's own steps: one per
option, more where ``profile_steps`` allows) both build their profile here, so the two read their measurements the
same way:

* ``mem[l, k]``: bytes layer ``l`` kept for backward at the end of forward;
* ``transient[l, k]``: bytes a recompute rebuilds in backward (``recomputed_bytes``);
* ``time[l, k]``: the step-time difference to the ``none`` sample, shared
  evenly among the layers the option was applied to (layers alike: a
  transformer stack), or, for layer swap, in proportion to what each layer
  offloaded.
"""
import statistics
from dataclasses import dataclass

import numpy as np

from ..layer_specs import swappable_layers
from .solver import Option, OptionKind, Profile

BELOW_BASELINE = "how far an option's step measured below the step without AC (options add work: that is noise)"

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


def applied_layers(option, num_layers, prefetch):
    """The layer indices ``option`` is applied to when profiled: none, the swappable ones, or all."""
    if option.kind == OptionKind.NONE:
        return []
    if option.kind == OptionKind.SWAP:
        return list(swappable_layers(num_layers, prefetch))
    return list(range(num_layers))


@dataclass
class OptionSample:
    """One option measured over a step: ``applied`` the layer ids it was applied to, ``seconds`` the step
    time (a median over steps where there were several), ``memory`` the step's ``StepMemory``."""

    option: Option
    applied: list
    seconds: float
    memory: object


def interquartile_range(times):
    """The middle half's width of one option's step times (0 for fewer than four): how far this machine's
    load moved them (``plan --budget`` reads its 12 this way)."""
    if len(times) < 4:
        return 0.0
    low, _, high = statistics.quantiles(times, n=4)
    return high - low


def step_time_spread(times):
    """How far one option's repeated step times moved: the ``interquartile_range`` of four or more, the
    whole range of two or three (too few for quartiles), 0 for one."""
    if len(times) >= 4:
        return interquartile_range(times)
    return max(times) - min(times) if times else 0.0


def merge_repeats(samples):
    """``(one OptionSample per option, the widest step_time_spread)`` of ``samples``, where several steps may
    have timed one option: the median of its step times, the memory of its first step (an option keeps the
    same bytes at the same shapes); options in the order of their first step."""
    steps = {}
    for sample in samples:
        steps.setdefault(sample.option, []).append(sample)
    merged = [OptionSample(option, runs[0].applied, statistics.median(s.seconds for s in runs), runs[0].memory)
              for option, runs in steps.items()]
    return merged, max((step_time_spread([s.seconds for s in runs]) for runs in steps.values()), default=0.0)


def profile_with_noise(steps, num_layers, prefetch, description=""):
    """``profile_from_samples`` of ``steps`` (``OptionSample``s, the baseline's first; an option may have
    several: ``merge_repeats``), with ``Profile.time_spread_s`` what these steps measured of their own noise:
    the widest spread of one option's repeated step times, or how far an option's step measured below the
    step without AC (an option adds work to a step, never takes any away: that much is noise), whichever is
    larger. One step per option and none below the baseline: 0, and ``timing_noise`` is its floor."""
    samples, spread = merge_repeats(steps)
    profile = profile_from_samples(samples, num_layers, prefetch, description=description)
    profile.time_spread_s = spread
    below = samples[0].seconds - min((s.seconds for s in samples[1:]), default=samples[0].seconds)
    if below > spread:
        profile.time_spread_s, profile.time_spread_what = below, BELOW_BASELINE
    return profile


def profile_from_samples(samples, num_layers, prefetch, description=""):
    """The ``Profile`` of one ``OptionSample`` per option; the ``none`` sample is the baseline.

    An option not applied to a layer (layer swap on the last ``prefetch``
    layers) is ``nan`` there: not allowed. The host-copy fields are left to the caller.
    """
    base = next(s for s in samples if s.option.kind == OptionKind.NONE)
    mem = np.full((num_layers, len(samples)), np.nan)
    cost = np.full((num_layers, len(samples)), np.nan)
    transient = np.zeros((num_layers, len(samples)))
    for k, sample in enumerate(samples):
        applied = list(range(num_layers)) if sample.option.kind == OptionKind.NONE else sample.applied
        if not applied:
            continue
        layers = sample.memory.layers
        weights = np.array([layers[i].offloaded_bytes for i in applied], float) \
            if sample.option.kind == OptionKind.SWAP else np.ones(len(applied))
        weights = weights / weights.sum() if weights.sum() > 0 else np.full(len(applied), 1 / len(applied))
        delta = sample.seconds - base.seconds
        for w, i in zip(weights, applied):
            mem[i, k] = layers[i].kept_bytes
            transient[i, k] = layers[i].recomputed_bytes
            cost[i, k] = 0.0 if sample.option.kind == OptionKind.NONE else delta * w
    return Profile(options=[s.option for s in samples], mem=mem, time=cost, transient=transient,
                   other_bytes=int(base.memory.layers["other"].kept_bytes), baseline_step_s=base.seconds,
                   prefetch=prefetch, step_times={s.option.name: s.seconds for s in samples},
                   description=description)
