"""Early stop against the whole re-run, on the intercepting path, against the floor (bench_floor.py's form).

    PYTHONPATH=scripts:. python scripts/bench_early_stop.py [--family plain] [--shape small|mid] [--steps 30]

Rows, one process, steps interleaved (``bench_common``): baseline, the floor (baseline + 1 forward),
full recompute of every layer on the intercepting path (``checkpoint_wrapper(layer, light_path=False)``:
where early stop acts; the light path runs the whole function) with ``early_stop=True`` (the
default) and with ``early_stop=False``. The columns give each row's median step against the floor
and, for the early-stop row, against the whole re-run; "ops re-run" counts one step's re-run ops.
"""
import mindspore as ms

from mindformers_ac import recompute as rc
from mindformers_ac.mindspore_compat import synchronous_pynative

from bench_common import Row, parse_args, print_table, run_interleaved
from bench_families import FAMILIES, build

FLOOR, EARLY, WHOLE = "floor (baseline + 1 forward)", "full, early_stop=True", "full, early_stop=False"


def case(a, name, early_stop=None, extra_forward=False, ref=None):
    family = build(a.family, a.gpt, a.batch, a.gpt.dropout, a.dropout_kind)
    model, batch = family.model, family.batch
    stats = []
    if early_stop is not None:
        for layer in family.layers:
            stats.append(rc.RecomputeStats())
            rc.checkpoint_wrapper(layer, light_path=False, early_stop=early_stop, stats=stats[-1])
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())

    def step():
        if extra_forward:
            model(*batch)
        _, grads = grad_fn(*batch)
        grads[0].asnumpy()

    row = Row(name, step, ref)
    row.stats = stats
    return row


def main():
    a = parse_args(__doc__, lambda p: p.add_argument("--family", choices=FAMILIES, default="plain"))
    synchronous_pynative()
    rows = [case(a, "baseline"), case(a, FLOOR, extra_forward=True), case(a, EARLY, True, ref=WHOLE),
            case(a, WHOLE, False, ref=FLOOR)]
    run_interleaved(rows, a.warmup, a.steps)
    floor = next(r for r in rows if r.name == FLOOR).median()[0]
    steps = a.warmup + a.steps

    def extra(row):
        if not row.stats:
            return {"x floor wall": f"{row.median()[0] / floor:.3f}", "ops re-run per step": "-",
                    "early stops per step": "-"}
        return {"x floor wall": f"{row.median()[0] / floor:.3f}",
                "ops re-run per step": str(sum(s.ops_rerun for s in row.stats) // steps),
                "early stops per step": str(sum(s.early_stops for s in row.stats) // steps)}

    g = a.gpt
    print(f"{build(a.family, a.gpt, a.batch).describe}: {g.num_layers} layers, hidden {g.hidden_size}, seq "
          f"{g.seq_length}, batch {a.batch}, dropout {g.dropout}; median of {a.steps} interleaved steps after "
          f"{a.warmup} warm-up")
    print_table(rows, "baseline", extra)


if __name__ == "__main__":
    main()
