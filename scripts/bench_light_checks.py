"""What the light path's new checks cost per recomputed region, against one step of the model.

    PYTHONPATH=scripts:. python scripts/bench_light_checks.py [--shape small mid] [--repeat 2000]

Per region and step the engine now takes a ``RandomState`` when the forward starts and sets and puts back
one around the re-run (functional random ops draw what their forward drew), copies 64 elements of the
light forward's output and compares them after the re-run (``rules.safety_net.Sample``: another code path is
caught; read in place on the host, the CPU build's case, and for comparison with the ``GatherNd`` a device
tensor gets, ``SampleIndex(on_host=False)``), and hands the re-run its tracked input as a view (an in-place
write into it works). Each piece is timed alone, on the shape's hidden state, and the sum for the model's layers
is shown next to the baseline step of the reference GPT at that shape (medians, one process).
"""
import argparse
import statistics
import time

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindformers_ac.harness.models import GPTConfig
from mindformers_ac.mindspore_compat import RandomState, synchronous_pynative
from mindformers_ac.recompute.path_choice import PathCheck
from mindformers_ac.recompute.rules.safety_net import Sample, SampleIndex

from bench_common import SHAPES
from bench_families import build


def median_us(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def baseline_step_ms(shape, steps=15):
    """Median step (forward and backward) of the reference GPT without AC at ``shape``."""
    dims = SHAPES[shape]
    gpt = GPTConfig(num_layers=dims["layers"], hidden_size=dims["hidden"], num_heads=4, seq_length=dims["seq"],
                    vocab_size=512, dropout=0.1)
    family = build("gpt", gpt, dims["batch"], gpt.dropout)
    grad_fn = ms.value_and_grad(family.model, None, family.model.trainable_params())
    for _ in range(3):
        grad_fn(*family.batch)
    return median_us(lambda: grad_fn(*family.batch)[1][0].asnumpy(), steps) / 1000


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", choices=SHAPES, default=["small", "mid"])
    p.add_argument("--repeat", type=int, default=2000)
    a = p.parse_args()
    synchronous_pynative("CPU")
    print("| shape | RandomState (take) us | RandomState (restore) us | output probe (take) us | "
          "output probe (compare) us | the same with GatherNd (take / compare) us | input view us | "
          "per region per step us | layers | baseline step ms | all regions / baseline step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in a.shape:
        dims = SHAPES[shape]
        x = Tensor(np.random.RandomState(0).randn(dims["batch"], dims["seq"], dims["hidden"]).astype(np.float32))
        check = PathCheck()
        state = RandomState()
        probe = Sample(x, check.probe_index)
        leaf = x.copy()
        leaf.requires_grad_()
        take = median_us(RandomState, a.repeat)
        restore = median_us(state.restore, a.repeat)
        probe_take = median_us(lambda: Sample(x, check.probe_index), a.repeat)
        probe_cmp = median_us(lambda: probe.matches(x), a.repeat)
        on_device = SampleIndex(on_host=False)
        gathered = Sample(x, on_device)
        gather_take = median_us(lambda: Sample(x, on_device), a.repeat)
        gather_cmp = median_us(lambda: gathered.matches(x), a.repeat)
        view = median_us(lambda: leaf.view(leaf.shape), a.repeat)
        # forward: take + probe; re-run: take (current) + restore (forward's) + restore (current) + compare + view
        per_region = 2 * take + 2 * restore + probe_take + probe_cmp + view
        step_ms = baseline_step_ms(shape)
        share = per_region * dims["layers"] / (step_ms * 1000)
        print(f"| {shape} | {take:.1f} | {restore:.1f} | {probe_take:.1f} | {probe_cmp:.1f} | "
              f"{gather_take:.1f} / {gather_cmp:.1f} | {view:.1f} | "
              f"{per_region:.1f} | {dims['layers']} | {step_ms:.1f} | {share:.2%} |")


if __name__ == "__main__":
    main()
