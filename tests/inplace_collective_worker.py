"""Under msrun (2 ranks): a layer reduces a tensor in place with ``mint.distributed.all_reduce(t)`` and goes on
with ``t``; full recompute with ``exclude_op: [AllReduce]`` (the memory guide's advice for tensor parallelism)
against the same model without AC, bitwise, 3 steps (rule W3 of docs/exactness.md).

    inplace_collective_worker.py OUT_DIR   -> OUT_DIR/rank{r}.json: {"difference", "reused", "rerun_by_op"}
"""
import json
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore.communication import get_rank, init

import mindformers_ac as mac
from mindformers_ac.mindspore_compat import synchronous_pynative

H, S, B, N_LAYERS = 16, 4, 2, 2


class ReducingLayer(nn.Cell):
    def __init__(self, seed):
        super().__init__()
        rs = np.random.RandomState(seed)
        self.w1 = Parameter(Tensor(rs.randn(H, H).astype(np.float32) * 0.3), name="w1")
        self.w2 = Parameter(Tensor(rs.randn(H, H).astype(np.float32) * 0.3), name="w2")

    def construct(self, x):
        t = ops.matmul(ops.sin(x), self.w1)     # a rank's partial sum
        mint.distributed.all_reduce(t)          # reduced in place: the layer goes on with t
        return x + ops.matmul(ops.tanh(t), self.w2)


class Model(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([ReducingLayer(i) for i in range(N_LAYERS)])

    def construct(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x.sum(-1) - y) ** 2).mean()


def train(ac):
    model = Model()
    if ac:
        mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": [f"0-{N_LAYERS - 1}"],
                                                  "exclude_op": ["AllReduce"]}})
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history = []
    for step in range(3):
        rs = np.random.RandomState(100 * get_rank() + step)   # each rank its own batch
        loss, grads = grad_fn(Tensor(rs.randn(B, S, H).astype(np.float32)), Tensor(rs.randn(B, S).astype(np.float32)))
        opt(grads)
        history.append([loss.asnumpy().tobytes()] + [g.asnumpy().tobytes() for g in grads]
                       + [p.asnumpy().tobytes() for p in model.get_parameters()])
    return history, model


def main(out_dir):
    synchronous_pynative("CPU")
    init()
    base, _ = train(False)
    got, model = train(True)
    diff = next((f"step {s}: value {i}" for s, (a, b) in enumerate(zip(base, got))
                 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    stats = list(mac.ac_state(model).recompute_stats.values())
    result = {"difference": diff, "reused": sum(s.ops_reused for s in stats),
              "rerun_by_op": dict(sum((s.rerun_by_op for s in stats), start=__import__("collections").Counter()))}
    with open(os.path.join(out_dir, f"rank{get_rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
