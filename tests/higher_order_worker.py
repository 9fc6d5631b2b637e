"""Grad of grad through each AC mode, in a subprocess: prints one JSON line per mode.

Run by ``test_higher_order.py``: a refused higher-order gradient raises inside
MindSpore's backward, which can leave the executor broken for the process.
"""
import json
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.mindspore_compat import synchronous_pynative

synchronous_pynative("CPU")

MODES = {
    "full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"]}},
    "group": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"], "group_layers": 3}},
    "select_op": {"recompute": {"mode": "select", "select_module": {"act": ["0-2"]}}},
    "select_linear": {"recompute": {"mode": "select", "select_module": {"fc": ["0-2"]}}},
    "layer_swap": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}},
}


class Layer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(8, 8)
        # silu saves its input: output recompute of it drops the output mul saves (tanh saves its output,
        # whose re-run would need its input instead: output recompute then runs it as without AC)
        self.act = ops.silu

    def construct(self, x):
        return self.act(self.fc(x)) * x


class Model(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([Layer() for _ in range(3)])
        for i, p in enumerate(self.trainable_params()):
            p.set_data(Tensor(np.random.RandomState(i).uniform(-0.5, 0.5, p.shape).astype(np.float32)))

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).sum()


def grad_of_grad(model, x):
    first = ms.grad(model)
    return ms.grad(lambda v: first(v).sum())(x).asnumpy()


def main(mode, warm_first):
    x = Tensor(np.random.RandomState(9).randn(2, 8).astype(np.float32))
    expected = grad_of_grad(Model(), x)
    model = Model()
    mac.apply_ac(model, config=mac.AcConfig.from_dict(MODES[mode]))
    if warm_first:   # a first-order step first, so that later calls take the light path
        ms.grad(model)(x)
    result = {"mode": mode}
    try:
        result["equal"] = bool(np.array_equal(grad_of_grad(model, x), expected))
    except RuntimeError as exc:
        result["error"] = str(exc).splitlines()[0]
        result["error_type"] = type(exc).__name__
    # first-order training still works in this process after a refusal
    result["first_order_equal"] = bool(np.array_equal(ms.grad(model)(x).asnumpy(), ms.grad(Model())(x).asnumpy()))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "warm")
