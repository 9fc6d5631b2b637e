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
``SeededDropout``: a mask drawn on the host from (seed, site, step) and
applied with one ``Mul``, so two runs draw the same masks in every step, a
recompute's re-run draws them again, and MindSpore keeps no kernel state for
them. Two swaps test the engine's other dropout paths: ``use_kernel_dropout``
(a fresh seeded ``ops.Dropout`` primitive per call, marked ``mac_replayable``,
which the engine runs again) and ``use_nn_dropout`` (MindSpore's
``nn.Dropout``, which draws from kernel state: the engine keeps its masks; on
CPU they differ between processes from its 6th call).

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
    and without recompute). So each site draws from ``(seed + site, step)``
    (a mask keyed by them on the host, or a fresh ``ops.Dropout`` primitive
    seeded with them): a counter-based scheme in which a mask depends only on
    where and in which step it is drawn. ``GPTModel`` advances the step once
    per forward.
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
    """Dropout whose mask depends only on its site and step (``DropoutSeeds``); an identity outside training.

    NumPy's counter-based Philox generator, keyed by the site's seeds, draws
    which elements stay on the host; ``x * mask`` applies them (the mask
    holds 0 or ``1 / keep_prob`` in ``x``'s dtype). Nothing of it is kernel state:
    any process draws the same mask, a recompute's re-run of the cell draws it
    again, and MindSpore keeps nothing per call (a fresh seeded ``ops.Dropout``
    per call, ``SeededKernelDropout``, costs about 1 ms to set up, and MindSpore
    2.10 keeps about 62 KiB of each one it ran for the life of the process).
    """

    def __init__(self, p, seeds):
        super().__init__()
        self.keep_prob = 1.0 - p
        self.seeds = seeds
        self.site = seeds.new_site()

    def construct(self, x):
        if not self.training:
            return x
        draws = np.random.Generator(np.random.Philox(key=list(self.seeds.seeds_at(self.site))))
        kept = draws.random(x.shape, dtype=np.float32) < np.float32(self.keep_prob)
        # The mask backward keeps is an op's output, in MindSpore's memory pool like any activation: a tensor
        # made from host memory lands where malloc puts it, and the byte counts, deduplicated by address,
        # would move between processes. (A Cast from bool would cost 0.5 ms and MindSpore keeps 0.7 KiB of
        # each: scripts/probe_dropout_memory.py.)
        return x * (Tensor(kept.astype(np.float32), dtype=x.dtype) * (1.0 / self.keep_prob))


class SeededKernelDropout(nn.Cell):
    """``SeededDropout`` drawn by MindSpore's ``Dropout`` kernel: a fresh primitive per call, seeded by the site
    and step, marked ``mac_replayable`` so the recompute engine runs it again instead of keeping its mask."""

    def __init__(self, p, seeds, site):
        super().__init__()
        self.keep_prob = 1.0 - p
        self.seeds = seeds
        self.site = site

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
    return _swap_dropouts(model, lambda dropout: nn.Dropout(p=1.0 - dropout.keep_prob))


def use_kernel_dropout(model):
    """Swap ``model``'s ``SeededDropout`` cells for ``SeededKernelDropout`` (same p, site and seeds), in place:
    the engine's path for a seeded random primitive marked ``mac_replayable``."""
    return _swap_dropouts(model, lambda dropout: SeededKernelDropout(1.0 - dropout.keep_prob, dropout.seeds,
                                                                     dropout.site))


DROPOUT_KINDS = ("seeded", "kernel", "nn")


def use_dropout(model, kind):
    """``model`` with its ``SeededDropout`` cells as ``kind`` draws (one of ``DROPOUT_KINDS``): ``seeded``
    keeps them, ``kernel`` is ``use_kernel_dropout``, ``nn`` is ``use_nn_dropout``."""
    if kind not in DROPOUT_KINDS:
        raise ValueError(f"dropout kind {kind!r}: expected one of {', '.join(DROPOUT_KINDS)}")
    if kind == "kernel":
        return use_kernel_dropout(model)
    return use_nn_dropout(model) if kind == "nn" else model


def _swap_dropouts(model, make):
    for _, cell in list(model.cells_and_names()):
        for name, child in list(cell.name_cells().items()):
            if isinstance(child, SeededDropout):
                replacement = make(child)
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
