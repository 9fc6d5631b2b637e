"""Memory-budget planner: choose one AC option per layer so activation memory fits a budget.

The input is a ``Profile`` (measured by ``planner.profile.profile_model``):
per layer ``l`` and option ``k``, ``mem[l, k]`` bytes kept for backward at the
end of forward and ``time[l, k]`` seconds added to a training step. The cost
model is additive:

    peak(choice)      = other_bytes + sum_l mem[l, choice[l]]
    step_time(choice) = baseline_step_s + sum_l max(0, time[l, choice[l]])

``peak`` is exactly the figure ``train`` reports (``StepMeter``'s kept bytes
at the end of forward). Recompute also rebuilds one region at a time in
backward, and prefetch brings swapped layers back ahead of use: ``plan_budget``
(``plan --budget``) reports that transient beside the peak, ``plan_within``
(``memory_budget``) bounds the real peak, kept bytes plus the largest rebuild
plus the prefetched layers (``BudgetPlan.backward_peak``). Negative measured time deltas are noise
(an option never makes a step faster) and count as 0.

``plan_budget`` solves the multiple-choice knapsack "one option per layer,
least step time, peak <= budget" with an exact dynamic programme over the
memory axis discretised into ``resolution`` steps (item sizes rounded up, so
every answer really fits), then a repair pass on exact byte counts that
takes back what the rounding lost. Options not allowed on a layer (swap of a
layer with ``i + prefetch >= num_layers``) are excluded (pipeline stages are
planned one by one, each with its own bounds: ``planner.stages``); options are exclusive per layer, so recompute and swap never share
a layer. ``BudgetPlan.sections()`` writes the ``recompute``,
``recompute_comm`` and ``swap`` sections ``apply_ac`` and ``train`` take.
"""
import enum
from dataclasses import dataclass, field

import numpy as np
import yaml

from ..actions import FullRecompute, LayerSwap, SelectRecompute, layer_lists
from ..config import AcConfig, SwapConfig, with_layer_lists
from ..errors import ConfigError
from ..layer_specs import format_layer_specs, prefetch_trigger_id, swappable_layers
from ..plan import LayerPlan
from ..tensors import MiB
from .sizes import format_bytes

# Step-time differences below this fraction of a step are noise to the planners: a step on a shared CPU moves
# by that much between runs of the same command (the step without AC for plan --budget's medians; the
# fastest plan's predicted step for memory_budget's single steps, which are longer than the baseline's).
TIME_NOISE = 0.10
SPREAD_OF_REPEATS = "the widest spread of one option's step times in this profile"
MISSED = "how far the first choice's measured step missed its predicted time"


class OptionKind(str, enum.Enum):
    """What an ``Option`` does to a layer."""

    NONE = "none"
    SELECT = "select"
    FULL = "full"
    SWAP = "swap"



@dataclass(frozen=True)
class Option:
    """One thing the planner can do to a layer.

    ``kind`` is ``none``, ``select`` (recompute the cells in ``select``),
    ``full`` (recompute the layer, keeping the outputs of the paths in
    ``exclude``) or ``swap`` (layer swap).
    """

    name: str
    kind: OptionKind
    select: tuple = ()
    exclude: tuple = ()

    def actions(self, layer_id, prefetch):
        """The plan actions (``actions.Action``) this option takes on layer ``layer_id``."""
        if self.kind == OptionKind.SELECT:
            return [SelectRecompute(self.select)]
        if self.kind == OptionKind.FULL:
            return [FullRecompute(keep=self.exclude, keep_by_path=True)]
        if self.kind == OptionKind.SWAP:
            return [LayerSwap(prefetch_trigger_id(layer_id, prefetch))]
        return []


