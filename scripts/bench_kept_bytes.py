"""Bytes kept for backward when a policy keeps ops' outputs (rule K1 of docs/exactness.md), against no AC.

    python scripts/bench_kept_bytes.py

Three cases, each trained 3 steps (the later ones on the light path where it applies):

* an attention block whose four linear maps and two batch matmuls are kept (HyperParallel's and
  torchtitan's memory tests keep the matmuls of a region): kept bytes without AC, keeping the matmuls, full
  recompute;
* a chain of four kept ops where only the first and the last outputs are read by a backward;
* the reference GPT (4 layers) with ``exclude_op: [MatMul]``, per layer, against the same layers without AC
  (``measure_step``).

Without AC the figure is a ``SavedTensorMeter`` around the step (weights excluded); with AC, what the
regions report (``RecomputeStats.peak_kept_bytes``), which counts the same storages the same way.
"""
import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

import mindformers_ac as mac
from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.meter import SavedTensorMeter
from mindformers_ac.mindspore_compat import synchronous_pynative
from mindformers_ac.recompute import checkpoint_wrapper, exclude_policy

H = 64


class Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        rs = np.random.RandomState(0)
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, Parameter(Tensor(rs.randn(H, H).astype(np.float32) * 0.1), name=name))
        self.mm = ops.MatMul()
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()

    def construct(self, x):
        flat = x.reshape(-1, H)
        q, k, v = (ops.relu(self.mm(flat, w)).reshape(x.shape) for w in (self.wq, self.wk, self.wv))
        p = ops.softmax(self.bmm_qk(q, k) * 0.125, -1)
        return ops.sin(self.mm(ops.tanh(self.bmm_pv(p, v)).reshape(-1, H), self.wo))


class Chain(nn.Cell):
    """Four kept matmuls in a row; only the first's output (sin reads it) and the last's (tanh reads it) are
    saved by a backward: the middle ones feed matmuls whose weights are constants."""

    def __init__(self):
        super().__init__()
        rs = np.random.RandomState(1)
        self.w = Parameter(Tensor(rs.randn(H, H).astype(np.float32) * 0.1), name="w")
        self.c = Tensor(rs.randn(H, H).astype(np.float32) * 0.1)
        self.mm = ops.MatMul()

    def construct(self, x):
        a = ops.sin(self.mm(x.reshape(-1, H), self.w))
        b = self.mm(self.mm(self.mm(a, self.c), self.c), self.c)
        return ops.tanh(b)


def run_block(build, policy):
    """``(gradients of 3 steps, kept bytes, stats)`` of a fresh ``build()``: ``policy`` None is no AC (a meter
    around each step), ``"full"`` full recompute, else a ``policy_fn`` for ``checkpoint_wrapper``."""
    x = Tensor(np.random.RandomState(2).randn(4, 32, H).astype(np.float32))
    cell, stats = build(), mac.RecomputeStats()
    meter = SavedTensorMeter(params=cell.trainable_params())
    if policy is not None:
        checkpoint_wrapper(cell, policy_fn=None if policy == "full" else policy, stats=stats)
    grad_fn = ms.grad(lambda t: cell(t).sum(), grad_position=None, weights=cell.trainable_params())
    grads = []
    for _ in range(3):
        with meter.hooks():
            grads.append([g.asnumpy() for g in grad_fn(x)])
    return grads, (meter.peak if policy is None else stats.peak_kept_bytes), stats


def _gpt_layers(exclude):
    model = build_gpt(num_layers=4, hidden_size=64, num_heads=4, seq_length=32, vocab_size=128, dropout=0.0)
    if exclude is not None:
        mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-3"],
                                                  "exclude_op": exclude}})
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    batch = synthetic_batch(4, 32, 128, seed=0)
    for _ in range(2):
        grad_fn(*batch)
    memory = mac.measure_step(model, grad_fn, *batch)
    return sum(lm.kept_bytes for key, lm in memory.layers.items() if key != "other")


def main():
    synchronous_pynative("CPU")
    print(f"{'case':<34} {'no AC B':>10} {'keep matmuls B':>15} {'full recompute B':>17} {'keep / no AC':>13}")
    for name, build in (("attention block", Attention), ("chain of four kept matmuls", Chain)):
        none, keep, full = (run_block(build, p)[1] for p in (None, exclude_policy(["matmul"]), "full"))
        print(f"{name:<34} {none:>10,} {keep:>15,} {full:>17,} {keep / none:>12.2f}x")
    none, keep, full = _gpt_layers(None), _gpt_layers(["MatMul"]), _gpt_layers([])
    print(f"{'reference GPT, layers 0-3':<34} {none:>10,} {keep:>15,} {full:>17,} {keep / none:>12.2f}x")


if __name__ == "__main__":
    main()
