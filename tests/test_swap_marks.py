"""swap_tensor_wrapper moves bytes or says why (issue 38, point 3).

Scenario ported from HyperParallel's MindSpore swap test model
(tests/mindspore/st/activation_checkpoint/swap_activation.py: a
TransformerBlock whose attention and FFN start with ``nn.Dense`` on 3-D
inputs) with the marks of its guide's ``swap_tensor_wrapper`` example
(``attn_out``, ``norm1_out``), layers linked by ``SwapManager``. ``nn.Dense``
reshapes a 3-D input into new storage before its MatMul saves it: the mark
follows that copy (same values), so ``norm1_out`` is offloaded; ``attn_out``
is saved by no op (the residual add saves nothing, the norm saves the sum),
so the report counts it under ``unsaved_marks`` and a warning names it.
"""
import logging

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac

DIM, HEADS, SEQ, BATCH = 32, 4, 8, 2


class SelfAttention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.qkv = nn.Dense(DIM, DIM * 3, has_bias=False)
        self.out_proj = nn.Dense(DIM, DIM, has_bias=False)

    def construct(self, x):
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, HEADS, self.head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = mint.bmm(q.reshape(-1, s, self.head_dim),
                        k.reshape(-1, s, self.head_dim).transpose(0, 2, 1)) * (self.head_dim ** -0.5)
        out = mint.bmm(mint.nn.functional.softmax(attn, dim=-1), v.reshape(-1, s, self.head_dim))
        return self.out_proj(out.view(b, HEADS, s, self.head_dim).transpose(0, 2, 1, 3).reshape(b, s, d))


class TransformerBlock(nn.Cell):
    def __init__(self, marks):
        super().__init__()
        self.marks = marks
        self.attn = SelfAttention()
        self.norm1 = nn.LayerNorm((DIM,))
        self.norm2 = nn.LayerNorm((DIM,))
        self.ffn = nn.SequentialCell(nn.Dense(DIM, DIM * 4), nn.ReLU(), nn.Dense(DIM * 4, DIM))

    def construct(self, x):
        attn_out = self.attn(x)
        if self.marks:
            attn_out = mac.swap_tensor_wrapper(attn_out, tag="attn_out")
        x = self.norm1(x + attn_out)
        if self.marks:
            x = mac.swap_tensor_wrapper(x, tag="norm1_out")
        x = x + self.ffn(x)
        return self.norm2(x)


class Model(nn.Cell):
    def __init__(self, marks):
        super().__init__()
        self.layers = nn.CellList([TransformerBlock(marks) for _ in range(3)])
        for i, (_, p) in enumerate(sorted(self.parameters_and_names())):
            p.set_data(Tensor(np.random.RandomState(i).uniform(-0.2, 0.2, p.shape).astype(np.float32)))

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).mean()


def _train(model, steps=2):
    opt = nn.SGD(model.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history = []
    for step in range(steps):
        x = Tensor(np.random.RandomState(50 + step).randn(BATCH, SEQ, DIM).astype(np.float32))
        loss, grads = grad_fn(x)
        opt(grads)
        history.append([loss.asnumpy().tobytes()] + [g.asnumpy().tobytes() for g in grads])
    return history


def test_marks_follow_dense_reshapes_and_unsaved_marks_are_named(caplog, fresh_swap_manager):
    expected = _train(Model(marks=False))
    model = Model(marks=True)
    manager = mac.SwapManager()
    for i in range(len(model.layers) - 1):
        manager.set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    with caplog.at_level(logging.WARNING, logger="mindformers_ac.swap"):
        assert _train(model, steps=1) == expected[:1]
    layers = manager.report.as_dict()["layers"]
    assert len(layers) == 2   # the two linked layers (the last one links none)
    norm1_bytes = BATCH * SEQ * DIM * 4
    for stats in layers.values():
        # norm1_out reached ffn[0]'s MatMul as nn.Dense's 2-D copy: offloaded once (ffn[0]'s saved input)
        assert stats["offloaded_bytes"] == norm1_bytes and stats["num_offloaded"] == 1, stats
        assert stats["unsaved_marks"] == {"attn_out": 1}, stats
    warned = [r.getMessage() for r in caplog.records if "offloaded nothing" in r.getMessage()]
    assert len(warned) == 1 and "swap_tensor_wrapper(tag='attn_out')" in warned[0], warned
    assert "no op saved it, nor a copy of it" in warned[0]


class MadeAndMarked(nn.Cell):
    """tanh saves its own output: a mark placed after it comes too late for that save."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(DIM, DIM)

    def construct(self, x):
        return mac.swap_tensor_wrapper(ops.tanh(self.fc(x)), tag="tanh_out") * 2


def test_a_mark_after_its_save_is_named(caplog, fresh_swap_manager):
    a, b = MadeAndMarked(), MadeAndMarked()
    mac.SwapManager().set_forward_prefetch_layer(a, b)
    x = Tensor(np.ones((BATCH, SEQ, DIM), np.float32))
    with caplog.at_level(logging.WARNING, logger="mindformers_ac.swap"):
        ms.grad(lambda v: b(a(v)).sum())(x)
    (stats,) = mac.SwapManager().report.as_dict()["layers"].values()
    assert stats["num_offloaded"] == 0 and stats["unsaved_marks"] == {"tanh_out": 1}
    assert any("tag='tanh_out'" in r.getMessage() and "saved before the mark, by the op that made it"
               in r.getMessage() for r in caplog.records)
