"""``mindformers-ac train --tp N`` / ``--moe --ep N`` under msrun: each rank trains its slice twice."""
import os

from .train import compare
from .variant import check_config, run_variant


def train_and_compare_tp(spec, config_path, comm=None):
    """Under msrun: this rank trains its TP (or expert-parallel, ``spec.ep``) slice without and with AC,
    one run after the other. ``comm``: ``(rank, world size)`` when communication is initialised already
    (several comparisons in one job); else it is initialised here.

    Both runs share the process (the communication group can be set up only
    once), so the per-run VmHWM figures are not independent; the saved-tensor
    accounting is. No second run without AC is made when they differ (each rank
    would decide alone, and collectives need every rank). Returns
    ``(rank, comparison)``; rank 0 prints.
    """
    from .tp import init_tp
    if spec.ep > 1:
        from .moe import check_ep_world
        check_ep_world(spec.ep, int(os.environ.get("MS_WORKER_NUM", "0")) or spec.ep)   # before init: exit 2
    rank, world = comm if comm is not None else init_tp()
    if spec.ep > 1:
        check_ep_world(spec.ep, world)
    elif world != spec.tp:
        raise RuntimeError(f"--tp {spec.tp} but the job has {world} ranks: launch it with "
                           f"msrun --worker_num {spec.tp} --local_worker_num {spec.tp}")
    plan = check_config(spec, config_path, rank)
    if rank == 0:
        print(plan)
    baseline = run_variant(spec, None, "baseline", rank, show_progress=rank == 0)
    ac = run_variant(spec, config_path, "with AC", rank, show_progress=rank == 0)
    result = compare(spec, config_path, baseline, ac)
    result["summary"]["collectives_per_step"] = {"baseline": baseline["collectives"][-1],
                                                 "ac": ac["collectives"][-1]}
    return rank, result
