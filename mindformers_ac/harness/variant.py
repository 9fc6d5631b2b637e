"""One run of a ``TrainSpec``, with or without a config: every figure and digest ``train`` compares.

``run_variant`` is what each ``train`` worker process (and each rank under
msrun) does; ``check_config`` validates the config against the model before
any run starts.
"""
import functools

from ..training import TrainingRun
from .progress import Progress


class RunFailed(RuntimeError):
    """A training run (a worker process) failed after the config and model were checked."""


def run_variant(spec, config_path, label, rank=0, show_progress=True, built=None, reduce_grads=None):
    """Train ``spec`` (with ``config_path`` applied, unless None) and return every figure as a dict.

    Besides the figures, the record holds the digests ``exactness.judge``
    compares: loss, every gradient and every parameter (trainable or not) after
    each step, and the parameters as built. ``built``: ``(model, make_inputs)`` instead of
    ``spec.build(rank)`` (data parallel: this rank's slice and batches); ``reduce_grads(params, grads)
    -> grads`` runs after the tensor-parallel sync, before the update (data parallel: the average).
    """
    from ..apply import ac_state
    from .exactness import record_initial_state, record_step
    from .process_memory import reset_hwm, vm_hwm

    model, make_inputs = built if built is not None else spec.build(rank)
    run = TrainingRun(model, config_path, spec.lr, layers=spec.layer_list)
    progress = Progress(label, spec.steps) if show_progress else None
    record = {"losses": [], "step_times": [], "memory": [], "collectives": []}
    record_initial_state(record, model, [p.name for p in run.optimizer.parameters])
    sync_grads = None
    parallel = spec.tp > 1 or spec.ep > 1
    if parallel:
        from .moe import sync_expert_parallel_grads
        from .tp import reset_comm_counters, sync_sequence_parallel_grads
        sync = sync_expert_parallel_grads if spec.ep > 1 else sync_sequence_parallel_grads
        sync_grads = functools.partial(sync, model)
    if reduce_grads is not None:
        sync_grads = _then(sync_grads, reduce_grads)
    reset_hwm()
    for step in range(spec.steps):
        inputs = make_inputs(step)
        if parallel:
            reset_comm_counters(model)
        loss, grads, memory, seconds = run.step(inputs, sync_grads)
        if parallel:
            record["collectives"].append(_collectives(model, ac_state(model)))
        record["losses"].append(float(loss.asnumpy()))
        record_step(record, model, loss, grads)
        record["step_times"].append(seconds)
        record["memory"].append(memory.as_dict())
        if progress is not None:
            progress.update(step, record["losses"][-1], seconds, memory.kept_bytes)
    record["vm_hwm_bytes"] = vm_hwm()
    state = ac_state(model)
    plan = state.plan if state is not None else None   # with memory_budget: the plan it chose
    record["plan"] = {str(i): lp.describe() for i, lp in plan.layers.items()} if plan else {}
    if state is not None and state.budget is not None:
        record["budget"] = state.budget.as_record()
    return record


def _then(first, second):
    """``sync_grads`` that runs ``first`` (may be None), then ``second``."""
    def both(params, grads):
        return second(params, first(params, grads) if first is not None else grads)
    return both


def _collectives(model, state):
    """Collectives run this step: forward / backward calls per primitive, and re-runs in backward
    counted by the recompute engine (an op it re-runs really communicates again)."""
    from .tp import collective_counts
    counts = collective_counts(model)
    rerun = {}
    for stats in state.recompute_stats.values() if state is not None else ():
        for name, n in stats.rerun_by_op.items():
            if any(c in name.lower() for c in ("allgather", "all_gather", "allreduce", "all_reduce",
                                                "reduce_scatter", "reducescatter", "alltoall")):
                rerun[name] = rerun.get(name, 0) + n
    return {"forward": counts["per_collective"].get("forward", {}),
            "backward": counts["per_collective"].get("backward", {}),
            "rerun_in_backward": rerun}


def check_config(spec, config_path, rank=0):
    """Build the model ``spec`` describes and validate the config against it; returns the ``AcPlan``.

    For a ``--model`` factory the contract is checked too, one forward of
    ``make_inputs(0)`` included (its loss must be a scalar). Raises ``ConfigError``.
    """
    from ..plan import plan_ac
    model, make_inputs = spec.build(rank)
    if spec.factory is not None:
        spec.user_model().check_loss(model, make_inputs)
    return plan_ac(model, config=config_path, layers=spec.layer_list)
