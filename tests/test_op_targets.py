"""Op targets (``select_module`` naming an op inside a module: MindFormers' output recompute) save memory
or say why not, and never keep more than the same model without AC.

The model is a Qwen3-style decoder written as MindFormers' GPTModel is (RMSNorm, RoPE, grouped-query
attention, SwiGLU) with the two op attributes MindFormers users name: ``core_attention.flash_attention``
(here a function computing softmax(qk)v, standing in for the Ascend-only FlashAttentionScore) and
``mlp.activation_func`` (SwiGLU: ``act(gate) * up``, the gate a view split from the fc1 output). Kept
bytes are ``measure_step``'s; gradients, losses and every parameter are compared bitwise over three steps.
"""
import logging

import mindspore as ms
import pytest
from mindspore import mint, nn, ops

import mindformers_ac as mac

from model_patterns import (
    B,
    H,
    LlamaRMSNorm,
    S,
    init_weights,
    rope_tables,
    rotate_half,
    token_batch,
)
from steps import first_difference, run_steps

N_HEADS, N_KV, FFN, N_LAYERS, VOCAB = 4, 2, 64, 3, 40
HEAD_DIM = H // N_HEADS
ALL = f"0-{N_LAYERS - 1}"


def flash_attention_standin(q, k, v, mask, scale):
    s = ops.matmul(q, k.swapaxes(-1, -2)) * scale
    s = s.masked_fill(mask, -1e4)
    return ops.matmul(mint.nn.functional.softmax(s, dim=-1), v)


def flash_attention_score_standin(q, k, v, mask, scale):
    """FlashAttentionScore's shape of result: (softmax_max, softmax_sum, softmax_out, attention_out)."""
    s = ops.matmul(q, k.swapaxes(-1, -2)) * scale
    s = s.masked_fill(mask, -1e4)
    p = mint.nn.functional.softmax(s, dim=-1)
    return s.max(-1, keepdims=True), p.sum(-1, keepdims=True), None, ops.matmul(p, v)


