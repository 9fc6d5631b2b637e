"""Benchmark: ``full + exclude_op`` on the collectives against plain ``full``, where the collectives sit in op
slots (tensor and expert parallelism), one process per rank under the launcher.

    python -m mindformers_ac.harness.launch --nproc 2 scripts/bench_slots.py --family tp --shape small --steps 20
    python -m mindformers_ac.harness.launch --nproc 2 scripts/bench_slots.py --family ep --shape small --steps 20

Rows, interleaved in every rank's process (``bench_common.run_interleaved``; the ranks run the same rows
in the same order, so each step's collectives pair up): no AC; full recompute of every layer; the same
with ``exclude_op`` on the collectives (tp: ``AllGather``, ``ReduceScatter``, ``AllReduce``, the TP model's
comm cells' Primitives, held in their ``_prims`` dicts; ep: ``AllToAll``, the MoE dispatcher's dict-held
all-to-all). A step is one ``value_and_grad`` on a fixed batch (no update: every row computes the same).
Each rank prints its table; "light / intercepted calls" counts the AC rows' region calls of one more step
by path, "collectives re-run" the excluded collectives that step's backward ran again: the excluded
collectives are kept at their slots on the light path when every call is light and none is re-run.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_common import Row, parse_args, print_table, run_interleaved  # noqa: E402

_EXCLUDED = {"tp": ["AllGather", "ReduceScatter", "AllReduce"], "ep": ["AllToAll"]}


def _add_arguments(p):
    p.add_argument("--family", choices=sorted(_EXCLUDED), default="tp")


def main():
    args = parse_args(__doc__, _add_arguments)
    import mindspore as ms

    from mindformers_ac import apply_ac
    from mindformers_ac.config import AcConfig
    from mindformers_ac.harness.spec import TrainSpec
    from mindformers_ac.harness.tp import init_tp
    from mindformers_ac.installed import ac_state
    from mindformers_ac.mindspore_compat import synchronous_pynative
    synchronous_pynative("CPU")
    rank, world = init_tp()
    gpt = args.gpt
    if args.family == "tp":
        spec = TrainSpec(gpt=gpt, batch=args.batch, tp=world)
    else:
        spec = TrainSpec(gpt=gpt, batch=args.batch, ep=world, moe={"num_experts": 2 * world, "top_k": 2})
    layers = [f"0-{gpt.num_layers - 1}"]
    configs = {"no AC": None,
               "full": {"recompute": {"mode": "full", "full_recompute_layer": layers}},
               "full + exclude_op": {"recompute": {"mode": "full", "full_recompute_layer": layers,
                                                   "exclude_op": _EXCLUDED[args.family]}}}
    rows = []
    for name, config in configs.items():
        model, make_inputs = spec.build(rank)
        tokens, labels = make_inputs(0)
        if config is not None:
            apply_ac(model, config=AcConfig.from_dict(config))
        grad_fn = ms.value_and_grad(model, None, model.trainable_params())

        def step(f=grad_fn, t=tokens, y=labels):
            _, grads = f(t, y)
            grads[0].asnumpy()

        row = Row(name, step, ref="full" if name == "full + exclude_op" else None)
        row.stats = list(ac_state(model).recompute_stats.values()) if config is not None else []
        rows.append(row)
    run_interleaved(rows, args.warmup, args.steps)
    counted = {}
    for row in rows:   # one more step each, counted by path
        for s in row.stats:
            s.reset()
        row.step()
        counted[row.name] = {"light / intercepted calls": "-", "collectives re-run": "-"} if not row.stats else {
            "light / intercepted calls": (f"{sum(s.light_calls for s in row.stats)} / "
                                          f"{sum(s.intercepted_calls for s in row.stats)}"),
            "collectives re-run": str(sum(n for s in row.stats for op, n in s.rerun_by_op.items()
                                          if any(c.lower() in op.lower() for c in _EXCLUDED[args.family])))}

    print(f"rank {rank}: {args.family}, {world} ranks, {spec.describe()}, {args.steps} interleaved steps")
    print_table(rows, "no AC", lambda row: counted[row.name])


if __name__ == "__main__":
    main()
