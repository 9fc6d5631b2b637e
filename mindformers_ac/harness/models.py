"""A small GPT in MindSpore PyNative whose cell names follow MindFormers.

The layout is the one ``select_module`` patterns are written against::

    GPTModel
      embedding (word_embeddings, position_embeddings, embedding_dropout)
      decoder: TransformerBlock
        layers[i]: TransformerLayer
          input_layernorm
          self_attention: SelfAttention
            linear_qkv
            core_attention: CoreAttention (bmm_qk, softmax, attention_dropout, bmm_pv)
            linear_proj
          hidden_dropout
          pre_mlp_layernorm
          mlp: MLP (linear_fc1, activation_func, linear_fc2)
          mlp_dropout
        final_layernorm
      output_layer

Only kernels that exist in the CPU build are used (``nn.LayerNorm``,
``ops.Dropout``, ``nn.Embedding``, ``mint.nn.Linear``, ``ops.gelu``,
``ops.BatchMatMul``, ``mint.nn.functional.softmax``). The dropouts are
``SeededDropout``: a fresh ``ops.Dropout`` primitive per call, seeded by
(site, step), so two runs draw the same masks in every step and the recompute
engine may draw them again (the primitive is marked ``mac_replayable``).
MindSpore's ``nn.Dropout`` draws from kernel state instead (on CPU its masks
differ between processes from its 6th call); ``use_nn_dropout`` swaps it in
to test that path.

``build_gpt`` seeds MindSpore's and NumPy's global RNGs before building, as a
user's factory would, so that every call builds the same weights.
"""
import dataclasses
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

from ..recompute import get_recompute_metadata, save_for_recompute


@dataclass
class GPTConfig:
    """The reference GPT's dimensions: the one place they are named and defaulted.

    The defaults are the model ``mindformers-ac train`` trains and the shipped
    configs target. The command-line flags that set these fields
    (``--layers --hidden ...``) are mapped to them in ``train.GPT_FLAGS``.
    """

    num_layers: int = 8
    hidden_size: int = 128
    num_heads: int = 4
    seq_length: int = 64
    vocab_size: int = 256
    ffn_ratio: int = 4
    dropout: float = 0.1


class DropoutSeeds:
    """Per-model source of dropout seeds: a site id per dropout cell and the current step.

    MindSpore 2.10's CPU ``Dropout`` kernel is not reproducible: from its 6th
    call on, two runs of the same script draw different masks (measured, with
    and without recompute). A fresh ``ops.Dropout`` primitive with explicit
    seeds is, so each site draws from ``(seed + site, step)``: a counter-based
    scheme in which a mask depends only on where and in which step it is
    drawn. ``GPTModel`` advances the step once per forward.
    """

    def __init__(self, seed):
        self.seed = seed
        self.step = 0
        self.sites = 0

    def new_site(self):
        self.sites += 1
        return self.sites

    def seeds_at(self, site):
        """``(seed0, seed1)`` for ``site`` in the step of this forward.

        A recompute re-runs a forward after later forwards may have moved
        ``step`` on (two microbatches in one graph, ``vjp`` forwards run
        before their backwards): the forward hands the step it drew with to
        its own re-run (``save_for_recompute``), so the re-run draws its mask.
        """
        key = ("dropout_seeds", site)
        step = get_recompute_metadata(key)
        if step is None:
            step = self.step
            save_for_recompute(key, step)
        return (self.seed * 1000003 + site) % (2 ** 31 - 1), step + 1


class SeededDropout(nn.Cell):
    """``nn.Dropout`` with reproducible masks (see ``DropoutSeeds``); an identity outside training."""

    def __init__(self, p, seeds):
        super().__init__()
        self.keep_prob = 1.0 - p
        self.seeds = seeds
        self.site = seeds.new_site()

    def construct(self, x):
        if not self.training:
            return x
        dropout = ops.Dropout(self.keep_prob, *self.seeds.seeds_at(self.site))
        # a fresh primitive with these seeds draws the same mask when called again, so the
        # recompute engine may run it again instead of keeping its mask (mindformers_ac's marker)
        dropout.mac_replayable = True
        out, _ = dropout(x)
        return out


def _dropout(p, seeds):
    # Identity for p=0: a dropout with p=0 would still draw a mask on CPU.
    return SeededDropout(p, seeds) if p > 0 else nn.Identity()


class CoreAttention(nn.Cell):
    def __init__(self, config, seeds):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_heads
        self.scale = float(1.0 / np.sqrt(self.head_dim))
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.softmax = mint.nn.functional.softmax
        self.attention_dropout = _dropout(config.dropout, seeds)
        self.bmm_pv = ops.BatchMatMul()

    def construct(self, q, k, v, attention_mask):
        scores = self.bmm_qk(q, k) * self.scale + attention_mask
        probs = self.attention_dropout(self.softmax(scores, dim=-1))
        return self.bmm_pv(probs, v)


