"""Step time and kept activation bytes of the recompute engine against baseline and Cell.recompute().

    PYTHONPATH=. python scripts/bench_recompute.py [--layers 4 --hidden 256 --seq 128 --batch 4]

Rows: baseline, full, select mlp, select core_attention, full + exclude
matmul, MindSpore's Cell.recompute() (fresh model: it can't be undone), and
"baseline + 1 forward" (the floor for full recompute). Kept bytes come from
the engine's RecomputeStats for engine rows and from SavedTensorMeter for the
others (the engine's own hooks hide an outer meter inside its regions, so for
engine rows the meter is run too and the bytes outside the regions are added).
"""
import argparse
import gc
import statistics
import time

import mindspore as ms

from mindformers_ac.meter import SavedTensorMeter
from mindformers_ac.tensors import MiB
from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_nn_dropout
from mindformers_ac.harness.train import add_model_arguments, spec_from_args
from mindformers_ac import recompute as rc


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(p, layers=4, hidden=256, seq=128)
    p.add_argument("--nn-dropout", action="store_true",
                   help="MindSpore's nn.Dropout (masks kept as bits) instead of the reference model's "
                        "replayable SeededDropout (drawn again in recompute)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args()


def make_model(a):
    m = build_gpt(spec_from_args(a).gpt, seed=0)
    return use_nn_dropout(m) if a.nn_dropout else m


class Case:
    """One configuration: a fresh model, its step function, and the stats of its regions."""

    def __init__(self, a, name, setup, batch, extra_forward=False):
        self.name = name
        self.model = make_model(a)
        self.stats = setup(self.model)
        self.params = self.model.trainable_params()
        self.grad_fn = ms.value_and_grad(self.model, None, self.params)
        self.batch = batch
        self.extra_forward = extra_forward
        self.times = []

    def step(self):
        t0 = time.perf_counter()
        if self.extra_forward:
            self.model(*self.batch)
        _, grads = self.grad_fn(*self.batch)
        grads[0].asnumpy()
        return time.perf_counter() - t0

    def kept_and_rerun(self):
        """Kept bytes of one step: meter outside the regions plus each region's own peak."""
        meter = SavedTensorMeter(self.params)
        for s in self.stats or ():
            s.reset()
        with meter.hooks():
            self.grad_fn(*self.batch)
        kept = meter.peak + sum(s.peak_kept_bytes for s in self.stats or ())
        rerun = sum(s.ops_rerun for s in self.stats or ())
        return kept, rerun


def run_interleaved(a, cases):
    """Time cases round-robin, one step each per round, so drift on a busy machine hits all alike."""
    for case in cases:
        for _ in range(a.warmup):
            case.step()
    # Seven models are alive at once here, unlike in training: keep the cyclic GC from walking
    # all of them on every collection (that cost would land on whichever case allocates most).
    gc.collect()
    gc.freeze()
    for _ in range(a.steps):
        for case in cases:
            case.times.append(case.step())


def per_layer(policy=None, sub=None):
    def setup(model):
        stats = []
        for layer in model.decoder.layers:
            s = rc.RecomputeStats()
            target = layer if sub is None else sub(layer)
            rc.checkpoint_wrapper(target, policy_fn=policy, stats=s)
            stats.append(s)
        return stats
    return setup


def cell_recompute(model):
    for layer in model.decoder.layers:
        layer.recompute()
    return None


def main():
    a = parse_args()
    spec = spec_from_args(a)
    g = spec.gpt
    ms.set_context(mode=ms.PYNATIVE_MODE, pynative_synchronize=True)
    batch = synthetic_batch(spec.batch, g.seq_length, g.vocab_size, seed=0)
    layer_in = spec.batch * g.seq_length * g.hidden_size * 4
    cases = [
        Case(a, "baseline", lambda m: None, batch),
        Case(a, "baseline + 1 forward", lambda m: None, batch, extra_forward=True),
        Case(a, "Cell.recompute() full", cell_recompute, batch),
        Case(a, "full", per_layer(), batch),
        Case(a, "select mlp", per_layer(sub=lambda l: l.mlp), batch),
        Case(a, "select core_attention", per_layer(sub=lambda l: l.self_attention.core_attention), batch),
        Case(a, "full + exclude matmul", per_layer(policy=rc.exclude_policy(["matmul"])), batch),
    ]
    run_interleaved(a, cases)
    base = statistics.median(cases[0].times)
    print(f"model: {g.num_layers} layers, hidden {g.hidden_size}, heads {g.num_heads}, seq {g.seq_length}, "
          f"batch {spec.batch}, dropout {g.dropout}; median of {a.steps} interleaved steps; "
          f"layer input {layer_in / MiB:.2f} MiB per layer")
    print(f"{'config':<24}{'step s':>8}{'x base':>8}{'x Cell.rc':>10}{'kept MiB':>10}{'ops rerun':>10}")
    cell_rc = statistics.median(cases[2].times)
    for case in cases:
        t = statistics.median(case.times)
        kept, rerun = case.kept_and_rerun()
        print(f"{case.name:<24}{t:>8.3f}{t / base:>8.2f}{t / cell_rc:>10.2f}{kept / MiB:>10.2f}{rerun:>10}")
    full = cases[3]
    per_layer_kept = [s.peak_kept_bytes for s in full.stats]
    inputs = layer_in + g.seq_length * g.seq_length * 4   # hidden states and the additive attention mask
    print(f"full: kept per layer {[round(b / inputs, 3) for b in per_layer_kept]} x the layer's inputs "
          f"({inputs / MiB:.4f} MiB: hidden states + attention mask; with --nn-dropout also the "
          f"dropout masks at 1 bit per element)")
    print(f"dropout: {'nn.Dropout, masks kept' if a.nn_dropout else 'replayable SeededDropout, drawn again'}")


if __name__ == "__main__":
    main()
