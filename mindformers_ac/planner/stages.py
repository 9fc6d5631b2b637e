"""Plans for pipeline stages: each stage's peak, with the microbatches it holds in flight, fits the budget.

A stage holds the activations of every microbatch that has run its forward but not yet its backward:
in GPipe order (the only one MindSpore 2.10 runs) all M of them; in 1F1B, ``pp - stage`` (at most M).
So a stage's predicted peak is ``in_flight x (other_bytes + sum of its layers' option bytes)``, from the
per-microbatch profile of the whole model (a layer keeps the same bytes whichever stage holds it).
``other_bytes`` (embedding, head, loss) is the whole model's on every stage: an upper bound, so a stage
that fits here fits when measured. The budget applies to every stage; a fraction (``0.5x``) is of that
stage's own baseline peak with its microbatches in flight. Swap is allowed where a stage's layer ``i``
has its prefetch trigger ``i + prefetch`` on the same stage.

Stages are contiguous runs of ``num_layers / pp`` layers (the first stages take one more when it does
not divide), as the reference pipeline cuts the GPT.
"""
from dataclasses import dataclass

import yaml

from ..budget.sizes import format_bytes, parse_budget
from ..budget.solver import Profile, option_sections, plan_budget, summarize
from ..errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")


def stage_layers(num_layers, pp):
    """The layer ids of each of ``pp`` contiguous stages."""
    base, extra = divmod(num_layers, pp)
    bounds, start = [], 0
    for s in range(pp):
        end = start + base + (1 if s < extra else 0)
        bounds.append(list(range(start, end)))
        start = end
    return bounds


def in_flight(stage, pp, microbatches, schedule="gpipe"):
    """Microbatches stage ``stage`` holds at its peak: every one in GPipe order, ``pp - stage`` in 1F1B."""
    if schedule not in SCHEDULES:
        raise ConfigError("schedule", f"expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    return microbatches if schedule == "gpipe" else min(microbatches, pp - stage)


def stage_profile(profile, layer_ids, copies):
    """``profile`` restricted to ``layer_ids``, every figure times ``copies`` (microbatches in flight)."""
    return Profile(options=profile.options, mem=profile.mem[layer_ids] * copies,
                   time=profile.time[layer_ids] * copies, transient=profile.transient[layer_ids],
                   other_bytes=profile.other_bytes * copies, baseline_step_s=profile.baseline_step_s * copies,
                   prefetch=profile.prefetch, host_bandwidth=profile.host_bandwidth,
                   description=profile.description)


@dataclass
class StagePlans:
    """One ``BudgetPlan`` per stage (local layer indices), with the global ids of each stage's layers."""

    plans: list
    layer_ids: list
    microbatches: int
    in_flight: list
    schedule: str = "gpipe"

    @property
    def options(self):
        """Global layer id -> chosen ``Option``, every stage's."""
        return {ids[i]: option for plan, ids in zip(self.plans, self.layer_ids) for i, option in plan.options.items()}

    def sections(self):
        return option_sections(self.options, self.plans[0].profile.prefetch)

    def to_yaml(self):
        head = "".join(f"# stage {s} (layers {ids[0]}-{ids[-1]}, {n} microbatches in flight, {self.schedule}): "
                       f"budget {format_bytes(plan.budget)}; predicted peak {format_bytes(plan.predicted_peak)} "
                       f"(baseline {format_bytes(plan.profile.baseline_peak)})\n"
                       for s, (plan, ids, n) in enumerate(zip(self.plans, self.layer_ids, self.in_flight)))
        return "# mindformers-ac plan, pipeline stages: the same config goes to every stage\n" + head + \
            yaml.safe_dump(self.sections(), sort_keys=False, default_flow_style=None)

    def report(self):
        lines = [f"pipeline: {len(self.plans)} stages, {self.microbatches} microbatches, {self.schedule} order "
                 f"(a stage's peak holds its microbatches in flight)"]
        for s, (plan, ids, n) in enumerate(zip(self.plans, self.layer_ids, self.in_flight)):
            local = {ids[i]: option for i, option in plan.options.items()}
            lines.append(f"stage {s} (layers {ids[0]}-{ids[-1]}, {n} in flight): budget {format_bytes(plan.budget)} "
                         f"({plan.budget / plan.profile.baseline_peak:.2f}x its baseline "
                         f"{format_bytes(plan.profile.baseline_peak)}); planned peak "
                         f"{format_bytes(plan.predicted_peak)}; {summarize(local)}")
        return "\n".join(lines)


def plan_stages(profile, budget_text, pp, microbatches=1, prefetch=None, schedule="gpipe"):
    """The least-step-time plan of every stage whose predicted peak with its microbatches in flight fits
    ``budget_text`` (``--budget``: bytes, a size, or a fraction of the stage's baseline peak).

    Raises ``ConfigError("--budget", ...)`` naming the stage whose least reachable peak is above the budget.
    """
    bounds = stage_layers(profile.num_layers, pp)
    plans, counts = [], []
    for s, ids in enumerate(bounds):
        if not ids:
            raise ConfigError("--pp", f"{pp} stages for {profile.num_layers} layers: stage {s} would hold none")
        n = in_flight(s, pp, microbatches, schedule)
        sub = stage_profile(profile, ids, n)
        try:
            plans.append(plan_budget(sub, parse_budget(budget_text, sub.baseline_peak), prefetch))
        except ConfigError as exc:
            raise ConfigError("--budget", f"stage {s} (layers {ids[0]}-{ids[-1]}, {n} microbatches in flight): "
                                          f"{exc.reason}") from None
        counts.append(n)
    return StagePlans(plans, bounds, microbatches, counts, schedule)