@dataclass
class Profile:
    """Measured per-layer, per-option figures of one model (see the module docstring).

    ``mem``, ``time`` and ``transient`` are ``(num_layers, num_options)``
    arrays; ``nan`` in ``mem`` marks an option that was not measured (and is
    therefore not allowed) on that layer. Option 0 must be ``none``.
    """

    options: list
    mem: np.ndarray
    time: np.ndarray
    transient: np.ndarray
    other_bytes: int
    baseline_step_s: float
    prefetch: int = 1
    host_bandwidth: float = None      # bytes/s of a host copy on this machine
    swap_overlap: float = None        # fraction of swap copy time hidden behind compute
    swap_copy_s: float = None         # raw host copy time (out and back) of the profiled swap run, per step
    swap_cost_s: float = None         # step time that swap run measured on top of the baseline
    step_times: dict = field(default_factory=dict)   # option name -> median step time, all layers
    # seconds by which this profile's own step times moved (``timing_noise`` widens to it): the widest spread
    # of one option's repeated step times (``plan --budget``; ``memory_budget`` with spare profiling steps),
    # how far an option's step measured below the baseline, or how far a plan's measured step missed its
    # prediction (``memory_budget``'s check); ``time_spread_what`` says which, in words
    time_spread_s: float = 0.0
    time_spread_what: str = SPREAD_OF_REPEATS
    description: str = ""

    @property
    def num_layers(self):
        return self.mem.shape[0]

    @property
    def baseline_peak(self):
        return int(self.other_bytes + self.mem[:, 0].sum())

    def allowed(self, prefetch=None):
        """Boolean ``(num_layers, num_options)``: measured, and legal under ``prefetch``."""
        p = self.prefetch if prefetch is None else prefetch
        ok = ~np.isnan(self.mem)
        for k, option in enumerate(self.options):
            if option.kind == OptionKind.SWAP:
                ok[:, k] &= np.isin(np.arange(self.num_layers), swappable_layers(self.num_layers, p))
        return ok


def _fits(mem, choice, capacity):
    return mem[np.arange(len(choice)), choice].sum() <= capacity * (1 + 1e-12)


def solve(mem, cost, allowed, capacity, resolution=20000):
    """Least ``sum cost[l, c[l]]`` with ``sum mem[l, c[l]] <= capacity``, one allowed option per layer.

    Returns the choice as an int array, or ``None`` when even the least
    memory of every layer exceeds ``capacity``. Exact up to the memory
    discretisation (``resolution`` steps of the slack above the per-layer
    minimum, sizes rounded up), which the final repair pass mostly undoes.
    Runs in O(layers x options x resolution) numpy work: ~70 ms for 128 x 8 on 2 cores.
    """
    mem = np.where(allowed, mem, np.inf)
    cost = np.where(allowed, np.maximum(cost, 0.0), np.inf)
    if not allowed.any(axis=1).all():
        raise ValueError("every layer needs at least one allowed option")
    floor = mem.min(axis=1)
    slack = capacity - floor.sum()
    if slack < 0:
        return None
    num_layers, num_options = mem.shape
    cheapest = np.argmin(cost, axis=1)
    if _fits(mem, cheapest, capacity):
        return _repair(mem, cost, cheapest, capacity)
    unit = max(slack, 1e-9) / resolution      # slack 0: only each layer's least-memory options fit
    extra = mem - floor[:, None]
    with np.errstate(invalid="ignore"):
        weight = np.where(np.isfinite(extra), np.ceil(extra / unit - 1e-9), resolution + 1)
    weight = np.where(weight > resolution, resolution + 1, weight).astype(np.int64)
    size = resolution + 1
    dp = np.zeros(size)                        # dp[b]: least cost of the layers so far within b units
    back = np.zeros((num_layers, size), np.int8 if num_options < 128 else np.int32)
    cand = np.empty((num_options, size))
    for layer in range(num_layers):
        cand.fill(np.inf)
        for k in range(num_options):
            w = weight[layer, k]
            if w < size and np.isfinite(cost[layer, k]):
                cand[k, w:] = dp[:size - w] + cost[layer, k]
        back[layer] = np.argmin(cand, axis=0)
        dp = cand[back[layer], np.arange(size)]
    choice = np.zeros(num_layers, np.int64)
    b = resolution
    for layer in range(num_layers - 1, -1, -1):
        choice[layer] = back[layer, b]
        b -= weight[layer, choice[layer]]
    if not _fits(mem, choice, capacity):    # float rounding at the very edge: start from the floor
        choice = np.argmin(mem, axis=1)
    return _repair(mem, cost, choice, capacity)


def _repair(mem, cost, choice, capacity):
    """Greedy single-layer moves, on exact bytes: the cheapest-per-time improvement that still fits."""
    choice = choice.copy()
    rows = np.arange(len(choice))
    for _ in range(4 * len(choice)):
        total = mem[rows, choice].sum()
        gain = cost[rows, choice][:, None] - cost             # time saved by moving layer l to k
        fits = total - mem[rows, choice][:, None] + mem <= capacity * (1 + 1e-12)
        gain = np.where(fits & np.isfinite(cost), gain, 0.0)
        layer, k = np.unravel_index(np.argmax(gain), gain.shape)
        if gain[layer, k] <= 1e-15:
            break
        choice[layer] = k
    return choice


