"""A catalogue of small models written the way real models are, for the AC exactness matrix.

Each ``Pattern`` builds a fresh model with a layer list (3 layers, hidden 32,
sequence 8, batch 2; weights set from the parameter names, so two builds are
bitwise equal) and hands out the grad-function inputs of each step the way a
data loader does: int32 position ids and a bool causal/padding mask arrive as
arguments of ``value_and_grad(model)``, so autograd tracks them like any
input. It also names, for this model, what each AC mode acts on: a module to
select (the one that uses the int/bool inputs or the stateful op), an op
attribute for output recompute, a collective stand-in in ``_comm_ops`` for
``recompute_comm``, and a module to op-swap.

Every model routes its layer calls through ``model.run_layer(layer, *args,
**kwargs)``: the ``checkpoint``/``swap`` API modes replace it on the instance.
"""
import collections
import zlib
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore.common._grad_function import _Function

import mindformers_ac as mac

H, S, B, FFN, N_LAYERS, MAX_POS = 32, 8, 2, 64, 3, 16


# -- building blocks -------------------------------------------------------------------------

def init_weights(model, scale=0.3):
    """Trainable weights from their names (a fresh build is bitwise the same model)."""
    for name, p in model.parameters_and_names():
        if p.requires_grad:
            rng = np.random.RandomState(zlib.crc32(name.encode()))
            p.set_data(Tensor(rng.uniform(-scale, scale, p.shape).astype(np.float32)))
    return model


