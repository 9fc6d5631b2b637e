"""Under msrun (2 ranks): ``mindformers-ac train --budget`` with each parallel flag in one job, rank 1's
backward slowed while the budget profiles full recompute (a hook that sleeps: a GC pause, a noisy
neighbour), so that each rank alone would time the options apart.

    budget_agreement_worker.py OUT_DIR CASE=ARG,ARG... ...   -> OUT_DIR/rank{r}.json:
        {case: {"status": train's exit status, "budgets": [the controllers' as_record()], "slept": sleeps}}
"""
import functools
import json
import os
import sys
import time

from mindformers_ac.budget import controller
from mindformers_ac.budget.solver import OptionKind
from mindformers_ac.harness import cli
from mindformers_ac.harness.data_parallel import init_data_parallel
from mindformers_ac.mindspore_compat import synchronous_pynative

SLEEP_S = 0.5


def slow_full_recompute_backward(rank, slept):
    """Rank 1 sleeps in the backward of every profiling step of full recompute (inside its measured time)."""
    started = controller.MeasuredStep.backward_started

    @functools.wraps(started)
    def backward_started(step):
        first = step.backward_from is None
        started(step)
        if rank == 1 and first and step.option is not None and step.option.kind == OptionKind.FULL:
            slept.append(SLEEP_S)
            time.sleep(SLEEP_S)
    controller.MeasuredStep.backward_started = backward_started


def collect_budgets(installed):
    install = controller.install_budget

    def install_and_keep(state, model, stack):
        budget = install(state, model, stack)
        installed.append(budget)
        return budget
    controller.install_budget = install_and_keep


def main(out_dir, cases):
    synchronous_pynative("CPU")
    # the data-parallel context for --dp (every rank of the job); the other cases run beside it
    rank, _ = init_data_parallel(int(os.environ["MS_WORKER_NUM"]))
    slept, installed = [], []
    slow_full_recompute_backward(rank, slept)
    collect_budgets(installed)
    results = {}
    for case in cases:
        name, argv = case.split("=", 1)
        del slept[:], installed[:]
        status = cli.main(["train", *argv.split(",")])
        results[name] = {"status": status, "slept": len(slept), "budgets": [b.as_record() for b in installed]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
