"""``memory_budget`` against ``plan --budget``'s offline plan and the shipped configs, on the reference GPT.

    PYTHONPATH=. python scripts/bench_budget.py [--budgets 0.5x 0.3x] [--steps 16]

Profiles the model offline once (``plan --budget``'s profile), plans each
budget from it, then trains side by side in one process, one step of each in
turn: the model without AC, for each budget the auto plan (``memory_budget``:
it profiles on its own first steps, untimed here) and the offline plan, and
every config of ``configs/``. Per budget it prints the auto plan, the offline
plan (``plan --budget``: kept bytes within the budget), the offline profile
solved for the real peak as the auto plan is, and the best shipped config (the fastest whose measured real peak fits):
the plan, the median step time over the baseline's and the measured real
peak (kept bytes at the end of forward + the largest rebuild + the prefetched
layers: what the auto plan is chosen to fit).
"""
import argparse
import glob
import os
import statistics
import time

from mindformers_ac.apply import ac_state
from mindformers_ac.budget.controller import measured_peak
from mindformers_ac.budget.sizes import format_bytes, parse_budget
from mindformers_ac.budget.solver import plan_budget, plan_within
from mindformers_ac.config import DEFAULT_MIN_BYTES
from mindformers_ac.harness.spec import add_model_arguments, profile_spec, spec_from_args
from mindformers_ac.mindspore_compat import synchronous_pynative
from mindformers_ac.planner.profile import OptionRun

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
PROFILE_STEPS = 8   # memory_budget's default


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", nargs="+", default=["0.5x", "0.3x"])
    p.add_argument("--steps", type=int, default=16, help="timed steps of every run, after the auto plan settled")
    add_model_arguments(p)
    return p.parse_args()


def main():
    synchronous_pynative()
    a = parse_args()
    spec = spec_from_args(a, steps=a.steps)
    start = time.perf_counter()
    profile = profile_spec(spec)
    print(f"offline profile of {profile.description}: {time.perf_counter() - start:.1f} s")
    budgets = {text: parse_budget(text, profile.baseline_peak) for text in a.budgets}
    labels = ["without AC"]
    configs = [None]
    for text in budgets:
        labels += [f"auto {text}", f"offline {text}", f"offline real peak {text}"]
        configs += [{"memory_budget": {"activations": text}},
                    plan_budget(profile, budgets[text]).sections(),
                    plan_within(profile, budgets[text])[0].sections()]
    shipped = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
    labels += [os.path.basename(path) for path in shipped]
    configs += shipped
    runs = [OptionRun(spec.build, None, config, spec.lr, spec.layer_list) for config in configs]
    warmup = PROFILE_STEPS + 2   # the auto runs profile, install their choice and measure it
    try:
        for k in range(warmup + a.steps):
            for run in runs if k % 2 == 0 else runs[::-1]:
                run.step(k, record=k >= warmup)
        rows = {}
        for label, run in zip(labels, runs):
            state = ac_state(run.model)
            plan = state.budget.summary() if state is not None and state.budget is not None else \
                (state.plan.summary() if state is not None else "-")
            rows[label] = (plan, statistics.median(run.times), measured_peak(run.memory, range(spec.gpt.num_layers), 1))
    finally:
        for run in runs:
            run.close()
    base_s = rows["without AC"][1]
    print(f"\nbaseline: {base_s * 1000:.1f} ms/step, real peak {format_bytes(rows['without AC'][2])}; "
          f"{a.steps} timed steps each, interleaved (swap.min_bytes {DEFAULT_MIN_BYTES})\n")
    print("| budget | plan | step / baseline | measured real peak | within budget |")
    print("| --- | --- | ---: | ---: | --- |")
    for text, size in budgets.items():
        fitting = [(rows[lab][1], lab) for lab in labels[1 + 3 * len(budgets):] if rows[lab][2] <= size]
        best = min(fitting)[1] if fitting else None
        for label in (f"auto {text}", f"offline {text}", f"offline real peak {text}", best):
            if label is None:
                print(f"| {text} ({format_bytes(size)}) | no shipped config fits | | | |")
                continue
            plan, seconds, peak = rows[label]
            print(f"| {text} ({format_bytes(size)}) | {label}: {plan} | {seconds / base_s:.3f} | "
                  f"{format_bytes(peak)} | {'yes' if peak <= size else 'no'} |")


if __name__ == "__main__":
    main()