@dataclass
class BudgetPlan:
    """The planner's answer: one option per layer and what the cost model predicts for it."""

    profile: Profile
    budget: int
    choice: list
    tie: str = None   # plan_within: why a slightly faster plan was passed over for fewer bytes

    @property
    def options(self):
        """Global layer id -> chosen ``Option``."""
        return {i: self.profile.options[k] for i, k in enumerate(self.choice)}

    @property
    def predicted_peak(self):
        p = self.profile
        return int(p.other_bytes + sum(p.mem[i, k] for i, k in enumerate(self.choice)))

    @property
    def predicted_step_s(self):
        p = self.profile
        return p.baseline_step_s + sum(max(0.0, p.time[i, k]) for i, k in enumerate(self.choice))

    @property
    def transient_bytes(self):
        """Largest region a chosen recompute rebuilds in backward (on top of ``predicted_peak``)."""
        return int(max((self.profile.transient[i, k] for i, k in enumerate(self.choice)), default=0))

    @property
    def prefetch_bytes(self):
        """What prefetch brings back ahead of use: the ``prefetch`` largest offloads of the swapped layers."""
        offload = swap_offload(self.profile)
        swapped = sorted((offload[i, k] for i, k in enumerate(self.choice)
                          if self.profile.options[k].kind == OptionKind.SWAP), reverse=True)
        return int(sum(swapped[:self.profile.prefetch]))

    @property
    def backward_peak(self):
        """The real peak the cost model bounds: kept bytes, the largest rebuild and the prefetched bytes."""
        return self.predicted_peak + self.transient_bytes + self.prefetch_bytes

    def sections(self):
        return option_sections(self.options, self.profile.prefetch)

    def to_yaml(self):
        head = (f"# mindformers-ac plan: budget {format_bytes(self.budget)}; predicted peak activation "
                f"{format_bytes(self.predicted_peak)} (baseline {format_bytes(self.profile.baseline_peak)}), "
                f"step {self.predicted_step_s * 1000:.1f} ms (baseline "
                f"{self.profile.baseline_step_s * 1000:.1f} ms)\n")
        return head + yaml.safe_dump(self.sections(), sort_keys=False, default_flow_style=None)

    def summary(self):
        """Runs of layers with the same option: ``0-3: full; 4-6: layer swap; 7: none``."""
        return summarize(self.options)

    def report(self):
        p = self.profile
        lines = [f"budget: {format_bytes(self.budget)}  ({self.budget / p.baseline_peak:.2f}x baseline)",
                 f"plan:   {self.summary()}",
                 f"{'':24}{'baseline':>12}{'planned':>12}",
                 f"{'peak activation memory':24}{p.baseline_peak / MiB:>8.2f} MiB"
                 f"{self.predicted_peak / MiB:>8.2f} MiB",
                 f"{'step time':24}{p.baseline_step_s * 1000:>9.1f} ms{self.predicted_step_s * 1000:>9.1f} ms",
                 f"backward recompute transient (not in the peak): {format_bytes(self.transient_bytes)}"]
        if self.tie:
            lines.append(f"a tie: {self.tie}")
        if p.host_bandwidth:
            lines.append(f"host copy bandwidth {p.host_bandwidth / 2 ** 30:.2f} GiB/s")
        if p.swap_copy_s is not None:
            why = (f"{p.swap_overlap:.0%} of the copy hidden behind compute" if p.swap_cost_s < p.swap_copy_s
                   else "more than the copies: per-tensor overhead dominates, nothing to hide")
            lines.append(f"profiled swap: +{p.swap_cost_s * 1000:.1f} ms/step for {p.swap_copy_s * 1000:.1f} ms "
                         f"of raw copies ({why})")
        return "\n".join(lines)


def summarize(options):
    runs, ids = [], sorted(options)
    for i in ids:
        if runs and runs[-1][1] == options[i].name and runs[-1][0][-1] == i - 1:
            runs[-1][0].append(i)
        else:
            runs.append(([i], options[i].name))
    return "; ".join(f"{format_layer_specs(layers)[0]}: {name}" for layers, name in runs)


def option_sections(options, prefetch=1):
    """``{layer id: Option}`` -> the ``recompute``, ``recompute_comm``, ``swap`` sections (a dict).

    Each option is the plan actions it stands for (``Option.actions``), written back as every plan is
    (``actions.layer_lists``): select paths and ``exclude`` paths become exact-path patterns, ``full``
    with ``exclude`` a dict-form ``exclude_op`` limited to those layers; both full and select layers give
    ``mode: select`` with ``full_recompute_layer``.
    """
    return option_config(options, AcConfig(swap=SwapConfig(default_prefetch=prefetch)), prefetch).to_dict()


