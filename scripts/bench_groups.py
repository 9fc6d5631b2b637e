"""Layer groups (``recompute.group_layers``): what a group keeps at the end of forward and what it rebuilds
at once inside backward, per group size, on the reference GPT (full recompute of every layer).

    python scripts/bench_groups.py                  # the reference GPT: 8 layers, hidden 128, seq 64, batch 4
    python scripts/bench_groups.py --sizes 1 2 4 8

Per group size: the kept bytes at the end of forward (``measure_step`` on a light-path step), the largest
number of rebuilt bytes alive at once in backward (every tensor a recompute regenerates, counted by storage
from its re-run until it dies), their sum (a bound of the activation peak inside backward), and the step
time against group size 1 (median of interleaved steps, one process).
"""
import argparse
import statistics
import time
import weakref

import mindspore as ms

import mindformers_ac as mac
from mindformers_ac.harness.models import GPTConfig, build_gpt, synthetic_batch
from mindformers_ac.recompute import light, region
from mindformers_ac.tensors import MiB, storage_info


class RebuiltBytes:
    """Bytes of the storages a recompute regenerated that are still alive; ``peak`` their maximum."""

    def __init__(self):
        self.live = {}   # storage pointer -> [bytes, live tensor objects]
        self.now = self.peak = 0

    def add(self, t):
        ptr, nbytes = storage_info(t)
        entry = self.live.setdefault(ptr, [nbytes, 0])
        if entry[1] == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._drop, ptr)

    def _drop(self, ptr):
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]


def watch(meter):
    """Count every tensor the two recompute paths' pack hooks file (the regenerated ones)."""
    light_pack, region_pack = light._Collector.pack, region.Region.pack_recompute

    def collected(self, t):
        meter.add(t)
        return light_pack(self, t)

    def filed(self, run, t):
        meter.add(t)
        return region_pack(self, run, t)

    light._Collector.pack, region.Region.pack_recompute = collected, filed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    gpt = GPTConfig()
    meter = RebuiltBytes()
    watch(meter)
    runs = {}
    for size in args.sizes:
        model = build_gpt(gpt)
        mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": [f"0-{gpt.num_layers - 1}"],
                                                  "group_layers": size}})
        grad_fn = ms.value_and_grad(model, None, model.trainable_params())
        runs[size] = (model, grad_fn, [])
    batch = synthetic_batch(4, gpt.seq_length, gpt.vocab_size, seed=0)
    for step in range(2 + args.steps):   # interleaved; the first two steps check each call signature
        order = args.sizes if step % 2 == 0 else args.sizes[::-1]
        for size in order:
            _, grad_fn, times = runs[size]
            start = time.perf_counter()
            grad_fn(*batch)
            if step >= 2:
                times.append(time.perf_counter() - start)
    rows = []
    for size in args.sizes:
        model, grad_fn, times = runs[size]
        before = meter.peak = meter.now   # rebuilt bytes alive before this step (none, after a finished step)
        memory = mac.measure_step(model, grad_fn, *batch)
        rows.append((size, memory.kept_bytes, meter.peak - before, statistics.median(times)))
    base_time = rows[0][3]
    print(f"reference GPT {gpt.num_layers} layers, hidden {gpt.hidden_size}, seq {gpt.seq_length}, batch 4; "
          f"full recompute of every layer")
    print(f"{'group_layers':>12}  {'kept at end of forward MiB':>27}  {'rebuilt at once in backward MiB':>32}  "
          f"{'sum MiB':>8}  {'step time vs 1':>14}")
    for size, kept, rebuilt, seconds in rows:
        print(f"{size:>12}  {kept / MiB:>27.2f}  {rebuilt / MiB:>32.2f}  {(kept + rebuilt) / MiB:>8.2f}  "
              f"{seconds / base_time:>13.2f}x")


if __name__ == "__main__":
    main()
