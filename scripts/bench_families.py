"""The three model families the recompute benchmark runs on, each at the shape ``bench_common`` resolves.

* ``gpt``: the reference GPT (``harness/models.py``; dropout: its replayable
  ``SeededDropout``, ``SeededKernelDropout`` with ``--kernel-dropout`` or ``nn.Dropout`` with ``--nn-dropout``);
* ``plain``: a plain pre-LN transformer with another op mix, as a user writes
  one: ``mint.nn.Linear``, ``nn.LayerNorm``, ``ops.gelu``, ``ops.softmax``,
  ``nn.Dropout`` after attention and MLP when dropout > 0, loss
  ``(x * x).mean()``, the layers in ``layers``;
* ``llama``: the LLaMA of ``docs/own_model.md`` (RMSNorm, rotary, GQA, SwiGLU),
  its code taken from the doc's ``llama_factory.py`` block with the shape
  constants replaced, so the benchmark runs exactly what the doc shows; it
  has no dropout;
* ``moe``: the reference MoE GPT (``harness/moe.py``: every layer a MoE layer,
  4 experts, top-2, a shared expert; one process, so its all-to-alls are
  copies), its "MLP" the MoE block.

``exclude_op(family)`` is the ``exclude_op`` list the benchmark's exclude rows use:
``matmul``, or ``AllToAll`` on the MoE model (the config the guide gives expert
parallelism).

``build(family, gpt, batch, dropout, dropout_kind) -> Family``: a fresh model with
fixed weights, one batch, its layer cells and each layer's MLP cell.
"""
import os
import re
import types
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_dropout

FAMILIES = ("gpt", "plain", "llama", "moe")
_EXCLUDE_OP = {"moe": ["AllToAll"]}


def exclude_op(family):
    """The ``exclude_op`` list of the benchmark's exclude rows for ``family``."""
    return _EXCLUDE_OP.get(family, ["matmul"])
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "own_model.md")


@dataclass
class Family:
    model: nn.Cell
    batch: tuple
    layers: list          # the layer cells, in order
    mlp: list             # each layer's MLP cell (select-recompute target)
    describe: str


class PlainLayer(nn.Cell):
    def __init__(self, h, heads, p):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm((h,)), nn.LayerNorm((h,))
        self.qkv, self.proj = mint.nn.Linear(h, 3 * h), mint.nn.Linear(h, h)
        self.mlp = PlainMLP(h, p)
        self.drop = nn.Dropout(p=p) if p > 0 else None

    def construct(self, x):
        b, s, h = x.shape
        q, k, v = ops.split(self.qkv(self.norm1(x)), h, -1)
        q, k, v = (t.reshape(b, s, self.heads, h // self.heads).swapaxes(1, 2) for t in (q, k, v))
        a = ops.softmax(ops.matmul(q, k.swapaxes(-1, -2)) * (h // self.heads) ** -0.5, -1)
        a = self.proj(ops.matmul(a, v).swapaxes(1, 2).reshape(b, s, h))
        x = x + (self.drop(a) if self.drop is not None else a)
        return x + self.mlp(self.norm2(x))


class PlainMLP(nn.Cell):
    def __init__(self, h, p):
        super().__init__()
        self.fc1, self.fc2 = mint.nn.Linear(h, 4 * h), mint.nn.Linear(4 * h, h)
        self.drop = nn.Dropout(p=p) if p > 0 else None

    def construct(self, x):
        y = self.fc2(ops.gelu(self.fc1(x)))
        return self.drop(y) if self.drop is not None else y


class PlainTransformer(nn.Cell):
    def __init__(self, layers, h, heads, p):
        super().__init__()
        self.layers = nn.CellList([PlainLayer(h, heads, p) for _ in range(layers)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).mean()


def _fixed_weights(model):
    for i, p in enumerate(model.trainable_params()):
        p.set_data(Tensor(np.random.RandomState(i).uniform(-0.1, 0.1, p.shape).astype(np.float32)))
    return model


def _llama_module(gpt, batch):
    """The doc's ``llama_factory.py``, with its shape constants set to this benchmark's shape."""
    text = open(DOC, encoding="utf-8").read()
    code = text.split("<!-- regen_docs: file llama_factory.py -->", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    line = (f"DIM, HEADS, KV_HEADS, LAYERS, VOCAB, SEQ, BATCH = {gpt.hidden_size}, {gpt.num_heads}, "
            f"{max(1, gpt.num_heads // 2)}, {gpt.num_layers}, {gpt.vocab_size}, {gpt.seq_length}, {batch}")
    code, n = re.subn(r"^DIM, HEADS, KV_HEADS, LAYERS, VOCAB, SEQ, BATCH = .*$", line, code, flags=re.M)
    if n != 1:
        raise SystemExit(f"{DOC}: the llama_factory.py block no longer sets its shape in one line")
    module = types.ModuleType("llama_factory")
    exec(compile(code, "llama_factory.py", "exec"), module.__dict__)   # noqa: S102  (the repo's own doc)
    return module


def build(family, gpt, batch, dropout=0.0, dropout_kind="seeded"):
    if family == "gpt":
        model = use_dropout(build_gpt(gpt, seed=0), dropout_kind)
        layers = list(model.decoder.layers)
        return Family(model, synthetic_batch(batch, gpt.seq_length, gpt.vocab_size, seed=0), layers,
                      [layer.mlp for layer in layers], "reference GPT")
    if family == "moe":
        from mindformers_ac.harness.moe import build_moe_gpt
        model = use_dropout(build_moe_gpt(gpt, seed=0, num_experts=4, top_k=2), dropout_kind)
        layers = list(model.decoder.layers)
        return Family(model, synthetic_batch(batch, gpt.seq_length, gpt.vocab_size, seed=0), layers,
                      [layer.mlp for layer in layers], "reference MoE GPT (4 experts, top-2, ep=1)")
    if family == "plain":
        ms.set_seed(0)
        model = _fixed_weights(PlainTransformer(gpt.num_layers, gpt.hidden_size, gpt.num_heads, dropout))
        x = Tensor(np.random.RandomState(0).randn(batch, gpt.seq_length, gpt.hidden_size).astype(np.float32))
        layers = list(model.layers)
        return Family(model, (x,), layers, [layer.mlp for layer in layers],
                      "plain pre-LN transformer" + (f", nn.Dropout p={dropout}" if dropout else ""))
    module = _llama_module(gpt, batch)
    model, make_inputs = module.build()
    layers = list(model.model.layers)
    return Family(model, make_inputs(0), layers, [layer.feed_forward for layer in layers],
                  "LLaMA of docs/own_model.md")
