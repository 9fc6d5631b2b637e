"""Planner predictions against `train` measurements on the reference GPT.

    python scripts/bench_planner.py [--budgets 0.8x 0.5x 0.2x 0.1x] [--layers 8 --hidden 128 ...]

Profiles the model once, plans each budget, then trains baseline and planned
config with ``train_and_compare`` (each in its own subprocess, like
``mindformers-ac train``) and prints one row per budget: the options chosen,
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

from mindformers_ac.planner import MiB, parse_budget, plan_budget, solve
from mindformers_ac.planner_profile import profile_reference
from mindformers_ac.train import TrainSpec, train_and_compare


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", nargs="+", default=["0.8x", "0.5x", "0.2x", "0.1x"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
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
    a = parse_args()
    spec = TrainSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, batch=a.batch,
                     dropout=a.dropout, steps=a.train_steps)
    start = time.perf_counter()
    profile = profile_reference(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, batch=a.batch,
                                dropout=a.dropout, steps=a.profile_steps)
    print(f"profiled {profile.description} in {time.perf_counter() - start:.1f} s; baseline "
          f"{profile.baseline_peak / MiB:.2f} MiB, {profile.baseline_step_s * 1000:.1f} ms/step")
    for k, option in enumerate(profile.options):
        print(f"  {option.name:38} {np.nanmean(profile.mem[:, k]) / MiB:6.3f} MiB/layer "
              f"{np.nanmean(profile.time[:, k]) * 1000:+7.2f} ms/layer")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as workdir:
        for text in a.budgets:
            budget = parse_budget(text, profile.baseline_peak)
            plan = plan_budget(profile, budget)
            path = os.path.join(workdir, f"plan_{text}.yaml")
            with open(path, "w", encoding="utf-8") as f:
                f.write(plan.to_yaml())
            s = train_and_compare(spec, path)["summary"]
            peak, step = s["ac_peak_activation_bytes"], s["ac_step_time_s"]
            rows.append((text, plan.summary(), plan.predicted_peak, peak, peak <= budget,
                         plan.predicted_step_s, step, 100 * (step - plan.predicted_step_s) / plan.predicted_step_s,
                         s["baseline_step_time_s"]))
    print()
    print("| budget | plan | predicted peak | measured peak | within budget | predicted step | "
          "measured step | error | measured baseline step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for text, summary, pp, mp, ok, pt, mt, err, bt in rows:
        print(f"| {text} ({parse_budget(text, profile.baseline_peak) / MiB:.2f} MiB) | {summary} | "
              f"{pp / MiB:.2f} MiB | {mp / MiB:.2f} MiB | {'yes' if ok else 'NO'} | {pt * 1000:.1f} ms | "
              f"{mt * 1000:.1f} ms | {err:+.1f}% | {bt * 1000:.1f} ms |")
    print(f"\nsolver, 128 layers x 8 options: {solver_time() * 1000:.1f} ms (median of 5)")
    ok = all(r[4] and abs(r[7]) <= 10 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
