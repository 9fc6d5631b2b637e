"""A realistic training script, run by ``test_training_run.py`` in fresh processes.

A LLaMA-style decoder whose layers take the rotary tables as a per-step tuple
``(cos, sin)``, int32 position ids and a bool mask; mixed precision (amp O2
applied before ``apply_ac``, or ``to_float(float16)`` on every layer after it;
bf16 has no CPU kernels for the matmul gradients, so it is not run here); ``nn.TrainOneStepCell``
with a static loss scale (``sens``, undone by Adam's ``loss_scale``: the
dynamic-scale cell's overflow check has no CPU kernel); an EMA copy made with ``copy.deepcopy``
after ``apply_ac`` and updated every step; eval of the model and of the EMA
copy between steps (``set_train(False)``, no grad); a checkpoint at
``--save-at`` and, in another process, a resume from it.

    python training_run_worker.py PHASE PRECISION WORKDIR MODE [MODE ...]

PRECISION is ``amp_o2`` or ``layers_fp16``.

PHASE ``first`` trains steps 0..SAVE_AT-1 and saves the checkpoint (the
baseline ``none`` also goes on to the last step uninterrupted); ``resume``
builds everything anew, applies AC, loads the checkpoint and trains to the
last step. Each step's whole training state (loss, overflow, loss scale, every
parameter and optimizer slot of the train cell, every EMA parameter, both
eval losses) is written as SHA1s to ``WORKDIR/MODE.PHASE.json``, with what
the AC mode did (ops re-run, tensors offloaded).
"""
import copy
import hashlib
import json
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.mindspore_compat import synchronous_pynative

from model_patterns import (
    HEAD_DIM,
    LLAMA_VOCAB,
    H,
    LLamaAttention,
    LlamaFeedForward,
    LlamaRMSNorm,
    Pattern,
    causal_padding_mask,
    init_weights,
    mode_config,
    rope_tables,
)
from steps import ac_work

synchronous_pynative("CPU")

STEPS, SAVE_AT, N_LAYERS, B, S = 4, 2, 3, 2, 8
LOSS_SCALE = 1024.0
MODES = ("none", "full", "select_cell", "select_op", "exclude_op", "recompute_comm", "layer_swap", "op_swap",
         "mixed")
PATTERN = Pattern("training_run", None, None, cell="attention", op=r"feed_forward\.mul",
                  comm=r"feed_forward\.all_gather", op_swap="feed_forward")


class Attention(LLamaAttention):
    """The pattern catalogue's grouped-query attention, its rotary tables given as a per-step tuple."""

    def construct(self, x, freqs_cis, mask):
        return self.attend(x, *freqs_cis, mask)


class DecoderLayer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.attention_norm = LlamaRMSNorm(H)
        self.attention = Attention()
        self.ffn_norm = LlamaRMSNorm(H)
        self.feed_forward = LlamaFeedForward()

    def construct(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Cell):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(LLAMA_VOCAB, H)
        self.layers = nn.CellList([DecoderLayer() for _ in range(N_LAYERS)])
        self.norm_out = LlamaRMSNorm(H)
        self.lm_head = mint.nn.Linear(H, LLAMA_VOCAB, bias=False)
        self.cos, self.sin = rope_tables(HEAD_DIM)

    def construct(self, input_ids, labels, position_ids, mask):
        freqs_cis = (ops.gather(self.cos, position_ids, 0).expand_dims(1),   # per step, (B, 1, S, D)
                     ops.gather(self.sin, position_ids, 0).expand_dims(1))
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        logits = self.lm_head(self.norm_out(h)).reshape(-1, LLAMA_VOCAB).astype(ms.float32)
        return ops.cross_entropy(logits, labels)


def batch(step, split="train"):
    rng = np.random.RandomState(step + (1000 if split == "eval" else 0))
    ids = Tensor(rng.randint(0, LLAMA_VOCAB, (B, S)).astype(np.int32))
    labels = Tensor(rng.randint(0, LLAMA_VOCAB, (B * S,)).astype(np.int32))
    pos = Tensor(np.tile(np.arange(S, dtype=np.int32), (B, 1)))
    return ids, labels, pos, causal_padding_mask()


def build(mode, precision):
    """Model (mixed precision, AC), its EMA deepcopy and the loss-scaled train cell, as a trainer builds them."""
    model = init_weights(Llama())
    config = mode_config(mode, PATTERN) if mode != "none" else None
    if precision == "amp_o2":   # amp first, then AC (MindFormers' order)
        model = ms.amp.auto_mixed_precision(model, "O2")
        if config:
            mac.apply_ac(model, config=config)
    else:                       # AC first, then each layer computes in fp16 (a per-layer compute dtype)
        if config:
            mac.apply_ac(model, config=config)
        for layer in model.layers:
            layer.to_float(ms.float16)
    ema = copy.deepcopy(model)
    opt = nn.Adam(model.trainable_params(), learning_rate=1e-2, loss_scale=LOSS_SCALE)
    train = nn.TrainOneStepCell(model, opt, sens=LOSS_SCALE)
    return model, ema, train


def digest(t):
    return hashlib.sha1(t.asnumpy().tobytes()).hexdigest()[:16]


def step(model, ema, train, i):
    model.set_train(True)
    loss = train(*batch(i))
    for p_ema, p in zip(ema.get_parameters(), model.get_parameters()):   # EMA of every parameter
        p_ema.set_data(p_ema * 0.9 + p.astype(p_ema.dtype) * 0.1)
    model.set_train(False)
    ema.set_train(False)
    eval_loss, ema_loss = model(*batch(i, "eval")), ema(*batch(i, "eval"))   # no grad
    return {"step": i, "loss": digest(loss),
            "eval": digest(eval_loss), "ema_eval": digest(ema_loss),
            "train_state": {p.name: digest(p) for p in train.get_parameters()},
            "ema": {p.name: digest(p) for p in ema.get_parameters()}}


def acted(model):
    """What the AC mode did: ops re-run and tensors offloaded (0, 0 without AC)."""
    rerun, offloaded = ac_work(model)
    return {"ops_rerun": rerun, "offloaded": offloaded}


def run(phase, precision, workdir, mode):
    model, ema, train = build(mode, precision)
    ckpt, ema_ckpt = (os.path.join(workdir, f"{mode}.{name}.ckpt") for name in ("train", "ema"))
    if phase == "first":
        last = STEPS if mode == "none" else SAVE_AT
        history = []
        for i in range(last):
            if i == SAVE_AT and mode == "none":   # the uninterrupted run goes on past the save
                ms.save_checkpoint(train, ckpt)
                ms.save_checkpoint(ema, ema_ckpt)
            history.append(step(model, ema, train, i))
        if mode != "none":
            ms.save_checkpoint(train, ckpt)
            ms.save_checkpoint(ema, ema_ckpt)
    else:
        ms.load_param_into_net(train, ms.load_checkpoint(ckpt))
        ms.load_param_into_net(ema, ms.load_checkpoint(ema_ckpt))
        history = [step(model, ema, train, i) for i in range(SAVE_AT, STEPS)]
    with open(os.path.join(workdir, f"{mode}.{phase}.json"), "w", encoding="utf-8") as f:
        json.dump({"history": history, "acted": acted(model), 
                   "ema_has_own_ac": mode == "none" or mac.ac_state(ema) not in (None, mac.ac_state(model))}, f)


if __name__ == "__main__":
    phase_arg, precision_arg, workdir_arg, *modes = sys.argv[1:]
    for m in modes:
        run(phase_arg, precision_arg, workdir_arg, m)
