"""Benchmark: step time and bytes of layer swap (host backend) with and without prefetch vs no swap.

    PYTHONPATH=. python scripts/bench_swap.py [--shape small|mid] [--dropout 0] [--nn-dropout] [--steps 10]
    PYTHONPATH=. python scripts/bench_swap.py --shape small --profile "layer swap, prefetch=1"

Swaps layers 0..L-2 (the last layer triggers layer L-2's prefetch). Prints a table: median step time
(forward + backward + SGD update) in wall and process CPU time, ratios to the baseline, and the per-step
MiB offloaded, prefetched in time, late, loaded on demand and left resident.
"""
import mindspore as ms
from mindspore import nn

from bench_common import Row, parse_args, print_table, profile, run_interleaved
from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_nn_dropout
from mindformers_ac.mindspore_compat import synchronous_pynative
from mindformers_ac.swap import install_layer_swap
from mindformers_ac.tensors import MiB


def swap_row(a, name, prefetch, layer_ids=None):
    """A fresh model + SGD, with layer swap of ``layer_ids`` (default: all but the last) unless ``prefetch``
    is None; the row keeps the last report."""
    model = build_gpt(a.gpt, seed=0)
    if a.nn_dropout:
        use_nn_dropout(model)
    layer_ids = range(a.gpt.num_layers - 1) if layer_ids is None else layer_ids
    inst = None if prefetch is None else install_layer_swap(model.decoder.layers, layer_ids, prefetch=prefetch,
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
    a = parse_args(__doc__, lambda p: p.add_argument("--prefetch", type=int, default=1))
    synchronous_pynative()
    ms.set_seed(1)
    rows = [swap_row(a, "baseline", None), swap_row(a, f"layer swap, prefetch={a.prefetch}", a.prefetch),
            swap_row(a, "layer swap, on demand", 0),
            # the other layers have nothing installed: this row costs 1/(L-1) of the swap-all row, or less
            swap_row(a, "layer 0 only, prefetch=1", 1, layer_ids=[0])]
    if a.profile:
        profile(rows, a.profile, a.warmup, a.steps)
        return
    run_interleaved(rows, a.warmup, a.steps)
    g = a.gpt
    print(f"{g.num_layers} layers, hidden {g.hidden_size}, seq {g.seq_length}, batch {a.batch}, dropout {g.dropout}"
          f"{' (nn.Dropout)' if a.nn_dropout else ''}; swapped layers 0..{g.num_layers - 2} (or 0 only); median of {a.steps} "
          f"interleaved steps after {a.warmup} warm-up; cpu = process CPU time (all threads)")
    print_table(rows, "baseline", mib_columns)


if __name__ == "__main__":
    main()
