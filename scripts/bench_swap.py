"""Benchmark: step time and bytes of layer swap with and without prefetch vs no swap.

    PYTHONPATH=. python scripts/bench_swap.py [--layers 4 --hidden 256 --seq 128 --batch 4 --steps 10]

Swaps layers 0..L-2 (the last layer triggers layer L-2's prefetch). Prints a table:
median step time (forward + backward + SGD update), ratio to baseline, and the
per-step bytes offloaded, prefetched in time, loaded on demand and left resident.
"""
import argparse
import statistics
import time

import mindspore as ms
from mindspore import nn

from mindformers_ac.harness.models import build_gpt
from mindformers_ac.harness.train import add_model_arguments, spec_from_args
from mindformers_ac.swap import install_layer_swap

MiB = 2 ** 20


class Runner:
    """One model + optimizer, optionally with layer swap; ``step()`` times one training step."""

    def __init__(self, spec, prefetch):
        self.model = build_gpt(spec.gpt, seed=0)
        self.inst = None
        if prefetch is not None:
            self.inst = install_layer_swap(self.model.decoder.layers, range(spec.gpt.num_layers - 1),
                                           prefetch=prefetch, model=self.model)
        self.batch = spec.synthetic_batches()(1)
        self.grad_fn = ms.value_and_grad(self.model, None, self.model.trainable_params())
        self.opt = nn.SGD(self.model.trainable_params(), learning_rate=0.01)
        self.times, self.snap = [], None

    def step(self, record):
        t0 = time.perf_counter()
        _, grads = self.grad_fn(*self.batch)
        self.opt(grads)
        dt = time.perf_counter() - t0
        if self.inst is not None:
            self.snap = self.inst.report.end_step()
        if record:
            self.times.append(dt)

    def close(self):
        if self.inst is not None:
            self.inst.remove()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, layers=4, hidden=256, seq=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefetch", type=int, default=1)
    args = p.parse_args()
    spec = spec_from_args(args)
    g = spec.gpt
    ms.set_context(mode=ms.PYNATIVE_MODE, pynative_synchronize=True)

    rows = [("baseline", None), (f"layer swap, prefetch={args.prefetch}", args.prefetch),
            ("layer swap, on demand", 0)]
    ms.set_seed(1)
    runners = [Runner(spec, pf) for _, pf in rows]
    # Round-robin steps so drift in machine load (2 shared cores) hits every configuration alike.
    for step in range(args.warmup + args.steps):
        for r in runners:
            r.step(record=step >= args.warmup)
    results = [(name, statistics.median(r.times), r.snap) for (name, _), r in zip(rows, runners)]
    for r in runners:
        r.close()
    base = results[0][1]
    print(f"{g.num_layers} layers, hidden {g.hidden_size}, seq {g.seq_length}, batch {spec.batch}, "
          f"dropout {g.dropout}; swapped layers 0..{g.num_layers - 2}; median of {args.steps} interleaved steps after {args.warmup} warmup")
    hdr = f"{'config':<26}{'step s':>9}{'ratio':>8}{'offload MiB':>13}{'in time MiB':>13}" \
          f"{'late MiB':>10}{'on demand MiB':>15}{'resident MiB':>14}"
    print(hdr)
    print("-" * len(hdr))
    for name, t, snap in results:
        if snap is None:
            print(f"{name:<26}{t:>9.3f}{t / base:>8.2f}{'-':>13}{'-':>13}{'-':>10}{'-':>15}{'-':>14}")
            continue
        print(f"{name:<26}{t:>9.3f}{t / base:>8.2f}{snap['offloaded_bytes'] / MiB:>13.2f}"
              f"{snap['prefetched_bytes'] / MiB:>13.2f}{snap['late_bytes'] / MiB:>10.2f}"
              f"{snap['on_demand_bytes'] / MiB:>15.2f}{snap['resident_bytes'] / MiB:>14.2f}")


if __name__ == "__main__":
    main()