def option_config(options, base, prefetch):
    """``base`` (an ``AcConfig``) with its layer lists replaced by what ``{layer id: Option}`` does."""
    plans = [LayerPlan(i, actions=options[i].actions(i, prefetch)) for i in sorted(options)]
    return with_layer_lists(base, **layer_lists(plans))


def minimum_peak(profile, prefetch=None):
    """(least reachable peak bytes, ``{layer: Option}`` that reaches it)."""
    allowed = profile.allowed(prefetch)
    mem = np.where(allowed, profile.mem, np.inf)
    best = np.argmin(mem, axis=1)
    return (int(profile.other_bytes + mem[np.arange(len(best)), best].sum()),
            {i: profile.options[k] for i, k in enumerate(best)})


def plan_budget(profile, budget, prefetch=None, resolution=20000):
    """The least-step-time ``BudgetPlan`` whose predicted peak fits ``budget`` bytes; of plans predicted within
    ``timing_noise`` of it, the one of least bytes (``_settle_ties``: ``BudgetPlan.tie`` says so).

    Raises ``ConfigError("--budget", ...)`` when the budget is below the least
    reachable peak, saying that minimum and which options reach it.
    """
    allowed = profile.allowed(prefetch)
    capacity = budget - profile.other_bytes
    choice = solve(profile.mem, profile.time, allowed, capacity, resolution) if capacity >= 0 else None
    if choice is None:
        least, options = minimum_peak(profile, prefetch)
        raise ConfigError("--budget", f"{format_bytes(budget)} is below the least reachable peak "
                                      f"activation memory {format_bytes(least)} ({least} bytes, "
                                      f"{least / profile.baseline_peak:.2f}x baseline), reached with "
                                      f"{summarize(options)}; ask for at least that much")
    p = profile.prefetch if prefetch is None else prefetch
    fastest = BudgetPlan(profile=profile, budget=int(budget), choice=[int(k) for k in choice])
    # the least bytes among the plans within the timing noise of the fastest: the same knapsack with the
    # roles swapped (least kept bytes within the fastest's added time plus the noise); it fits the budget,
    # since the fastest is one of them
    time_cap = fastest.predicted_step_s - profile.baseline_step_s + timing_noise(profile)
    least = solve(np.maximum(profile.time, 0.0), np.where(allowed, profile.mem, np.inf), allowed, time_cap)
    candidates = [fastest]
    if least is not None:
        candidates.append(BudgetPlan(profile=profile, budget=int(budget), choice=[int(k) for k in least]))
    plan = _settle_ties([c for c in candidates if c.predicted_peak <= budget], profile,
                        peak=lambda c: c.predicted_peak)
    plan.profile = _with_prefetch(profile, p)
    return plan


def _settle_ties(fitting, profile, peak, single_steps=False):
    """The plan of ``fitting`` (``BudgetPlan``s that fit) to choose: the fastest, unless others are predicted
    within ``timing_noise`` of it: then the one of least ``peak(plan)`` bytes (then the
    fastest of those, then the first option in the profile's order), with ``tie`` saying so. Times that close
    move between two runs of the same command; bytes do not. ``single_steps``: the times are single steps
    (``plan_within``), whose noise is a fraction of the steps compared: the fastest plan's predicted step."""
    fastest = min(fitting, key=lambda c: (c.predicted_step_s, peak(c), c.choice))
    if not any(fastest.choice):
        return fastest   # the model fits the budget without AC: nothing to trade, no AC
    step_s = fastest.predicted_step_s if single_steps else None
    noise = timing_noise(profile, step_s)
    tied = [c for c in fitting if c.predicted_step_s <= fastest.predicted_step_s + noise]
    best = min(tied, key=lambda c: (peak(c), c.predicted_step_s, c.choice))
    if best.choice != fastest.choice:
        best.tie = (f"{fastest.summary()} was predicted {(best.predicted_step_s - fastest.predicted_step_s) * 1000:.1f} "
                    f"ms faster, within the timing noise ({noise_source(profile, step_s)}): chosen by bytes, "
                    f"{format_bytes(peak(best))} against {format_bytes(peak(fastest))}")
    return best


def timing_noise(profile, step_s=None):
    """Seconds of predicted step time within which two plans tie: ``TIME_NOISE`` of ``step_s`` (the step the
    plans compared are predicted to take; by default the step without AC), or how far the profile's own step
    times moved (``Profile.time_spread_s``: the spread of one option's repeated steps, a step below the
    baseline, or a plan's measured step against its prediction; a loaded machine moves a step by as much
    between two runs), whichever is larger."""
    return max(_noise_floor(profile, step_s), profile.time_spread_s)


