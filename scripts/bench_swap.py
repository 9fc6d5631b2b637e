"""Benchmark: step time and bytes of layer swap (host backend) with and without prefetch vs no swap.

    PYTHONPATH=. python scripts/bench_swap.py [--shape small|mid] [--dropout 0] [--nn-dropout] [--steps 10]
    PYTHONPATH=. python scripts/bench_swap.py --shape small --profile "layer swap, prefetch=1"
    PYTHONPATH=. python scripts/bench_swap.py --shape small --steps 30 --against REV --profile "layer swap, on demand" "REV: layer swap, on demand"
    PYTHONPATH=. python scripts/bench_swap.py --shape small --against REV   # + the swap rows of git revision REV

``--against REV`` adds the two swap-all rows with the swap engine of another revision of this repository
(``git archive REV mindformers_ac``, imported under another package name), interleaved with the others in
the same process: before/after ratios that the load of a shared machine cannot skew.

Swaps layers 0..L-2 (the last layer triggers layer L-2's prefetch). Prints a table: median step time
(forward + backward + SGD update) in wall and process CPU time, ratios to the baseline, and the per-step
MiB offloaded, prefetched in time, late, loaded on demand and left resident.
"""
import tempfile

import mindspore as ms
from mindspore import nn

from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_dropout
from mindformers_ac.mindspore_compat import synchronous_pynative
from mindformers_ac.swap import install_layer_swap
from mindformers_ac.tensors import MiB

from bench_common import DROPOUT_NAMES, Row, package_of, parse_args, print_table, profile, run_interleaved


def swap_row(a, name, prefetch, layer_ids=None, install=install_layer_swap):
    """A fresh model + SGD, with layer swap of ``layer_ids`` (default: all but the last) unless ``prefetch``
    is None; the row keeps the last report. ``install``: the ``install_layer_swap`` to use."""
    model = build_gpt(a.gpt, seed=0)
    use_dropout(model, a.dropout_kind)
    layer_ids = range(a.gpt.num_layers - 1) if layer_ids is None else layer_ids
    inst = None if prefetch is None else install(model.decoder.layers, layer_ids, prefetch=prefetch,
                                                            model=model)
    batch = synthetic_batch(a.batch, a.gpt.seq_length, a.gpt.vocab_size, seed=1)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    opt = nn.SGD(model.trainable_params(), learning_rate=0.01)

    def step():
        _, grads = grad_fn(*batch)
        opt(grads)
        if inst is not None:
            row.snap = inst.report.end_step()

    row = Row(name, step)
    row.snap = None
    return row


def mib_columns(row):
    keys = {"offloaded": "offloaded_bytes", "in time": "prefetched_bytes", "late": "late_bytes",
            "on demand": "on_demand_bytes", "resident": "resident_bytes"}
    return {f"{k} MiB": "-" if row.snap is None else f"{row.snap[v] / MiB:.2f}" for k, v in keys.items()}


def main():
    def add_arguments(p):
        p.add_argument("--prefetch", type=int, default=1)
        p.add_argument("--against", metavar="REV", help="also run the swap rows with the engine of git revision REV")
    a = parse_args(__doc__, add_arguments)
    synchronous_pynative()
    ms.set_seed(1)
    rows = [swap_row(a, "baseline", None), swap_row(a, f"layer swap, prefetch={a.prefetch}", a.prefetch),
            swap_row(a, "layer swap, on demand", 0),
            # the other layers have nothing installed: this row costs 1/(L-1) of the swap-all row, or less
            swap_row(a, "layer 0 only, prefetch=1", 1, layer_ids=[0])]
    if a.against:
        workdir = tempfile.TemporaryDirectory(prefix="bench_swap_")   # removed when main returns
        other = package_of(a.against, workdir.name, "swap").install_layer_swap
        rows += [swap_row(a, f"{a.against}: layer swap, prefetch={a.prefetch}", a.prefetch, install=other),
                 swap_row(a, f"{a.against}: layer swap, on demand", 0, install=other)]
    if a.profile:
        profile(rows, a.profile, a.warmup, a.steps)
        return
    run_interleaved(rows, a.warmup, a.steps)
    g = a.gpt
    print(f"{g.num_layers} layers, hidden {g.hidden_size}, seq {g.seq_length}, batch {a.batch}, dropout {g.dropout}"
          f"{'' if a.dropout_kind == 'seeded' else f' ({DROPOUT_NAMES[a.dropout_kind]})'}; swapped layers 0..{g.num_layers - 2} (or 0 only); median of {a.steps} "
          f"interleaved steps after {a.warmup} warm-up; cpu = process CPU time (all threads)")
    print_table(rows, "baseline", mib_columns)


if __name__ == "__main__":
    main()