def rope_tables(dim, max_pos=MAX_POS):
    """cos/sin tables indexed by position: float constants (untracked) handed to the layers."""
    inv = 1.0 / (10000 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    ang = np.outer(np.arange(max_pos, dtype=np.float32), inv)
    ang = np.concatenate([ang, ang], axis=-1)
    return Tensor(np.cos(ang).astype(np.float32)), Tensor(np.sin(ang).astype(np.float32))


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


class StandInAllGather(nn.Cell):
    """Identity with a custom bprop: a single-process stand-in for a sequence-parallel all-gather."""

    def construct(self, x):
        return ops.mul(x, 1.0)

    def bprop(self, x, out, dout):
        return (dout,)


class MLP(nn.Cell):
    """``act`` is an op attribute (output recompute); ``_comm_ops['all_gather']`` a collective slot
    whose output ``fc1`` saves (what ``recompute_comm`` drops)."""

    def __init__(self):
        super().__init__()
        self.fc1 = mint.nn.Linear(H, FFN)
        self.act = ops.gelu
        self.fc2 = mint.nn.Linear(FFN, H)
        self._comm_ops = {"all_gather": StandInAllGather()}

    def construct(self, x):
        return self.fc2(self.act(self.fc1(self._comm_ops["all_gather"](x))))


class Attention(nn.Cell):
    """Single-head attention on the int/bool inputs and a float constant argument.

    Position ids (int32) gather a rotary table the cell holds (as HF-style
    rotary embeddings do); the bool mask is applied with ``masked_fill`` and,
    cast to int and then float, zeroes masked probabilities; ``scale`` is a
    float constant argument (not tracked by autograd).
    """

    def __init__(self):
        super().__init__()
        self.q = mint.nn.Linear(H, H)
        self.k = mint.nn.Linear(H, H)
        self.v = mint.nn.Linear(H, H)
        self.cos_cached = rope_tables(H)[0]

    def construct(self, x, pos, mask, scale):
        rope = ops.gather(self.cos_cached, pos, 0)                 # int32 ids index a float table
        q, k = self.q(x) * rope, self.k(x) * rope
        s = ops.matmul(q, k.swapaxes(-1, -2)) * (H ** -0.5)
        s = s.masked_fill(mask, -1e4)                              # bool mask
        keep = (1 - mask.astype(ms.int32)).astype(ms.float32)      # int -> float cast
        p = mint.nn.functional.softmax(s, dim=-1) * keep
        return ops.matmul(p, self.v(x)) * (scale * 2.0)            # a float constant argument


class Layer(nn.Cell):
    """Pre-norm block: attention on the int/bool inputs, then the MLP."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm((H,))
        self.attn = Attention()
        self.norm2 = nn.LayerNorm((H,))
        self.mlp = MLP()

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        return h + self.mlp(self.norm2(h))


class PatternModel(nn.Cell):
    """Float hidden states in, a regression loss out; ``run_layer`` is where the API modes hook in."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.CellList(layers)
        self.head = mint.nn.Linear(H, 1)
        self.scale = Tensor(np.linspace(0.5, 1.5, H).astype(np.float32))   # a float constant, not a parameter

    def run_layer(self, layer, *args, **kwargs):
        return layer(*args, **kwargs)

    def loss(self, x, y):
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()

    def construct(self, x, y, pos, mask):
        for layer in self.layers:
            x = self.run_layer(layer, x, pos, mask, self.scale)
        return self.loss(x, y)


def causal_padding_mask(pad_last=1):
    """bool (B, S, S), True where attention is masked: the future, and the last ``pad_last`` keys of batch row 1."""
    m = np.broadcast_to(np.triu(np.ones((S, S), bool), 1), (B, S, S)).copy()
    m[1, :, S - pad_last:] = True
    np.fill_diagonal(m[1], False)
    return Tensor(m)


def hidden_batch(step):
    """(x, y, pos, mask): float hidden states and targets, int32 position ids, bool mask."""
    rng = np.random.RandomState(100 + step)
    pos = Tensor((np.arange(S, dtype=np.int32)[None, :] + np.array([[0], [3]], np.int32)))
    return (Tensor(rng.randn(B, S, H).astype(np.float32)), Tensor(rng.randn(B, S).astype(np.float32)),
            pos, causal_padding_mask())


def token_batch(vocab, seed=200):
    def batch(step):
        rng = np.random.RandomState(seed + step)
        ids = Tensor(rng.randint(0, vocab, (B, S)).astype(np.int32))
        labels = Tensor(rng.randint(0, vocab, (B * S,)).astype(np.int32))
        pos = Tensor(np.tile(np.arange(S, dtype=np.int32), (B, 1)))
        return ids, labels, pos, causal_padding_mask()
    return batch


# -- the patterns ---------------------------------------------------------------------------

@dataclass
class Pattern:
    """One model pattern and what each AC mode acts on in it.

    ``cell``: a select_module regex naming a module; ``op``: one naming an op
    attribute (output recompute); ``comm``: one naming a ``_comm_ops`` slot;
    ``op_swap``: a module to op-swap; ``layers``: the layer-list path.
    ``refused``: mode -> regex the ``ConfigError`` must match.
    """

    name: str
    build: object
    batch: object
    cell: str
    op: str = r"mlp\.act"
    comm: str = r"mlp\.all_gather"
    op_swap: str = "mlp"
    layers: str = "layers"
    refused: dict = field(default_factory=dict)
    # how a training loop meets the model (``steps.train_pattern``): "plain" (``run_steps``),
    # "skip_nonfinite" (a loss scaler's skipped step), "failed_forward" (a forward that raises, caught),
    # "remove_mid_step" (``remove_ac`` between the last forward and its backward), "gpipe" (4 microbatches'
    # forwards before their backwards, last first: ``steps.run_steps_gpipe``)
    loop: str = "plain"
    prepare: object = None   # called on the model once AC is installed (and on the baseline): e.g. LoRA
    modes: tuple = None      # the modes the pattern meets (None: every mode); a scenario names those it tests
    # the ops ``exclude_op`` and ``hyper_api`` keep (MUST_SAVE), and those of them no re-run may ever run again
    kept_ops: tuple = ("MatMul", "Softmax")
    never_rerun: tuple = ()
    # mode -> (step, regex[, path]): a RecomputeError raised in that step, before its optimizer update, that the
    # regex matches (its cell path and op), on the "light" or "intercepted" path if named; checked in a
    # subprocess (it raises inside backward)
    raises: dict = field(default_factory=dict)
    # mode -> reason: an engine bug this cell meets (``xfail(strict=True)``, the reason says what differs)
    xfail: dict = field(default_factory=dict)
    # the model draws from a seedless random op (``ops.Cauchy``): its plain twin replays, call by call, what
    # the forwards of the run with AC drew (``recorded_draws``), instead of a baseline trained beforehand
    replay_draws: bool = False


# int/bool inputs used inside the layer ----------------------------------------------------------

def build_int_bool():
    return init_weights(PatternModel([Layer() for _ in range(N_LAYERS)]))


# BatchNorm in training ---------------------------------------------------------------------------

class BNLayer(Layer):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(H)

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        h = h + ops.gelu(self.bn(h.reshape(-1, H))).reshape(h.shape)   # gelu saves the BN output
        return h + self.mlp(self.norm2(h))


def build_batchnorm():
    return init_weights(PatternModel([BNLayer() for _ in range(N_LAYERS)]))


# forward-time assign / assign_add / in-place copy ----------------------------------------------

class StatefulLayer(Layer):
    """A call counter (assign_add), an EMA buffer read before it is written (assign), an in-place copy_."""

    def __init__(self):
        super().__init__()
        self.calls = Parameter(Tensor(np.zeros(1, np.float32)), name="calls", requires_grad=False)
        self.ema = Parameter(Tensor(np.full(H, 0.5, np.float32)), name="ema", requires_grad=False)
        self.last = Parameter(Tensor(np.zeros(H, np.float32)), name="last", requires_grad=False)

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        h = h * (1 + self.ema)                                  # read before the write below
        ops.assign(self.ema, ops.stop_gradient(0.9 * self.ema + 0.1 * h.mean((0, 1))))
        self.last.copy_(ops.stop_gradient(h.mean((0, 1))))      # pyboost InplaceCopy on a parameter
        ops.assign_add(self.calls, Tensor(np.ones(1, np.float32)))
        return h + self.mlp(self.norm2(h))


def build_stateful():
    return init_weights(PatternModel([StatefulLayer() for _ in range(N_LAYERS)]))


# tuple outputs ------------------------------------------------------------------------------

class TupleLayer(Layer):
    """Returns (hidden, auxiliary loss), MoE-style."""

    def construct(self, x, pos, mask, scale):
        h = super().construct(x, pos, mask, scale)
        return h, (h ** 2).mean() * 0.01


class TupleModel(PatternModel):
    def construct(self, x, y, pos, mask):
        aux_total = 0.0
        for layer in self.layers:
            x, aux = self.run_layer(layer, x, pos, mask, self.scale)
            aux_total = aux_total + aux
        return self.loss(x, y) + aux_total


def build_tuple_outputs():
    return init_weights(TupleModel([TupleLayer() for _ in range(N_LAYERS)]))


# keyword arguments ----------------------------------------------------------------------------

class KwargsLayer(Layer):
    def construct(self, x, pos=None, mask=None, scale=None):
        return super().construct(x, pos, mask, scale)


class KwargsModel(PatternModel):
    def construct(self, x, y, pos, mask):
        for layer in self.layers:
            x = self.run_layer(layer, x, mask=mask, scale=self.scale, pos=pos)
        return self.loss(x, y)


def build_keyword_args():
    return init_weights(KwargsModel([KwargsLayer() for _ in range(N_LAYERS)]))


# a layer called twice per forward ------------------------------------------------------------

class TwiceModel(PatternModel):
    """Layer 0 runs twice per forward (a shared-depth / universal-transformer loop)."""

    def construct(self, x, y, pos, mask):
        x = self.run_layer(self.layers[0], x, pos, mask, self.scale)
        for layer in self.layers:
            x = self.run_layer(layer, x, pos, mask, self.scale)
        return self.loss(x, y)


def build_called_twice():
    return init_weights(TwiceModel([Layer() for _ in range(N_LAYERS)]))


# tied weights ---------------------------------------------------------------------------------

VOCAB = 24


class TiedLayer(Layer):
    """Every layer scales by one Parameter shared across the layers."""

    def __init__(self, shared_scale):
        super().__init__()
        self.shared_scale = shared_scale

    def construct(self, x, pos, mask, scale):
        return super().construct(x * self.shared_scale, pos, mask, scale)


class TiedModel(PatternModel):
    """Token embedding tied to the output projection, and a scale shared by every layer."""

    def __init__(self):
        shared = Parameter(Tensor(np.ones(H, np.float32)), name="shared_scale")
        super().__init__([TiedLayer(shared) for _ in range(N_LAYERS)])
        self.embed = nn.Embedding(VOCAB, H)
        self.ce = nn.CrossEntropyLoss()

    def construct(self, ids, labels, pos, mask):
        x = self.embed(ids)
        for layer in self.layers:
            x = self.run_layer(layer, x, pos, mask, self.scale)
        logits = ops.matmul(x.reshape(-1, H), self.embed.embedding_table.T)   # tied output projection
        return self.ce(logits, labels)


def build_tied_weights():
    return init_weights(TiedModel())


# nested layer lists -----------------------------------------------------------------------------

class AttnBlock(nn.Cell):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm((H,))
        self.attn = Attention()

    def construct(self, x, pos, mask, scale):
        return x + self.attn(self.norm(x), pos, mask, scale)


class MLPBlock(nn.Cell):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm((H,))
        self.mlp = MLP()

    def construct(self, x):
        return x + self.mlp(self.norm(x))


class NestedLayer(nn.Cell):
    """A layer whose own sub-blocks sit in a CellList."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([AttnBlock(), MLPBlock()])

    def construct(self, x, pos, mask, scale):
        return self.blocks[1](self.blocks[0](x, pos, mask, scale))


class Decoder(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([NestedLayer() for _ in range(N_LAYERS)])


class NestedModel(PatternModel):
    def __init__(self):
        super().__init__([])
        self.decoder = Decoder()

    def construct(self, x, y, pos, mask):
        for layer in self.decoder.layers:
            x = self.run_layer(layer, x, pos, mask, self.scale)
        return self.loss(x, y)


def build_nested_lists():
    model = NestedModel()
    del model.layers   # the layer list lives at decoder.layers only
    return init_weights(model)


# LLaMA-style decoder with MindFormers' names -----------------------------------------------------

N_HEADS, N_KV_HEADS = 4, 2
HEAD_DIM = H // N_HEADS


class LlamaRMSNorm(nn.Cell):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.eps = eps

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps) * self.weight


class LlamaRotaryEmbedding(nn.Cell):
    """cos/sin tables held by the cell, gathered by int32 position ids."""

    def __init__(self):
        super().__init__()
        self.cos_cached, self.sin_cached = rope_tables(HEAD_DIM)

    def construct(self, position_ids):
        return (ops.gather(self.cos_cached, position_ids, 0).expand_dims(1),   # (B, 1, S, D)
                ops.gather(self.sin_cached, position_ids, 0).expand_dims(1))


class LLamaAttention(nn.Cell):
    """Grouped-query attention (4 query heads, 2 KV heads), RoPE by position ids, bool mask."""

    def __init__(self):
        super().__init__()
        self.wq = mint.nn.Linear(H, N_HEADS * HEAD_DIM, bias=False)
        self.wk = mint.nn.Linear(H, N_KV_HEADS * HEAD_DIM, bias=False)
        self.wv = mint.nn.Linear(H, N_KV_HEADS * HEAD_DIM, bias=False)
        self.wo = mint.nn.Linear(N_HEADS * HEAD_DIM, H, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding()

    def construct(self, x, position_ids, mask):
        return self.attend(x, *self.rotary_emb(position_ids), mask)

    def attend(self, x, cos, sin, mask):
        """Attention with the rotary tables ``cos``, ``sin`` (B, 1, S, D) given."""
        bs, seq, _ = x.shape
        q = self.wq(x).reshape(bs, seq, N_HEADS, HEAD_DIM).swapaxes(1, 2)
        k = self.wk(x).reshape(bs, seq, N_KV_HEADS, HEAD_DIM).swapaxes(1, 2)
        v = self.wv(x).reshape(bs, seq, N_KV_HEADS, HEAD_DIM).swapaxes(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = N_HEADS // N_KV_HEADS
        k = ops.repeat_interleave(k, rep, 1)
        v = ops.repeat_interleave(v, rep, 1)
        s = ops.matmul(q, k.swapaxes(-1, -2)) * (HEAD_DIM ** -0.5)
        s = s.masked_fill(mask.expand_dims(1), -1e4)
        out = ops.matmul(mint.nn.functional.softmax(s, dim=-1), v)
        return self.wo(out.swapaxes(1, 2).reshape(bs, seq, N_HEADS * HEAD_DIM))


class LlamaFeedForward(nn.Cell):
    """SwiGLU: w2(silu(w1 x) * w3 x); ``mul`` is an op attribute as in MindFormers."""

    def __init__(self):
        super().__init__()
        self.w1 = mint.nn.Linear(H, FFN, bias=False)
        self.w2 = mint.nn.Linear(FFN, H, bias=False)
        self.w3 = mint.nn.Linear(H, FFN, bias=False)
        self.mul = ops.Mul()
        self._comm_ops = {"all_gather": StandInAllGather()}

    def construct(self, x):
        x = self._comm_ops["all_gather"](x)
        return self.w2(self.mul(ops.silu(self.w1(x)), self.w3(x)))


class LLamaDecodeLayer(nn.Cell):
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = LlamaRMSNorm(H)
        self.attention = LLamaAttention()
        self.ffn_norm = LlamaRMSNorm(H)
        self.feed_forward = LlamaFeedForward()

    def construct(self, x, position_ids, mask):
        h = x + self.attention(self.attention_norm(x), position_ids, mask)
        return h + self.feed_forward(self.ffn_norm(h))


LLAMA_VOCAB = 40


class LlamaModel(nn.Cell):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(LLAMA_VOCAB, H)
        self.layers = nn.CellList([LLamaDecodeLayer(i) for i in range(N_LAYERS)])
        self.norm_out = LlamaRMSNorm(H)


class LlamaForCausalLM(nn.Cell):
    def __init__(self):
        super().__init__()
        self.model = LlamaModel()
        self.lm_head = mint.nn.Linear(H, LLAMA_VOCAB, bias=False)
        self.ce = nn.CrossEntropyLoss()

    def run_layer(self, layer, *args, **kwargs):
        return layer(*args, **kwargs)

    def construct(self, input_ids, labels, position_ids, mask):
        m = self.model
        h = m.tok_embeddings(input_ids)
        for layer in m.layers:
            h = self.run_layer(layer, h, position_ids, mask)
        logits = self.lm_head(m.norm_out(h)).reshape(-1, LLAMA_VOCAB)
        return self.ce(logits, labels)


def build_llama():
    return init_weights(LlamaForCausalLM())


# DeepSeek-style mixture of experts (the harness's reference MoE GPT) ------------------------------

MOE_VOCAB = 24


def build_moe(microbatches=1):
    """The reference MoE GPT, MoE in layers 0 and 2 (a dense layer between), top-2 of 4 experts with
    capacity drops, router jitter and dropout (replayed: ``SeededDropout``'s step counter), its layer
    calls routed through ``run_layer``. ``microbatches=2``: each forward runs the batch's two rows as
    two microbatches, both forwards before their backwards (gradient accumulation in one graph)."""
    from mindformers_ac.harness.moe import MoEGPTModel, moe_config

    class MoEPatternModel(MoEGPTModel):
        def run_layer(self, layer, *args, **kwargs):
            return layer(*args, **kwargs)

        def forward_one(self, ids, labels):   # MoEGPTModel's, its layer calls through run_layer
            self.dropout_seeds.step += 1
            x, aux_total = self.embedding(ids), 0.0
            for layer in self.decoder.layers:
                out = self.run_layer(layer, x, self.attention_mask)
                if layer.is_moe_layer:
                    x, aux = out
                    aux_total = aux_total + aux
                else:
                    x = out
            logits = self.output_layer(self.decoder.final_layernorm(x))
            return self.loss(logits.reshape(-1, MOE_VOCAB), labels) + self.config.aux_loss_coeff * aux_total

        def construct(self, ids, labels, pos, mask):
            if microbatches == 1:
                return self.forward_one(ids, labels)
            return self.forward_one(ids[:1], labels[:S]) + self.forward_one(ids[1:], labels[S:])

    ms.set_seed(0)
    np.random.seed(0)
    model = MoEPatternModel(moe_config(num_layers=N_LAYERS, hidden_size=H, num_heads=2, seq_length=S,
                                       vocab_size=MOE_VOCAB, dropout=0.1, num_experts=4, top_k=2,
                                       capacity_factor=0.75, moe_layer_freq=2, router_jitter=0.05))
    model.set_train(True)
    return model


# a graph kept past its step (issue 41) --------------------------------------------------------------

AUX_LOG_WINDOW = 100
# A user's logging window of the layers' aux losses, kept attached to their graphs (MindSpore 2.10's Tensor
# has no ``detach``, and MindFormers' tracker adds the loss as it comes): every step's router graph stays
# alive for AUX_LOG_WINDOW steps, and the oldest is dropped from the step AUX_LOG_WINDOW on.
AUX_LOG = collections.deque(maxlen=AUX_LOG_WINDOW)


class KeepingAuxScaler(_Function):
    """MindFormers' ``_MoEAuxLossAutoScaler`` (the aux loss's gradient enters backward here, through a
    class-level scale created on first use) that also keeps, in class state, the tensor it saved, and reads
    the one kept by the previous backward: a tensor a backward received outlives its step."""

    main_loss_backward_scale = None   # process-wide, as MindFormers': created on first use, never reset
    previous = None                   # the tensor the last backward saved: per training run (``reset``)

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(output)
        ctx.aux_loss_dtype = aux_loss.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (saved,) = ctx.saved_tensors
        cls = KeepingAuxScaler
        if cls.main_loss_backward_scale is None:
            cls.main_loss_backward_scale = Tensor(1.0, ctx.aux_loss_dtype)
        previous, cls.previous = cls.previous, saved
        if previous is None:
            return grad_output, cls.main_loss_backward_scale
        return grad_output, cls.main_loss_backward_scale + 0.01 * previous.mean()

    @staticmethod
    def reset():
        KeepingAuxScaler.previous = None


class KeepingAuxScalerCell(nn.Cell):
    """MindFormers' ``MoEAuxLossAutoScaler`` cell around the function."""

    @staticmethod
    def construct(output, aux_loss):
        return KeepingAuxScaler.apply(output, aux_loss)


class HostRoutedMoE(nn.Cell):
    """Top-2 of 4 experts, token lists per expert built on the host from the routing (as an
    expert-parallel dispatcher's counts are), the aux loss logged attached and injected by the scaler."""

    def __init__(self):
        super().__init__()
        self.router = mint.nn.Linear(H, N_EXPERTS_KEPT, bias=False)
        self.experts = nn.CellList([MLP() for _ in range(N_EXPERTS_KEPT)])
        self.aux_scaler = KeepingAuxScalerCell()

    def construct(self, h):
        x = h.reshape(-1, H)
        probs = mint.nn.functional.softmax(self.router(x), dim=-1)
        weights, indices = ops.topk(probs, 2)
        counts = ops.one_hot(indices, N_EXPERTS_KEPT, Tensor(1.0), Tensor(0.0)).sum((0, 1))
        aux = (probs.sum(0) * counts).sum() * (0.01 * N_EXPERTS_KEPT / (2 * x.shape[0] ** 2))
        if not mac.is_in_recompute():
            AUX_LOG.append(aux)
        x = self.aux_scaler(x, aux)
        host = indices.asnumpy()
        out = ops.zeros_like(x)
        for e in range(N_EXPERTS_KEPT):
            rows = np.nonzero((host == e).any(-1))[0].astype(np.int32)
            if rows.size:
                idx = Tensor(rows)
                w = (weights[idx] * ops.cast(indices[idx] == e, ms.float32)).sum(-1, keepdims=True)
                out = ops.index_add(out, idx, self.experts[e](x[idx]) * w, 0)
        return out.reshape(h.shape)


N_EXPERTS_KEPT = 4


class KeptGraphLayer(nn.Cell):
    """A norm and the MoE (no attention: the three-run check trains 103 steps, kept cheap)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm((H,))
        self.mlp = HostRoutedMoE()

    def construct(self, x, pos, mask, scale):
        return x + self.mlp(self.norm(x)) * scale


class KeptGraphModel(PatternModel):
    """Token ids in, cross-entropy out (the embedding tied to the output projection)."""

    def __init__(self):
        super().__init__([KeptGraphLayer() for _ in range(N_LAYERS)])
        self.embed = nn.Embedding(VOCAB, H)
        self.ce = nn.CrossEntropyLoss()

    construct = TiedModel.construct


def build_kept_graph_moe():
    """A fresh model; a training run's own class state starts empty (``KeepingAuxScaler.reset``), the
    process-wide scale and the logging window stay as they are."""
    KeepingAuxScaler.reset()
    return init_weights(KeptGraphModel())


# the blind spots of issue 29: state and paths that change between calls ------------------------------

LARGE = 2.5


class BranchWriteLayer(Layer):
    """A data-dependent branch and a buffer write only large activations trigger (step 0's are small):
    the checking call sees neither."""

    def __init__(self):
        super().__init__()
        self.large = Parameter(Tensor(np.zeros(1, np.float32)), name="large", requires_grad=False)

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        if float(h.abs().max()) > LARGE:
            ops.assign_add(self.large, Tensor(np.ones(1, np.float32)))
            h = h + ops.sin(h)
        return h + self.mlp(self.norm2(h))


def build_branch_write():
    return init_weights(PatternModel([BranchWriteLayer() for _ in range(N_LAYERS)]))


def growing_batch(step):
    """``hidden_batch`` with small inputs at step 0 and large ones after."""
    x, y, pos, mask = hidden_batch(step)
    return (x * (0.05 if step == 0 else 3.0), y, pos, mask)


class InputWriteLayer(Layer):
    """Writes into its input before using it: a setitem (no op dispatch sees it) and an in-place mul."""

    def construct(self, x, pos, mask, scale):
        x[:, 0] = 0
        x.mul_(0.5)
        return super().construct(x, pos, mask, scale)


def build_input_write():
    # not layer 0: its input is the grad function's, which MindSpore refuses to write without AC too
    return init_weights(PatternModel([Layer()] + [InputWriteLayer() for _ in range(N_LAYERS - 1)]))


class LoraLayer(Layer):
    """Its MLP gets a low-rank adapter once one is added (fine-tuning: after ``apply_ac``)."""

    def __init__(self):
        super().__init__()
        self.lora = None

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        n = self.norm2(h)
        out = self.mlp(n)
        if self.lora is not None:
            out = out + self.lora(n)
        return h + out


class LoraAdapter(nn.Cell):
    def __init__(self, rank=4):
        super().__init__()
        self.a = mint.nn.Linear(H, rank, bias=False)
        self.b = mint.nn.Linear(rank, H, bias=False)

    def construct(self, x):
        return self.b(self.a(x))


def add_lora(model):
    """A LoRA adapter in every layer, weights set from a fixed stream (the same for every model)."""
    for i, layer in enumerate(model.layers):
        layer.lora = LoraAdapter()
        rng = np.random.RandomState(50 + i)
        for p in layer.lora.get_parameters():
            p.name = f"layers.{i}.{p.name}"   # assigned after construction: no layer prefix of its own
            p.set_data(Tensor(rng.uniform(-0.3, 0.3, p.shape).astype(np.float32)))


def build_lora():
    return init_weights(PatternModel([LoraLayer() for _ in range(N_LAYERS)]))


class DropoutLayer(Layer):
    """``nn.Dropout`` after the attention: its mask-bits check is decided on the first (NaN) step."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(p=0.25)

    def construct(self, x, pos, mask, scale):
        h = x + self.drop(self.attn(self.norm1(x), pos, mask, scale))
        return h + self.mlp(self.norm2(h))


def build_dropout():
    ms.set_seed(0)   # nn.Dropout's seeds: the same masks in every build
    return init_weights(PatternModel([DropoutLayer() for _ in range(N_LAYERS)]))


class BNDropoutLayer(BNLayer):
    """BatchNorm in training and ``nn.Dropout``: state a forward writes, and masks a kernel draws, per call."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(p=0.25)

    def construct(self, x, pos, mask, scale):
        h = x + self.drop(self.attn(self.norm1(x), pos, mask, scale))
        h = h + ops.gelu(self.bn(h.reshape(-1, H))).reshape(h.shape)
        return h + self.mlp(self.norm2(h))


def build_bn_dropout():
    ms.set_seed(0)   # nn.Dropout's seeds: the same masks in every build
    return init_weights(PatternModel([BNDropoutLayer() for _ in range(N_LAYERS)]))


def nan_first_batch(step):
    """``hidden_batch`` with an inf at step 0: that step's loss and gradients are NaN (a loss scaler skips it)."""
    x, y, pos, mask = hidden_batch(step)
    if step == 0:
        data = x.asnumpy().copy()
        data[0, 0, 0] = np.inf
        x = Tensor(data)
    return x, y, pos, mask


class InjectedFailure(Exception):
    """What ``FailingLayer`` raises when told to (a bad batch, an OOM: caught by the training loop)."""


class FailingLayer(Layer):
    """Raises after its attention when ``fail`` is set."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        if self.fail:
            raise InjectedFailure("injected failure in the layer's forward")
        return h + self.mlp(self.norm2(h))


def build_failing():
    return init_weights(PatternModel([FailingLayer() for _ in range(N_LAYERS)]))


def varlen_batch(step):
    """(x, y, pos, mask) of a sequence length that changes every step (packing, a length curriculum)."""
    s = (8, 5, 7, 3)[step % 4]
    rng = np.random.RandomState(300 + step)
    m = np.broadcast_to(np.triu(np.ones((s, s), bool), 1), (B, s, s)).copy()
    pos = Tensor(np.tile(np.arange(s, dtype=np.int32), (B, 1)))
    return (Tensor(rng.randn(B, s, H).astype(np.float32)), Tensor(rng.randn(B, s).astype(np.float32)),
            pos, Tensor(m))


# one cell twice in the layer list (weight-shared layers) -------------------------------------------

def build_shared_layer_cell():
    a, b = Layer(), Layer()
    return init_weights(PatternModel([a, b, a]))


SHARED = r"layers 0, 2 of 'layers' are one Layer cell"


# issue 49's "Why" cases: each trains bitwise against its twin without AC, or is refused on the first backward
# naming the op and the cell path -------------------------------------------------------------------------

class Draws:
    """What the seedless random ops of a run drew, in forward order (``Pattern.replay_draws``)."""
    recorded = []
    replay = None   # a list to replay from (the plain twin), or None (draw and record)


class NoiseCell(nn.Cell):
    """Noise injection: a seeded ``StandardLaplace`` and a seedless ``Cauchy`` (neither's name says random)."""

    def __init__(self):
        super().__init__()
        self.laplace = ops.StandardLaplace(seed=5, seed2=6)
        self.cauchy = ops.Cauchy([H], 0.0, 1.0)

    def construct(self, h):
        if Draws.replay is not None:
            c = Tensor(Draws.replay.pop(0))
        else:
            c = self.cauchy()
            if not mac.is_in_recompute():
                Draws.recorded.append(c.asnumpy().copy())
        return h * (1.0 + 0.01 * self.laplace((H,))) + 0.01 * ops.tanh(c)


class NoiseLayer(Layer):
    def __init__(self):
        super().__init__()
        self.noise = NoiseCell()

    def construct(self, x, pos, mask, scale):
        h = self.noise(x + self.attn(self.norm1(x), pos, mask, scale))
        return h + self.mlp(self.norm2(h))


def build_noise_injection():
    Draws.recorded, Draws.replay = [], None
    return init_weights(PatternModel([NoiseLayer() for _ in range(N_LAYERS)]))


def recorded_draws():
    """A fresh build whose Cauchy ops replay what the last run drew (call ``build_noise_injection`` after)."""
    model = init_weights(PatternModel([NoiseLayer() for _ in range(N_LAYERS)]))
    Draws.replay = list(Draws.recorded)
    return model


@dataclass
class LayerOutput:
    """A Hugging Face-style layer output: the hidden state inside a dataclass."""
    hidden: object


class SigmoidOut(nn.Cell):
    """The layer's last ops in their own cell (an op-swap / select target), ending with a sigmoid, which
    saves its output."""

    def __init__(self):
        super().__init__()
        self.proj = mint.nn.Linear(H, H)

    def construct(self, x):
        return ops.sigmoid(self.proj(ops.gelu(x)))


class WrappedOutputLayer(Layer):
    """Returns its hidden state, which its last op saved, as ``LayerOutput(hidden=h)`` or ``{"hidden": h}``."""

    wrap = "dataclass"

    def __init__(self):
        super().__init__()
        self.out_act = SigmoidOut()

    def construct(self, x, pos, mask, scale):
        h = self.out_act(super().construct(x, pos, mask, scale))
        return LayerOutput(hidden=h) if self.wrap == "dataclass" else {"hidden": h}


class WritesOutputsModel(PatternModel):
    """Unwraps each layer's output and writes it with ``ops.assign_add`` (same storage and version: the
    backward of the layer's sigmoid reads the written values, without AC)."""

    def construct(self, x, y, pos, mask):
        for layer in self.layers:
            out = self.run_layer(layer, x, pos, mask, self.scale)
            x = out.hidden if isinstance(out, LayerOutput) else out["hidden"]
            ops.assign_add(x, ops.stop_gradient(x) * 0.25)
        return self.loss(x, y)


def build_written_output(wrap):
    cls = type(f"WrappedOutputLayer_{wrap}", (WrappedOutputLayer,), {"wrap": wrap})
    return lambda: init_weights(WritesOutputsModel([cls() for _ in range(N_LAYERS)]))


def _write_case(name):
    """A layer of ``write_cases`` (imported late: it builds on this module)."""
    import write_cases as wc

    def build():
        if name == "rebinds_argument":
            return wc.build_rebinds_argument()
        return wc.build_layers(getattr(wc, name))
    return build


class AdjacentAct(nn.Cell):
    """HyperParallel's adjacent-save case: ReLU of Square (ReLU's backward reads its own output, so no
    backward reads Square's)."""

    def construct(self, x):
        return ops.relu(ops.square(x))


class AdjacentSaveLayer(Layer):
    def __init__(self):
        super().__init__()
        self.act = AdjacentAct()

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        return h + self.mlp(self.act(self.norm2(h)))


def build_adjacent_save():
    return init_weights(PatternModel([AdjacentSaveLayer() for _ in range(N_LAYERS)]))


class PythonCounter(nn.Cell):
    """An op no rule knows: from its ``from_call``-th call on, its output depends on a Python counter it
    advances on every call, so a re-run computes another value than the forward."""

    def __init__(self, from_call):
        super().__init__()
        self.fc = mint.nn.Linear(H, H)
        self.from_call, self.calls = from_call, 0

    def construct(self, x):
        self.calls += 1
        h = ops.gelu(self.fc(x))
        return h * (1.0 + 0.01 * self.calls) if self.calls >= self.from_call else h * 1.0


class CounterLayer(Layer):
    from_call = 1

    def __init__(self):
        super().__init__()
        self.counter = PythonCounter(self.from_call)

    def construct(self, x, pos, mask, scale):
        h = self.counter(x + self.attn(self.norm1(x), pos, mask, scale))
        return h + self.mlp(self.norm2(h))


def build_python_counter(from_call):
    cls = type(f"CounterLayer_{from_call}", (CounterLayer,), {"from_call": from_call})
    return lambda: init_weights(PatternModel([cls() for _ in range(N_LAYERS)]))


class CountingScale(_Function):
    """A custom function whose forward scales by a process-wide Python counter it advances on every call."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        CountingScale.calls += 1
        ctx.factor = 1.0 + 0.01 * CountingScale.calls
        return x * ctx.factor

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor


class CountingFunctionLayer(Layer):
    """``CountingScale`` on the MLP's input, in a sub-cell (``scaler``)."""

    def __init__(self):
        super().__init__()
        self.scaler = CountingScaleCell()

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        return h + self.mlp(self.scaler(self.norm2(h)))


class CountingScaleCell(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(H, H)

    def construct(self, x):
        return ops.gelu(CountingScale.apply(self.fc(x)))


def build_counting_function():
    CountingScale.calls = 0
    return init_weights(PatternModel([CountingFunctionLayer() for _ in range(N_LAYERS)]))


# a layer group whose members return their output inside a dict or dataclass: refused on the first call
GROUP_UNWRAPPED = (r"recompute\.group_layers: layer 1 of the group of layers 0, 1, 2 ran without the group's previous "
                   r"layer right before it")


def counter_refusals(step, cell="counter"):
    """``Pattern.raises`` of a ``PythonCounter`` layer: the region that diverges first, in ``step``, and the
    path its re-run took (at step 1 the light path, where the mode has one for this layer)."""
    diverged = r"recompute diverged from forward in '%s': the recompute computed another output than the forward at op #\d+ \w+"
    where = {"full": r"layers\.2", "exclude_op": r"layers\.2", "checkpoint_api": r"layers\.2", "hyper_api": r"layers\.2",
             "select_cell": r"layers\.2\." + cell, "group": r"layers\.0"}   # a group re-runs from its first member
    light = ("full", "group", "select_cell") if step else ()
    return {mode: (step, diverged % path, "light" if mode in light else "intercepted") for mode, path in where.items()}



def _build_mindformers_moe():
    # MindFormers' own patterns (its Dropout cell, marker-guarded tracker and buffer writes, replay
    # metadata, an MTP block): mindformers_models.py, here with mindformers_ac's marker
    from mindformers_models import build_mindformers_moe
    return build_mindformers_moe("ours")

_RERUNS = ("full", "group", "select_cell", "exclude_op", "mixed", "checkpoint_api")
# the MoE models meet the checkpoint API already (their policy-free regions); hyper_api's would cost 2-3 s each
_EVERY_BUT_HYPER = ("full", "group", "select_cell", "select_op", "exclude_op", "recompute_comm", "layer_swap",
                    "op_swap", "mixed", "checkpoint_api", "swap_api", "async_save_on_cpu")
_WHY = ("full", "group", "select_cell", "exclude_op", "checkpoint_api", "hyper_api", "layer_swap", "op_swap",
        "swap_api", "async_save_on_cpu")

PATTERNS = {p.name: p for p in [
    Pattern("int_bool_inputs", build_int_bool, hidden_batch, cell="attn"),
    Pattern("batchnorm", build_batchnorm, hidden_batch, cell="bn"),
    Pattern("assign_counters", build_stateful, hidden_batch, cell="attn"),
    Pattern("tuple_outputs", build_tuple_outputs, hidden_batch, cell="attn"),
    Pattern("keyword_args", build_keyword_args, hidden_batch, cell="attn"),
    Pattern("called_twice", build_called_twice, hidden_batch, cell="attn"),
    Pattern("tied_weights", build_tied_weights, token_batch(VOCAB), cell="attn"),
    Pattern("nested_lists", build_nested_lists, hidden_batch, cell=r"blocks\.0", op=r"blocks\.1\.mlp\.act",
            comm=r"blocks\.1\.mlp\.all_gather", op_swap=r"blocks\.1", layers="decoder.layers"),
    Pattern("llama", build_llama, token_batch(LLAMA_VOCAB), cell="attention", op=r"feed_forward\.mul",
            comm=r"feed_forward\.all_gather", op_swap="feed_forward", layers="model.layers"),
    Pattern("moe", build_moe, token_batch(MOE_VOCAB), cell=r"mlp\.experts", op=r"mlp\.shared_experts\.activation_func",
            comm=r"mlp\.token_dispatcher\..*_all_to_all", op_swap="mlp", layers="decoder.layers",
            modes=_EVERY_BUT_HYPER),
    Pattern("kept_graph_moe", build_kept_graph_moe, token_batch(VOCAB), cell=r"mlp\.router", op_swap="mlp",
            modes=("full", "select_cell", "layer_swap", "op_swap", "mixed", "swap_api")),
    Pattern("mindformers_moe", _build_mindformers_moe, token_batch(24), cell=r"mlp\.experts",
            op=r"mlp\.shared_experts\.activation_func", comm=r"mlp\.shared_experts\.all_gather", op_swap="mlp",
            layers="decoder.layers", modes=_EVERY_BUT_HYPER),
    # The scenarios meet the modes whose engine path they test (a re-run, a light path, a swap), to keep
    # the suite within its time; the structural patterns above meet every mode.
    Pattern("branch_and_late_write", build_branch_write, growing_batch, cell="attn", modes=_RERUNS),
    Pattern("input_write", build_input_write, hidden_batch, cell="attn", modes=_RERUNS + ("layer_swap",)),
    Pattern("lora_after_apply", build_lora, hidden_batch, cell="attn", prepare=add_lora,
            modes=("full", "layer_swap", "op_swap", "mixed", "swap_api")),
    Pattern("two_microbatches_replayed_dropout", lambda: build_moe(microbatches=2), token_batch(MOE_VOCAB),
            cell=r"mlp\.experts", op=r"mlp\.shared_experts\.activation_func",
            comm=r"mlp\.token_dispatcher\..*_all_to_all", op_swap="mlp", layers="decoder.layers",
            modes=("full", "group", "select_cell", "layer_swap", "mixed", "checkpoint_api")),
    Pattern("nan_first_step", build_dropout, nan_first_batch, cell="attn", loop="skip_nonfinite",
            modes=("full", "group", "select_cell", "exclude_op", "layer_swap", "mixed")),
    Pattern("failed_forward", build_failing, hidden_batch, cell="attn", loop="failed_forward",
            modes=("full", "group", "layer_swap", "op_swap", "mixed", "checkpoint_api", "swap_api")),
    Pattern("changing_lengths", build_int_bool, varlen_batch, cell="attn",
            modes=("full", "group", "select_cell", "layer_swap", "op_swap", "mixed", "swap_api")),
    Pattern("remove_ac_mid_step", build_int_bool, hidden_batch, cell="attn", loop="remove_mid_step",
            modes=("full", "group", "select_op", "exclude_op", "layer_swap", "op_swap", "mixed")),
    Pattern("gpipe_four_microbatches", build_bn_dropout, hidden_batch, cell="attn", loop="gpipe"),
    Pattern("shared_layer_cell", build_shared_layer_cell, hidden_batch, cell="attn",
            refused={mode: SHARED for mode in ("full", "group", "select_cell", "select_op", "exclude_op",
                                               "recompute_comm", "layer_swap", "op_swap", "mixed")}),
    # issue 49's "Why" cases, in every mode that applies to them
    # (select_module of a cell that runs random ops keeps its output, warned: nothing to select)
    Pattern("noise_injection", build_noise_injection, hidden_batch, cell="noise",
            modes=tuple(m for m in _WHY if m != "select_cell"), replay_draws=True),
    Pattern("dataclass_output_assign_add", build_written_output("dataclass"), hidden_batch, cell="out_act",
            op_swap="out_act", modes=_WHY, raises={"group": (0, GROUP_UNWRAPPED)}),
    # a dict in its place: the same engine paths (its recompute cells as the dataclass's: full stands for them)
    Pattern("dict_output_assign_add", build_written_output("dict"), hidden_batch, cell="out_act",
            op_swap="out_act", modes=("full", "layer_swap", "op_swap", "swap_api", "async_save_on_cpu")),
    # select of attn: the layer rebinds the Parameter attn read after attn's forward; attn's re-run reads the new
    # value, which the safety net refuses (exact when the rebinding is inside the region: full, group ...)
    Pattern("argument_parameter_rebound", _write_case("rebinds_argument"), hidden_batch, cell="attn", modes=_WHY,
            raises={"select_cell": (0, r"recompute diverged from forward in 'layers\.2\.attn': the recompute "
                                       r"computed another output than the forward at op #\d+ Mul")}),
    Pattern("parameter_replaced", _write_case("ReplacesParameterLayer"), hidden_batch, cell="attn", modes=_WHY,
            raises={mode: (0, r"the recomputed region 'layers\.0' replaced its Parameter 'g' by a new Parameter")
                    for mode in ("full", "group", "exclude_op", "checkpoint_api", "hyper_api")}),
    Pattern("one_index_slot", _write_case("OneIndexSlotLayer"), hidden_batch, cell="attn", modes=_WHY),
    Pattern("kept_output_setitem", _write_case("KeptSetitemLayer"), hidden_batch, cell="attn", op_swap=r"mlp\.fc2",
            modes=_WHY),
    Pattern("adjacent_must_save", build_adjacent_save, hidden_batch, cell="act", op_swap="act",
            kept_ops=("Square", "ReLU"), never_rerun=("Square", "ReLU"), modes=_WHY),
    # the first call's re-run differs (the intercepting path), or the third call's on (the light path)
    Pattern("python_counter", build_python_counter(1), hidden_batch, cell="counter", modes=_WHY,
            raises=counter_refusals(0)),
    Pattern("python_counter_light", build_python_counter(3), hidden_batch, cell="counter", modes=_WHY,
            raises=counter_refusals(1)),
    Pattern("counting_function", build_counting_function, hidden_batch, cell="scaler", modes=_WHY,
            raises=counter_refusals(0, cell="scaler")),
]}


# -- the AC modes -----------------------------------------------------------------------------

ALL = f"0-{N_LAYERS - 1}"


def mode_config(mode, pattern):
    """The apply_ac config of ``mode`` for ``pattern`` (None for the API modes: ``checkpoint_api``, ``swap_api``,
    ``hyper_api`` (``checkpoint_wrapper`` with ``exclude_policy(pattern.kept_ops)`` on each layer) and
    ``async_save_on_cpu`` (each layer call a block), installed by ``steps.install_api``)."""
    if mode == "full":
        return {"recompute": {"mode": "full", "full_recompute_layer": [ALL]}}
    if mode == "group":   # the three layers one recompute group: only layer 0's inputs are kept
        return {"recompute": {"mode": "full", "full_recompute_layer": [ALL], "group_layers": N_LAYERS}}
    if mode == "select_cell":
        return {"recompute": {"mode": "select", "select_module": {pattern.cell: [ALL]}}}
    if mode == "select_op":
        return {"recompute": {"mode": "select", "select_module": {pattern.op: [ALL]}}}
    if mode == "exclude_op":
        return {"recompute": {"mode": "full", "full_recompute_layer": [ALL], "exclude_op": list(pattern.kept_ops)}}
    if mode == "recompute_comm":
        return {"recompute_comm": {"enable": True, "select_module": {pattern.comm: [ALL]}}}
    if mode == "layer_swap":
        return {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}}
    if mode == "op_swap":
        return {"swap": {"enable": True, "op_swap": [{"op_name": pattern.op_swap, "layers": ["0-1"]}]}}
    if mode == "mixed":   # full, select and swap on different layers, with exclude_op
        return {"recompute": {"mode": "select", "full_recompute_layer": [0], "select_module": {pattern.cell: [2]},
                              "exclude_op": ["Softmax"]},
                "swap": {"enable": True, "layer_swap": [{"layers": [1]}]}}
    return None


MODES = ("full", "group", "select_cell", "select_op", "exclude_op", "recompute_comm", "layer_swap", "op_swap",
         "mixed", "checkpoint_api", "swap_api", "hyper_api", "async_save_on_cpu")
API_MODES = ("checkpoint_api", "swap_api", "hyper_api", "async_save_on_cpu")   # installed by steps.install_api
RECOMPUTE_MODES = ("full", "group", "select_cell", "select_op", "exclude_op", "recompute_comm", "mixed")
SWAP_MODES = ("layer_swap", "op_swap", "mixed")