def _noise_floor(profile, step_s=None):
    """``TIME_NOISE`` of ``step_s``, or of the step without AC by default."""
    return TIME_NOISE * (profile.baseline_step_s if step_s is None else step_s)


def widened_by_miss(profile, plan, measured_step_s):
    """``profile`` with its timing noise widened to how far ``plan``'s measured step (a second timing of its
    options) missed the step time predicted for it, if that is more than ``timing_noise``; else None."""
    miss = abs(measured_step_s - plan.predicted_step_s)
    if miss <= timing_noise(profile, plan.predicted_step_s):
        return None
    return Profile(**{**profile.__dict__, "time_spread_s": miss, "time_spread_what": MISSED})


def noise_source(profile, step_s=None):
    """What ``timing_noise(profile, step_s)`` is, in words."""
    step = (f"{profile.baseline_step_s * 1000:.1f} ms step without AC" if step_s is None else
            f"{step_s * 1000:.1f} ms step predicted for the fastest plan")
    if profile.time_spread_s > _noise_floor(profile, step_s):
        return f"{profile.time_spread_s * 1000:.1f} ms, {profile.time_spread_what}, over {TIME_NOISE:.0%} of the {step}"
    return f"{TIME_NOISE:.0%} of the {step}"


def _with_prefetch(profile, prefetch):
    if prefetch == profile.prefetch:
        return profile
    return Profile(**{**profile.__dict__, "prefetch": prefetch})


def swap_offload(profile):
    """``(num_layers, num_options)``: bytes a layer's swap option moves to host (0 for other options)."""
    offload = np.zeros_like(profile.transient)
    for k, option in enumerate(profile.options):
        if option.kind == OptionKind.SWAP:
            offload[:, k] = np.nan_to_num(np.maximum(profile.mem[:, 0] - profile.mem[:, k], 0.0))
    return offload


def _backward_cases(profile):
    """``(allowed, reserve)`` pairs: the options allowed under a cap on the largest rebuild and on swap,
    and the bytes that cap reserves on top of the kept bytes (the rebuild, the prefetched layers)."""
    allowed = profile.allowed()
    swap = np.array([o.kind == OptionKind.SWAP for o in profile.options])
    offload = swap_offload(profile)
    for cap in sorted(set(profile.transient[allowed].tolist()) | {0.0}):
        for with_swap in (False, True) if swap.any() else (False,):
            ok = allowed & (profile.transient <= cap)
            ok[:, swap] &= with_swap
            if not ok.any(axis=1).all():
                continue
            window = np.sort(np.where(ok, offload, 0.0).max(axis=1))[::-1][:profile.prefetch].sum() \
                if with_swap else 0.0
            yield ok, cap + window


def plan_within(profile, budget):
    """The least-step-time ``BudgetPlan`` whose real peak (``BudgetPlan.backward_peak``) fits ``budget``.

    The peak is kept bytes plus the largest rebuild in backward plus what
    prefetch brings back ahead of time, which is not additive: every cap on
    the rebuild (each measured transient) and with or without swap is solved
    as its own knapsack, with what the cap reserves taken off the budget,
    and the cheapest answer wins. Step times are single measured steps (one or a few per option), which
    move by a fraction of their own length, so plans whose predicted times are within ``timing_noise`` of
    the fastest (``TIME_NOISE`` of the fastest plan's predicted step, or the profile's measured spread) are a tie:
    of those, the one with the least real peak is chosen (``BudgetPlan.tie`` says so), and a run of the
    same command does not flip between them on timing noise. Returns ``(plan, fits)``: when nothing fits,
    the plan with the least real peak and ``fits=False``.
    """
    fitting, least = [], None
    for ok, reserve in _backward_cases(profile):
        capacity = budget - profile.other_bytes - reserve
        choice = solve(profile.mem, profile.time, ok, capacity) if capacity >= 0 else None
        if choice is not None:
            fitting.append(BudgetPlan(profile=profile, budget=int(budget), choice=[int(k) for k in choice]))
        floor = np.argmin(np.where(ok, profile.mem, np.inf), axis=1)
        plan = BudgetPlan(profile=profile, budget=int(budget), choice=[int(k) for k in floor])
        if plan.backward_peak <= budget:
            fitting.append(plan)   # the least memory of this case: a candidate when times tie
        if least is None or plan.backward_peak < least.backward_peak:
            least = plan
    if not fitting:
        return least, False
    best = _settle_ties(fitting, profile, peak=lambda p: p.backward_peak, single_steps=True)
    return best, True
