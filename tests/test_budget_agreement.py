"""``memory_budget`` under msrun: the ranks that must run one plan choose it together (issue 51).

One 2-rank job (``budget_agreement_worker.py``) runs ``mindformers-ac train --budget`` with ``--tp 2``,
``--dp 2``, ``--moe --ep 2`` and ``--pp 2 --microbatches 2``, rank 1's backward slowed by a sleeping hook
while the budget profiles full recompute: the TP, DP and EP ranks agree on one plan chosen from the worst
rank's figures, each pipeline stage plans its own layers with its microbatches in flight, and every rank
trains bitwise against the same run without AC. The job is launched as two nodes of one rank each on this
host (``launch_nodes``: two msrun processes, ``--node_rank 0/1``, master ``127.0.0.1``), as on two
machines. Without msrun: the combining itself.
"""
import json
import os

import numpy as np
import pytest

from mindformers_ac.budget.agreement import agreed_profile
from mindformers_ac.budget.options import BELOW_BASELINE
from mindformers_ac.budget.solver import SPREAD_OF_REPEATS, Profile
from mindformers_ac.harness.launch import launch_nodes

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SLEEP_S = 0.5   # budget_agreement_worker.SLEEP_S
TINY = "--layers,4,--hidden,16,--heads,2,--seq,8,--vocab,64,--batch,2,--steps,6,--dropout,0.1,--budget,0.5x"
CASES = {"tp": "--tp,2", "dp": "--dp,2", "ep": "--moe,--ep,2", "pp": "--pp,2,--microbatches,2"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agreement")
    config = tmp / "budget.yaml"
    config.write_text("memory_budget:\n  profile_steps: 4\n")   # warm-up, baseline, full, layer swap
    cases = [f"{name}={flags},{config},{TINY}" for name, flags in CASES.items()]
    nodes = launch_nodes([os.path.join(HERE, "budget_agreement_worker.py"), str(tmp), *cases], nodes=2,
                         nproc_per_node=1, timeout_s=400, log_dir=tmp / "logs", env=ENV)
    logs = [open(path, errors="replace").read() for node in nodes for path in node.worker_logs()]
    assert nodes[0].returncode == 0 and not any(n.timed_out for n in nodes), "\n".join(logs)[-4000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)], logs, nodes


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp", "dp", "ep"])
def test_ranks_slowed_apart_choose_one_plan_from_the_worst_figures_and_train_bitwise(ranks, case):
    results, logs, _ = ranks
    assert [r[case]["status"] for r in results] == [0, 0]   # bitwise against no AC, on each rank
    assert results[0][case]["slept"] == 0 and results[1][case]["slept"] > 0
    budgets = [r[case]["budgets"][0] for r in results]
    assert budgets[0]["chosen"] == budgets[1]["chosen"] and budgets[0]["budget_bytes"] == budgets[1]["budget_bytes"]
    for same in ("first_step", "replanned", "measured_peak_bytes", "predicted_step_s"):   # chosen again together
        assert budgets[0][same] == budgets[1][same], same
    agreed = [b["agreement"] for b in budgets]
    assert [a["rank"] for a in agreed] == [0, 1] and all(a["ranks"] == 2 for a in agreed)
    assert agreed[0]["step_cost_s"] == agreed[1]["step_cost_s"]
    # rank 1's sleep is in the figures rank 0 chose from, also where rank 0 did not wait for it (data parallel)
    assert agreed[0]["step_cost_s"]["full"] > SLEEP_S / 2, agreed[0]
    for rank, log in enumerate(logs):   # every rank prints the plan, and the figures it came from
        assert f"chosen {budgets[0]['chosen']} (from step" in log
        assert f"chosen together by the 2 ranks of mccl_world_group, from the worst rank's figures; this rank " \
               f"({rank}) measured" in log


@pytest.mark.slow
def test_each_pipeline_stage_plans_its_own_layers_with_its_microbatches_in_flight(ranks):
    results, _, _ = ranks
    stages = [r["pp"] for r in results]
    assert [s["status"] for s in stages] == [0, 0]
    budgets = [s["budgets"][0] for s in stages]
    assert [b["agreement"] for b in budgets] == [None, None]   # one stage per rank: nobody to agree with
    for stage, (budget, layers) in enumerate(zip(budgets, ("0-1", "2-3"))):
        assert budget["chosen"].startswith(f"{layers}:"), (stage, budget["chosen"])
        assert "2 training forwards in flight" in budget["describe"][0]


@pytest.mark.slow
def test_two_nodes_on_one_host_run_tp_and_dp_bitwise(ranks):
    results, logs, nodes = ranks
    assert [len(node.worker_logs()) for node in nodes] == [1, 1]   # rank 0 on node 0, rank 1 on node 1
    for case in ("tp", "dp"):
        assert [r[case]["status"] for r in results] == [0, 0], case
    for log in logs:   # the data-parallel replicas, one per node, end bitwise alike
        assert "replicas [0, 1] hold bitwise the same parameters after the last step: yes" in log
    # msrun starts a scheduler wherever --master_addr is a local address: node 1's, on the same host as node 0's,
    # finds the port taken and fails at once; msrun says so after its worker ended (on two machines, node 1
    # starts none)
    with open(os.path.join(nodes[1].log_dir, "scheduler.log"), errors="replace") as f:
        assert "Failed to create the TCP server" in f.read()
    with open(os.path.join(nodes[1].log_dir, "msrun.log"), errors="replace") as f:
        node1 = f.read()
    assert "Scheduler process" in node1 and "Worker process" not in node1


class TwoRanks:
    """An ``Agreement`` stand-in: this rank's figures and another rank's, as the gather would return them."""

    def __init__(self, other):
        self.other = other

    def gather(self, values):
        return np.stack([np.asarray(values, float), self.other(np.asarray(values, float))])


def test_the_agreed_profile_takes_every_figure_from_the_worst_rank():
    mem = np.array([[10.0, 2.0, np.nan], [10.0, 3.0, 1.0]])
    profile = Profile(options=[], mem=mem, time=np.array([[0.0, 0.1, np.nan], [0.0, 0.1, 0.05]]),
                      transient=np.zeros((2, 3)), other_bytes=5, baseline_step_s=1.0, time_spread_s=0.01,
                      time_spread_what=SPREAD_OF_REPEATS)

    def slower(values):   # the other rank: every step time up, noise wider (measured below its baseline)
        out = values.copy()
        out[6:12] += 0.2
        out[18:22] = [4, 1.5, 0.3, 1]
        return out
    combined, (kept,) = agreed_profile(TwoRanks(slower), profile, 99)
    assert np.array_equal(combined.mem, mem, equal_nan=True) and kept == 99
    assert np.allclose(combined.time[:, 1], [0.3, 0.3]) and np.isnan(combined.time[0, 2])
    assert (combined.other_bytes, combined.baseline_step_s, combined.time_spread_s) == (5, 1.5, 0.3)
    assert combined.time_spread_what == BELOW_BASELINE
