"""A MindFormers-style MoE GPT written the way MindFormers 2.1.0's PyNative code is (see mindformers_standin).

What it copies, each a pattern that the AC modes must meet:

* MindFormers' ``Dropout`` cell: the functional dropout stored as the cell's
  ``dropout`` attribute (``ops.dropout`` here: ``mint.nn.functional.dropout``
  has no CPU kernel), called with ``(x, p, training)``;
* a router that adds each layer's load-balancing loss to a module-level
  logging tracker, skipped under the recompute marker
  (``save_to_aux_losses_tracker``), and a ``tokens_per_expert`` buffer
  written in place in forward, also guarded by the marker;
* an expert-parallel dispatch that reads the routing to the host once and
  hands the host-side lists to its own re-run with ``save_for_recompute`` /
  ``get_recompute_metadata`` (so the re-run skips the Cast the host read
  needs);
* a multi-token-prediction block (``mtp.layers``) after the decoder, called
  on the decoder's output, as MindFormers' ``MultiTokenPredictionBlock``.

``marker`` picks whose ``is_in_recompute`` / metadata functions the model
asks: ``"ours"`` (mindformers_ac's) or ``"mindformers"`` (the stand-in's,
which ``apply_ac`` bridges through its default ``context_fn``).
"""
import mindformers_standin as mf
import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

import mindformers_ac as mac

from model_patterns import N_LAYERS, B, H, S, StandInAllGather, init_weights

VOCAB, N_EXPERTS, TOP_K, N_MTP = 24, 4, 2, 1
MARKERS = {
    "ours": (mac.is_in_recompute, mac.save_for_recompute, mac.get_recompute_metadata),
    "mindformers": (mf.is_in_recompute, mf.save_for_recompute, mf.get_recompute_metadata),
}


class MFDropout(nn.Cell):
    """mindformers/pynative/layers/dropout.py: the functional dropout held as an attribute."""

    def __init__(self, drop_prob):
        super().__init__()
        self.p = drop_prob
        self.use_dropout = drop_prob != 0
        self.dropout = ops.dropout

    def construct(self, x):
        if not self.training or not self.use_dropout:
            return x
        return self.dropout(x, self.p, self.training)


class RMSNorm(nn.Cell):
    def __init__(self):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(H, np.float32)), name="weight")

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * self.weight


class SelfAttention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.linear_qkv = mint.nn.Linear(H, 3 * H)
        self.linear_proj = mint.nn.Linear(H, H)
        self.softmax = mint.nn.functional.softmax
        self.attention_dropout = MFDropout(0.1)

    def construct(self, x, mask):
        q, k, v = mint.split(self.linear_qkv(x), H, -1)
        s = ops.matmul(q, k.swapaxes(-1, -2)) * (H ** -0.5)
        probs = self.attention_dropout(self.softmax(s.masked_fill(mask, -1e4), dim=-1))
        return self.linear_proj(ops.matmul(probs, v))


class Router(nn.Cell):
    """Top-k softmax routing with a load-balancing loss logged to the tracker (once per step)."""

    def __init__(self, layer_number, tracker):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((N_EXPERTS, H), np.float32)), name="weight")
        self.layer_number, self.tracker = layer_number, tracker

    def construct(self, x):
        probs = mint.nn.functional.softmax(ops.matmul(x, self.weight.T), dim=-1)
        top_scores, indices = ops.topk(probs, TOP_K)
        counts = ops.one_hot(indices, N_EXPERTS, Tensor(1.0), Tensor(0.0)).sum((0, 1))
        aux = (probs.mean(0) * counts).sum() * (N_EXPERTS / (x.shape[0] * TOP_K))
        self.tracker.save(aux, self.layer_number, N_LAYERS + N_MTP)
        return top_scores, indices, counts, aux


class Expert(nn.Cell):
    """An expert MLP; ``_comm_ops['all_gather']`` is a collective slot (``recompute_comm``)."""

    def __init__(self):
        super().__init__()
        self.linear_fc1 = mint.nn.Linear(H, 2 * H)
        self.linear_fc2 = mint.nn.Linear(2 * H, H)
        self.activation_func = ops.gelu
        self._comm_ops = {"all_gather": StandInAllGather()}

    def construct(self, x):
        return self.linear_fc2(self.activation_func(self.linear_fc1(self._comm_ops["all_gather"](x))))


