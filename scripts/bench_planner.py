"""Planner predictions against `train` measurements on the reference GPT.

    python scripts/bench_planner.py [--budgets 0.8x 0.5x 0.2x 0.1x] [--layers 8 --hidden 128 ...]

Profiles the model once, plans each budget, then trains the baseline and every
planned config side by side in one process, one step of each in turn
(``planner_profile.measure_configs``), and prints one row per budget: the options chosen,
predicted and measured peak activation memory (``StepMeter`` kept bytes at
the end of forward), whether the measurement is within the budget, predicted
and measured median step time and the error. Finally times the solver on 128
synthetic layers x 8 options.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from mindformers_ac.budget.sizes import parse_budget
from mindformers_ac.budget.solver import MiB, plan_budget, solve
from mindformers_ac.harness.spec import add_model_arguments, profile_spec, spec_from_args
from mindformers_ac.mindspore_compat import synchronous_pynative
from mindformers_ac.planner.profile import measure_configs


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", nargs="+", default=["0.8x", "0.5x", "0.2x", "0.1x"])
    add_model_arguments(p)
    p.add_argument("--profile-steps", type=int, default=12)
    p.add_argument("--train-steps", type=int, default=20)
    return p.parse_args()


def solver_time(num_layers=128, num_options=8, repeats=5):
    """Median seconds of ``solve`` on random costs, budget at 40% of the all-'none' memory."""
    rng = np.random.default_rng(0)
    mem = rng.uniform(0.05, 1.0, (num_layers, num_options)) * 2 ** 22
    mem[:, 0] = 2 ** 22
    cost = rng.uniform(0.0, 0.02, (num_layers, num_options))
    cost[:, 0] = 0
    allowed = np.ones_like(mem, bool)
    allowed[-1, -1] = False
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        solve(mem, cost, allowed, 0.4 * mem[:, 0].sum())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    synchronous_pynative()
    a = parse_args()
    spec = spec_from_args(a, steps=a.train_steps)
    start = time.perf_counter()
    profile = profile_spec(spec, steps=a.profile_steps)
    print(f"profiled {profile.description} in {time.perf_counter() - start:.1f} s; baseline "
          f"{profile.baseline_peak / MiB:.2f} MiB, {profile.baseline_step_s * 1000:.1f} ms/step")
    for k, option in enumerate(profile.options):
        print(f"  {option.name:38} {np.nanmean(profile.mem[:, k]) / MiB:6.3f} MiB/layer "
              f"{np.nanmean(profile.time[:, k]) * 1000:+7.2f} ms/layer")
    budgets = [parse_budget(text, profile.baseline_peak) for text in a.budgets]
    plans = [plan_budget(profile, budget) for budget in budgets]
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as workdir:
        paths = []
        for text, plan in zip(a.budgets, plans):
            paths.append(os.path.join(workdir, f"plan_{text}.yaml"))
            with open(paths[-1], "w", encoding="utf-8") as f:
                f.write(plan.to_yaml())
        # baseline and every planned config trained side by side, interleaved step by step
        measured = measure_configs(spec.build, [None] + paths, steps=a.train_steps)
    base_s = measured[0][0]
    print()
    print("| budget | plan | predicted peak | measured peak | within budget | predicted step | "
          "measured step | error | predicted / baseline | measured / baseline | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for text, budget, plan, (step, peak) in zip(a.budgets, budgets, plans, measured[1:]):
        err = 100 * (step - plan.predicted_step_s) / plan.predicted_step_s
        predicted_ratio = plan.predicted_step_s / profile.baseline_step_s
        ratio_err = 100 * (step / base_s - predicted_ratio) / predicted_ratio
        ok &= peak <= budget and abs(err) <= 10
        print(f"| {text} ({budget / MiB:.2f} MiB) | {plan.summary()} | {plan.predicted_peak / MiB:.2f} MiB | "
              f"{peak / MiB:.2f} MiB | {'yes' if peak <= budget else 'NO'} | {plan.predicted_step_s * 1000:.1f} ms | "
              f"{step * 1000:.1f} ms | {err:+.1f}% | {predicted_ratio:.3f} | {step / base_s:.3f} | "
              f"{ratio_err:+.1f}% |")
    print(f"\nbaseline: profiled {profile.baseline_step_s * 1000:.1f} ms/step, measured {base_s * 1000:.1f} ms/step")
    print(f"\nsolver, 128 layers x 8 options: {solver_time() * 1000:.1f} ms (median of 5)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