def narrow_exp(h):
    """An op that reads a quarter of a large input no one else keeps: its re-run would need all of it."""
    return ops.exp(h[..., : h.shape[-1] // 4])


class CoreAttention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flash_attention = flash_attention_standin

    def construct(self, q, k, v, mask):
        return self.flash_attention(q, k, v, mask, HEAD_DIM ** -0.5)


class ScoreCoreAttention(CoreAttention):
    """Its op returns a tuple, of which the layer uses the last item."""

    def __init__(self):
        super().__init__()
        self.flash_attention = flash_attention_score_standin

    def construct(self, q, k, v, mask):
        return self.flash_attention(q, k, v, mask, HEAD_DIM ** -0.5)[-1]


class SelfAttention(nn.Cell):
    def __init__(self, core=CoreAttention):
        super().__init__()
        self.linear_qkv = mint.nn.Linear(H, (N_HEADS + 2 * N_KV) * HEAD_DIM, bias=False)
        self.linear_proj = mint.nn.Linear(N_HEADS * HEAD_DIM, H, bias=False)
        self.core_attention = core()
        self.cos, self.sin = rope_tables(HEAD_DIM)

    def construct(self, x, pos, mask):
        b, s, _ = x.shape
        q, k, v = mint.split(self.linear_qkv(x), (N_HEADS * HEAD_DIM, N_KV * HEAD_DIM, N_KV * HEAD_DIM), -1)
        q = q.reshape(b, s, N_HEADS, HEAD_DIM).swapaxes(1, 2)
        k = k.reshape(b, s, N_KV, HEAD_DIM).swapaxes(1, 2)
        v = v.reshape(b, s, N_KV, HEAD_DIM).swapaxes(1, 2)
        cos = ops.gather(self.cos, pos, 0).expand_dims(1)
        sin = ops.gather(self.sin, pos, 0).expand_dims(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = ops.repeat_interleave(k, N_HEADS // N_KV, 1)
        v = ops.repeat_interleave(v, N_HEADS // N_KV, 1)
        out = self.core_attention(q, k, v, mask.expand_dims(1))
        return self.linear_proj(out.swapaxes(1, 2).reshape(b, s, N_HEADS * HEAD_DIM))


class SwiGLUMLP(nn.Cell):
    """MindFormers' gated MLP: fc1 makes gate and up in one tensor, split as views."""

    def __init__(self, act):
        super().__init__()
        self.linear_fc1 = mint.nn.Linear(H, 2 * FFN, bias=False)
        self.linear_fc2 = mint.nn.Linear(FFN, H, bias=False)
        self.activation_func = act

    def construct(self, x):
        gate, up = mint.split(self.linear_fc1(x), (FFN, FFN), -1)
        return self.linear_fc2(self.activation_func(gate) * up)


class NarrowMLP(nn.Cell):
    """Its op target can't save anything: what it and its consumer save is smaller than its input."""

    def __init__(self):
        super().__init__()
        self.linear_fc1 = mint.nn.Linear(H, 2 * FFN, bias=False)
        self.linear_fc2 = mint.nn.Linear(FFN // 2, H, bias=False)
        self.activation_func = narrow_exp

    def construct(self, x):
        return self.linear_fc2(self.activation_func(self.linear_fc1(x)) * 0.5)


class TransformerLayer(nn.Cell):
    def __init__(self, mlp, core):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(H)
        self.self_attention = SelfAttention(core)
        self.pre_mlp_layernorm = LlamaRMSNorm(H)
        self.mlp = mlp

    def construct(self, x, pos, mask):
        h = x + self.self_attention(self.input_layernorm(x), pos, mask)
        return h + self.mlp(self.pre_mlp_layernorm(h))


class Decoder(nn.Cell):
    def __init__(self, make_mlp, core):
        super().__init__()
        self.layers = nn.CellList([TransformerLayer(make_mlp(), core) for _ in range(N_LAYERS)])
        self.final_layernorm = LlamaRMSNorm(H)


class GPTModel(nn.Cell):
    def __init__(self, make_mlp, core=CoreAttention):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, H)
        self.decoder = Decoder(make_mlp, core)
        self.output_layer = mint.nn.Linear(H, VOCAB, bias=False)
        self.loss = nn.CrossEntropyLoss()

    def construct(self, ids, labels, pos, mask):
        h = self.embedding(ids)
        for layer in self.decoder.layers:
            h = layer(h, pos, mask)
        return self.loss(self.output_layer(self.decoder.final_layernorm(h)).reshape(-1, VOCAB), labels)


MLPS = {
    "ops.silu": lambda: SwiGLUMLP(ops.silu),
    "mint.silu": lambda: SwiGLUMLP(mint.nn.functional.silu),
    "cell.silu": lambda: SwiGLUMLP(nn.SiLU()),   # a Cell with no parameters: recomputed as an op
    "narrow": NarrowMLP,
    "score": lambda: SwiGLUMLP(ops.silu),   # with the tuple-returning attention op
}


def build(mlp="ops.silu"):
    return init_weights(GPTModel(MLPS[mlp], ScoreCoreAttention if mlp == "score" else CoreAttention))


batch = token_batch(VOCAB, seed=300)


def select(pattern):
    return {"recompute": {"mode": "select", "select_module": {pattern: [ALL]}}}


def measure(model):
    model.set_train(True)
    return mac.measure_step(model, ms.value_and_grad(model, None, model.trainable_params()), *batch(0))


def with_ac(mlp, pattern):
    model = build(mlp)
    mac.apply_ac(model.decoder, config=select(pattern))   # where MindFormers' parallelize applies it
    return model


TARGETS = [("ops.silu", r".*core_attention.flash_attention"),
           ("score", r".*core_attention.flash_attention"),
           ("ops.silu", r".*mlp.activation_func"),
           ("mint.silu", r".*mlp.activation_func"),
           ("cell.silu", r".*mlp.activation_func")]


@pytest.fixture(scope="module")
def plain():
    return {mlp: (measure(build(mlp)), run_steps(build(mlp), batch)) for mlp in MLPS}


@pytest.mark.parametrize("mlp, pattern", TARGETS)
def test_op_target_keeps_less_than_plain_and_trains_bitwise(plain, mlp, pattern, caplog):
    base, history = plain[mlp]
    model = with_ac(mlp, pattern)
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        memory = measure(model)
    assert "saves nothing" not in caplog.text
    stats = mac.ac_state(model.decoder).recompute_stats
    for i in range(N_LAYERS):   # every layer keeps less: the op's saves and its consumers' are dropped
        assert memory.layers[i].kept_bytes < base.layers[i].kept_bytes, (i, memory.layers[i], base.layers[i])
        assert memory.layers[i].recomputed_bytes > 0 and stats[i].ops_rerun == 1
    assert memory.layers["other"].kept_bytes == base.layers["other"].kept_bytes
    assert memory.kept_bytes < base.kept_bytes
    assert first_difference(history, run_steps(with_ac(mlp, pattern), batch)) is None


def test_swiglu_activation_keeps_a_copy_of_its_gate_not_the_whole_fc1_output(plain):
    """The gate is a view of the fc1 output (gate and up): keeping the view would hold both halves, which
    costs what dropping the activation's saves frees. A copy of the gate costs half."""
    base = plain["ops.silu"][0]
    memory = measure(with_ac("ops.silu", r".*mlp.activation_func"))
    half = B * S * FFN * 4   # one float32 (B, S, FFN) tensor
    for i in range(N_LAYERS):   # the gate's copy silu saves and the activation mul saves: two, less the gate
        assert memory.layers[i].recomputed_bytes == 2 * half
        assert memory.layers[i].kept_bytes == base.layers[i].kept_bytes - half


def test_op_target_that_cannot_save_keeps_exactly_plain_and_says_why(plain, caplog):
    base, history = plain["narrow"]
    model = with_ac("narrow", r".*mlp.activation_func")
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        memory = measure(model)
    assert caplog.text.count("output recompute of NarrowMLP.activation_func saves nothing: running it again "
                             "needs its inputs") == 1, caplog.text
    for i in range(N_LAYERS):   # to the byte: the engine's figure for a call it kept is what plain keeps
        assert memory.layers[i].kept_bytes == base.layers[i].kept_bytes
        assert memory.layers[i].recomputed_bytes == 0
    assert all(s.ops_rerun == 0 for s in mac.ac_state(model.decoder).recompute_stats.values())
    assert first_difference(history, run_steps(with_ac("narrow", r".*mlp.activation_func"), batch)) is None


def test_op_target_inside_a_recomputed_module_runs_plainly_and_stays_bitwise(plain):
    """The module's region drops the op's saves itself; the op target then does nothing of its own."""
    base, history = plain["ops.silu"]
    config = {"recompute": {"mode": "select", "select_module": {r"mlp": [ALL], r".*mlp.activation_func": [ALL]}}}

    def build_ac():
        model = build("ops.silu")
        mac.apply_ac(model.decoder, config=config)
        return model

    memory = measure(build_ac())
    assert memory.kept_bytes < base.kept_bytes
    assert first_difference(history, run_steps(build_ac(), batch)) is None


@pytest.mark.parametrize("mlp, pattern", TARGETS + [("narrow", r".*mlp.activation_func")])
def test_nothing_an_op_target_kept_outlives_its_backward(mlp, pattern):
    """What each call holds (inputs, or what it kept) dies with its graph, without a garbage collection."""
    model = with_ac(mlp, pattern)
    model.set_train(True)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    for step in range(3):
        grad_fn(*batch(step))
    assert [(s.live_regions, s.live_bytes) for s in mac.ac_state(model.decoder).recompute_stats.values()] \
        == [(0, 0)] * N_LAYERS