class Experts(nn.Cell):
    """Expert-parallel style dispatch: host-side token lists per expert, read once per forward."""

    def __init__(self, marker):
        super().__init__()
        self.local_experts = nn.CellList([Expert() for _ in range(N_EXPERTS)])
        _, self.save_for_recompute, self.get_recompute_metadata = MARKERS[marker]

    def token_lists(self, indices):
        lists = self.get_recompute_metadata("expert_token_lists")
        if lists is not None:
            return lists   # the forward's: no second host read (and no Cast) in the re-run
        host = ops.cast(indices, ms.int32).asnumpy()
        lists = [np.nonzero((host == e).any(-1))[0].astype(np.int32).tolist() for e in range(N_EXPERTS)]
        self.save_for_recompute("expert_token_lists", lists)
        return lists

    def construct(self, x, top_scores, indices):
        out = ops.zeros_like(x)
        for e, rows in enumerate(self.token_lists(indices)):
            if not rows:
                continue
            idx = Tensor(np.array(rows, np.int32))
            weight = (top_scores[idx] * ops.cast(indices[idx] == e, ms.float32)).sum(-1, keepdims=True)
            out = ops.index_add(out, idx, self.local_experts[e](x[idx]) * weight, 0)
        return out


class MoELayer(nn.Cell):
    def __init__(self, layer_number, tracker, marker):
        super().__init__()
        self.router = Router(layer_number, tracker)
        self.experts = Experts(marker)
        self.shared_experts = Expert()
        self.tokens_per_expert = Parameter(Tensor(np.zeros(N_EXPERTS, np.float32)), name="tokens_per_expert",
                                           requires_grad=False)
        self.is_in_recompute = MARKERS[marker][0]

    def construct(self, h):
        x = h.reshape(-1, H)
        top_scores, indices, counts, aux = self.router(x)
        if not self.is_in_recompute():
            ops.assign_add(self.tokens_per_expert, counts)   # MindFormers: tokens_per_expert.add_(...)
        out = self.experts(x, top_scores, indices) + self.shared_experts(x)
        return out.reshape(h.shape), aux


class TransformerLayer(nn.Cell):
    def __init__(self, layer_number, tracker, marker):
        super().__init__()
        self.input_layernorm = RMSNorm()
        self.self_attention = SelfAttention()
        self.pre_mlp_layernorm = RMSNorm()
        self.mlp = MoELayer(layer_number, tracker, marker)
        self.hidden_dropout = MFDropout(0.1)

    def construct(self, x, mask):
        h = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), mask))
        m, aux = self.mlp(self.pre_mlp_layernorm(h))
        return h + self.hidden_dropout(m), aux


class TransformerBlock(nn.Cell):
    def __init__(self, tracker, marker):
        super().__init__()
        self.layers = nn.CellList([TransformerLayer(i, tracker, marker) for i in range(N_LAYERS)])
        self.final_layernorm = RMSNorm()


class MultiTokenPredictionBlock(nn.Cell):
    def __init__(self, tracker, marker):
        super().__init__()
        self.layers = nn.CellList([TransformerLayer(N_LAYERS + i, tracker, marker) for i in range(N_MTP)])


class MFGPTModel(nn.Cell):
    """Embedding, decoder, MTP block, tied output head; loss = LM + MTP loss + aux loss."""

    def __init__(self, marker="ours"):
        super().__init__()
        self.tracker = mf.Tracker(MARKERS[marker][0])
        self.embedding = nn.Embedding(VOCAB, H)
        self.decoder = TransformerBlock(self.tracker, marker)
        self.mtp = MultiTokenPredictionBlock(self.tracker, marker)
        self.output_layer = mint.nn.Linear(H, VOCAB, bias=False)
        self.ce = nn.CrossEntropyLoss()
        self.mask = Tensor(np.broadcast_to(np.triu(np.ones((S, S), bool), 1), (B, S, S)).copy())

    def run_layer(self, layer, *args, **kwargs):
        return layer(*args, **kwargs)

    def construct(self, ids, labels, pos, mask):
        x, aux_total = self.embedding(ids), 0.0
        for layer in self.decoder.layers:
            x, aux = self.run_layer(layer, x, self.mask)
            aux_total = aux_total + aux
        loss = self.ce(self.output_layer(self.decoder.final_layernorm(x)).reshape(-1, VOCAB), labels)
        for layer in self.mtp.layers:
            x, aux = self.run_layer(layer, x, self.mask)
            aux_total = aux_total + aux
            loss = loss + 0.3 * self.ce(self.output_layer(x).reshape(-1, VOCAB), labels)
        return loss + 0.01 * aux_total


def build_mindformers_moe(marker="ours"):
    ms.set_seed(0)
    return init_weights(MFGPTModel(marker))
