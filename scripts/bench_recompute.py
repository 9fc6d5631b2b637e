"""Step time and kept activation bytes of the recompute engine against baseline and Cell.recompute().

    PYTHONPATH=. python scripts/bench_recompute.py [--family gpt|plain|llama] [--shape small|mid] [--dropout 0]
                                                   [--nn-dropout] [--steps 10]
    PYTHONPATH=. python scripts/bench_recompute.py --shape small --profile full
    PYTHONPATH=scripts:. python scripts/bench_recompute.py --shape small --against REV   # + REV's engine rows
    PYTHONPATH=scripts:. python scripts/bench_recompute.py --shape mid --against REV --profile "select mlp" "REV: select mlp"

``--family`` picks the model (``bench_families.py``): the reference GPT, a plain
pre-LN transformer with another op mix, or the LLaMA of docs/own_model.md.

Rows: baseline, "baseline + 1 forward" (the floor for full recompute), MindSpore's Cell.recompute()
on each layer and on each layer's mlp (fresh models: it can't be undone), and the engine's full,
select mlp, and full and select mlp with exclude_op (``matmul``; ``AllToAll`` on the MoE model); engine rows are also compared to the
built-in row of the same cells ("ref"). Kept bytes come from the engine's RecomputeStats for engine
rows and from SavedTensorMeter for the others (the engine's own hooks hide an outer meter inside its
regions, so for engine rows the meter is run too and the bytes outside the regions are added).

``--against REV`` adds the four engine rows with the recompute engine of another revision of this
repository (``bench_common.package_of``), interleaved with the others in the same process: before/after
ratios that the load of a shared machine cannot skew.
"""
import tempfile

import mindspore as ms

from mindformers_ac import recompute as rc
from mindformers_ac.meter import SavedTensorMeter
from mindformers_ac.mindspore_compat import synchronous_pynative
from mindformers_ac.tensors import MiB

from bench_common import DROPOUT_NAMES, Row, package_of, parse_args, print_table, profile, run_interleaved
from bench_families import FAMILIES, build, exclude_op


def case(a, name, setup, ref=None, extra_forward=False):
    """A fresh model set up by ``setup(family) -> [RecomputeStats] | None``, as a Row."""
    family = build(a.family, a.gpt, a.batch, a.gpt.dropout, a.dropout_kind)
    model, batch = family.model, family.batch
    stats = setup(family) or []
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, params)

    def step():
        if extra_forward:
            model(*batch)
        _, grads = grad_fn(*batch)
        grads[0].asnumpy()

    def kept_and_rerun():
        """Kept bytes of one step: meter outside the regions plus each region's own peak."""
        meter = SavedTensorMeter(params)
        for s in stats:
            s.reset()
        with meter.hooks():
            grad_fn(*batch)
        return {"kept MiB": f"{(meter.peak + sum(s.peak_kept_bytes for s in stats)) / MiB:.2f}",
                "ops re-run": str(sum(s.ops_rerun for s in stats)),
                "light / intercepted calls": (f"{sum(s.light_calls for s in stats)} / "
                                              f"{sum(s.intercepted_calls for s in stats)}") if stats else "-"}

    row = Row(name, step, ref)
    row.stats, row.kept_and_rerun = stats, kept_and_rerun
    return row


def per_layer(policy=None, cells="layers", engine=rc):
    """``checkpoint_wrapper`` on each layer (``cells="layers"``) or each layer's MLP (``"mlp"``), with the
    recompute package ``engine``."""
    def setup(family):
        stats = []
        for cell in getattr(family, cells):
            stats.append(engine.RecomputeStats())
            engine.checkpoint_wrapper(cell, policy_fn=policy, stats=stats[-1])
        return stats
    return setup


def cell_recompute(cells="layers"):
    def setup(family):
        for cell in getattr(family, cells):
            cell.recompute()
    return setup


def main():
    def add_arguments(p):
        p.add_argument("--family", choices=FAMILIES, default="gpt", help="the model (default gpt: the reference GPT)")
        p.add_argument("--against", metavar="REV", help="also run the engine rows with the engine of git revision REV")
    a = parse_args(__doc__, add_arguments)
    synchronous_pynative()
    full_rc, mlp_rc, floor = "Cell.recompute() full", "Cell.recompute() mlp", "floor (baseline + 1 forward)"
    exclude = exclude_op(a.family)
    rows = [
        case(a, "baseline", lambda f: None),
        case(a, floor, lambda f: None, extra_forward=True),
        case(a, full_rc, cell_recompute(), ref=floor),
        case(a, "full", per_layer(), ref=floor),
        case(a, "full + exclude_op", per_layer(policy=rc.exclude_policy(exclude)), ref=full_rc),
        case(a, mlp_rc, cell_recompute("mlp")),
        case(a, "select mlp", per_layer(cells="mlp"), ref=mlp_rc),
        case(a, "select mlp + exclude_op", per_layer(policy=rc.exclude_policy(exclude), cells="mlp"), ref=mlp_rc),
    ]
    if a.against:
        workdir = tempfile.TemporaryDirectory(prefix="bench_recompute_")   # removed when main returns
        other, rev = package_of(a.against, workdir.name, "recompute"), a.against
        rows += [
            case(a, f"{rev}: full", per_layer(engine=other), ref=floor),
            case(a, f"{rev}: full + exclude_op", per_layer(policy=other.exclude_policy(exclude), engine=other),
                 ref=full_rc),
            case(a, f"{rev}: select mlp", per_layer(cells="mlp", engine=other), ref=mlp_rc),
            case(a, f"{rev}: select mlp + exclude_op",
                 per_layer(policy=other.exclude_policy(exclude), cells="mlp", engine=other), ref=mlp_rc),
        ]
    if a.profile:
        profile(rows, a.profile, a.warmup, a.steps)
        return
    run_interleaved(rows, a.warmup, a.steps)
    g = a.gpt
    dropout = "none" if not g.dropout or a.family == "llama" else (
        f"{g.dropout} ({'nn.Dropout, masks kept' if a.dropout_kind == 'nn' or a.family == 'plain' else DROPOUT_NAMES[a.dropout_kind] + ', drawn again'})")
    print(f"{build(a.family, a.gpt, a.batch).describe}, exclude_op {exclude}: {g.num_layers} layers, hidden {g.hidden_size}, heads "
          f"{g.num_heads}, seq {g.seq_length}, batch {a.batch}, dropout {dropout}; median of {a.steps} interleaved "
          f"steps after {a.warmup} warm-up; cpu = process CPU time (all threads)")
    print_table(rows, "baseline", lambda r: r.kept_and_rerun())
    if a.family == "gpt":
        inputs = a.batch * g.seq_length * g.hidden_size * 4 + g.seq_length ** 2 * 4   # hidden states + mask
        full = next(r for r in rows if r.name == "full")
        print(f"full: kept per layer {[round(s.peak_kept_bytes / inputs, 3) for s in full.stats]} x the layer's "
              f"inputs ({inputs / MiB:.4f} MiB: hidden states + attention mask; with --nn-dropout also the dropout "
              "masks at 1 bit per element)")


if __name__ == "__main__":
    main()