class SelfAttention(nn.Cell):
    def __init__(self, config, seeds):
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.linear_qkv = mint.nn.Linear(h, 3 * h)
        self.core_attention = CoreAttention(config, seeds)
        self.linear_proj = mint.nn.Linear(h, h)

    def construct(self, x, attention_mask):
        b, s, h = x.shape
        qkv = self.linear_qkv(x).reshape(b, s, 3, self.num_heads, h // self.num_heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        context = self.core_attention(qkv[0], qkv[1], qkv[2], attention_mask)
        return self.linear_proj(context.permute(0, 2, 1, 3).reshape(b, s, h))


class MLP(nn.Cell):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.linear_fc1 = mint.nn.Linear(h, config.ffn_ratio * h)
        self.activation_func = ops.gelu
        self.linear_fc2 = mint.nn.Linear(config.ffn_ratio * h, h)

    def construct(self, x):
        return self.linear_fc2(self.activation_func(self.linear_fc1(x)))


class TransformerLayer(nn.Cell):
    def __init__(self, config, layer_number, seeds=None):
        super().__init__()
        h = config.hidden_size
        seeds = seeds if seeds is not None else DropoutSeeds(0)
        self.layer_number = layer_number
        self.input_layernorm = nn.LayerNorm((h,))
        self.self_attention = SelfAttention(config, seeds)
        self.hidden_dropout = _dropout(config.dropout, seeds)
        self.pre_mlp_layernorm = nn.LayerNorm((h,))
        self.mlp = MLP(config)
        self.mlp_dropout = _dropout(config.dropout, seeds)

    def construct(self, x, attention_mask):
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), attention_mask))
        return x + self.mlp_dropout(self.mlp(self.pre_mlp_layernorm(x)))


class TransformerBlock(nn.Cell):
    def __init__(self, config, seeds=None):
        super().__init__()
        self.config = config
        self.layers = nn.CellList([TransformerLayer(config, i, seeds) for i in range(config.num_layers)])
        self.final_layernorm = nn.LayerNorm((config.hidden_size,))

    def construct(self, x, attention_mask):
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.final_layernorm(x)


class Embedding(nn.Cell):
    def __init__(self, config, seeds):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.seq_length, config.hidden_size)
        self.embedding_dropout = _dropout(config.dropout, seeds)
        self.position_ids = Tensor(np.arange(config.seq_length, dtype=np.int32)[None, :])

    def construct(self, tokens):
        s = tokens.shape[1]
        x = self.word_embeddings(tokens) + self.position_embeddings(self.position_ids[:, :s])
        return self.embedding_dropout(x)


class GPTModel(nn.Cell):
    """Causal language model: ``model(tokens, labels)`` returns the mean cross-entropy loss."""

    def __init__(self, config, seed=0):
        super().__init__()
        self.config = config
        self.dropout_seeds = DropoutSeeds(seed)
        self.embedding = Embedding(config, self.dropout_seeds)
        self.decoder = TransformerBlock(config, self.dropout_seeds)
        self.output_layer = mint.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        s = config.seq_length
        # Additive causal mask, built once: it is a model input to every layer, never swapped.
        self.attention_mask = Tensor(np.triu(np.full((s, s), -1e9, np.float32), 1)[None, None])

    def construct(self, tokens, labels):
        # one step per forward: a recompute re-runs layers, never this, so it sees the same seeds
        self.dropout_seeds.step += 1
        s = tokens.shape[1]
        hidden = self.decoder(self.embedding(tokens), self.attention_mask[:, :, :s, :s])
        logits = self.output_layer(hidden)
        return self.loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt_config(config=None, **dims):
    """``config`` (default ``GPTConfig()``) with the ``GPTConfig`` fields in ``dims`` replaced."""
    return dataclasses.replace(config if config is not None else GPTConfig(), **dims)


def build_gpt(config=None, seed=0, **dims):
    """Build a ``GPTModel`` with deterministic weights for ``seed``, in training mode.

    The dimensions are ``config`` (default ``GPTConfig()``, the reference
    GPT) with any ``GPTConfig`` field given in ``dims`` replaced, e.g.
    ``build_gpt(num_layers=2, hidden_size=32)``; an unknown name is a
    ``TypeError``. Training mode matters: ``nn.Dropout`` is the identity in a
    cell that is not ``set_train(True)``, and this model exists to be trained.
    """
    ms.set_seed(seed)
    np.random.seed(seed)
    model = GPTModel(gpt_config(config, **dims), seed)
    model.set_train(True)
    return model


def use_nn_dropout(model, seed=7):
    """Swap ``model``'s ``SeededDropout`` cells for MindSpore's ``nn.Dropout`` (same p), in place.

    ``nn.Dropout`` keeps RNG state in its kernel, as real MindFormers models'
    dropouts do: a re-run draws a new mask, so the recompute engine must keep
    its masks instead of drawing them again. Seeded first, so two models
    swapped alike draw alike (for 5 calls: see ``DropoutSeeds``).
    """
    ms.set_seed(seed)
    for _, cell in list(model.cells_and_names()):
        for name, child in list(cell.name_cells().items()):
            if isinstance(child, SeededDropout):
                replacement = nn.Dropout(p=1.0 - child.keep_prob)
                replacement.set_train(child.training)
                setattr(cell, name, replacement)
    return model


def synthetic_batch(batch_size, seq_length, vocab_size, seed=0):
    """Token ids and next-token labels from a fixed random stream (no data download)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=(batch_size, seq_length + 1), dtype=np.int32)
    return Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])


@dataclass(frozen=True)
class SyntheticBatches:
    """``make_inputs`` of the reference synthetic data: step ``k`` -> ``(tokens, labels)`` drawn with seed ``seed + k``.

    What the reference GPT trains on, and what feeds a ``--model`` factory that
    returns a model only (called as ``model(tokens, labels)``).
    """

    batch: int
    seq_length: int
    vocab_size: int
    seed: int = 0

    def __call__(self, step):
        return synthetic_batch(self.batch, self.seq_length, self.vocab_size, seed=self.seed + step)


def reference_model():
    """Factory used by the CLI's default ``--model``: the reference GPT (``GPTConfig()``), which the
    shipped configs target."""
    return build_gpt()
