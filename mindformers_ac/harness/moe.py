"""A DeepSeek-style mixture-of-experts GPT with MindFormers / Megatron cell names, optionally expert parallel.

The dense GPT of ``models.py`` with its MLP replaced, in every
``moe_layer_freq``-th layer (layer ``i`` is MoE when ``i % moe_layer_freq == 0``),
by::

    mlp: MoELayer
      router: TopKRouter (weight (E, h); optional input jitter)
      token_dispatcher: MoEAlltoAllTokenDispatcher
        _comm_ops['dispatch_all_to_all'], _comm_ops['combine_all_to_all']
      experts: SequentialMLP
        local_experts[i]: MLP (linear_fc1, activation_func, linear_fc2)
      shared_experts: MLP

Routing: top-k of the router scores (softmax, or sigmoid renormalised over
the k chosen), a Switch/GShard auxiliary load-balancing loss
``E * sum_e f_e * P_e`` per MoE layer, times ``aux_loss_coeff``, added to the
cross-entropy (a MoE layer returns ``(hidden, aux)``). Fixed capacity
``C = min(T, ceil(capacity_factor * T * top_k / E))`` per expert for ``T``
local tokens: tokens are queued first-choice first, in token order, and what
does not fit is dropped (it gets only the shared expert). Dispatch and combine
are one-hot matmuls of static shape ``(T, E * C)``: every shape is fixed, as
the all-to-all needs, and the combine weights carry the router's gradient.

Expert parallelism (``ep`` ranks, the whole world): every rank holds
``E / ep`` consecutive experts and its own data (data parallel for everything
else). The ``(E, C, h)`` dispatch buffer goes through one all-to-all to the
experts' ranks and the expert outputs come back through a second one.
MindSpore 2.10's CPU backend has no all-to-all kernel, so ``AllToAll`` there
is an AllGather plus this rank's slice, with a custom bprop (the all-to-all of
the gradient); its AllGather primitive is named ``AllToAll`` for the recompute
engine (``mac_op_name``), so ``exclude_op: [AllToAll]`` keeps it and re-runs
are counted as ``AllToAll``. Other backends use ``ops.AlltoAll``.
``sync_expert_parallel_grads`` averages the gradients over the ranks (one
fused AllReduce for the replicated parameters; the experts' gradients already
hold every rank's tokens).

Random ops: the dropouts are ``models.SeededDropout``. The router jitter
multiplies the router input by ``U(1 - eps, 1 + eps)`` from a fresh, seeded
``ops.UniformReal`` per call, marked ``mac_replayable`` unless
``jitter_replayable=False`` (then the recompute engine keeps its output on a
region's first, checking call, which measures that it draws again bitwise,
and re-runs it on the light path after that).
"""
import dataclasses
import math
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

from ..errors import ConfigError
from ..recompute import OP_NAME_ATTR, REPLAYABLE_ATTR
from .models import MLP, GPTConfig, GPTModel, TransformerBlock, TransformerLayer, gpt_config
from .tp import TPComm, registry_cells

__all__ = ["AllToAll", "DispatchAllToAll", "MOE_FLAGS", "MoEConfig", "MoEGPTModel", "MoELayer",
           "add_moe_arguments", "build_moe_gpt", "check_ep_world", "check_moe_config", "expert_owner",
           "moe_config", "moe_from_args", "reference_moe_model", "sync_expert_parallel_grads"]


@dataclass
class MoEConfig(GPTConfig):
    """The reference MoE GPT: ``GPTConfig``'s dimensions plus the MoE fields (Megatron names).

    ``moe_ffn_ratio``: expert (and shared expert) FFN size / hidden size.
    ``router_jitter``: eps of the router's input jitter (0: none).
    """

    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.0
    moe_layer_freq: int = 1
    score_func: str = "softmax"
    aux_loss_coeff: float = 0.01
    moe_ffn_ratio: int = 2
    router_jitter: float = 0.0
    jitter_replayable: bool = True


def check_moe_config(config, ep=1):
    """Raise ``ConfigError`` naming the ``MoEConfig`` field (or ``ep``) for MoE settings that can't build."""
    if config.num_experts < 1:
        raise ConfigError("num_experts", f"must be >= 1, got {config.num_experts}")
    if not 1 <= config.top_k <= config.num_experts:
        raise ConfigError("top_k", f"must be in [1, num_experts={config.num_experts}], got {config.top_k}")
    if not config.capacity_factor > 0:
        raise ConfigError("capacity_factor", f"must be > 0, got {config.capacity_factor}")
    if config.moe_layer_freq < 1:
        raise ConfigError("moe_layer_freq", f"must be >= 1, got {config.moe_layer_freq}")
    if config.score_func not in ("softmax", "sigmoid"):
        raise ConfigError("score_func", f"must be 'softmax' or 'sigmoid', got {config.score_func!r}")
    if not 0 <= config.router_jitter < 1:
        raise ConfigError("router_jitter", f"must be in [0, 1), got {config.router_jitter}")
    if ep < 1 or config.num_experts % ep:
        raise ConfigError("ep", f"{ep} must divide num_experts {config.num_experts}")


class AllToAll(TPComm):
    """All-to-all along dim 0 (equal splits): block ``j`` of ``x`` goes to rank ``j``; the result holds
    every rank's block for this rank, in rank order. Backward is the all-to-all of the gradient.

    On CPU an AllGather (its primitive named ``AllToAll`` for the engine) and this rank's slice;
    ``ops.AlltoAll`` elsewhere. A copy for one rank.
    """

    fwd_collective = "AllToAll"
    bwd_collective = "AllToAll"

    def __init__(self, ep_rank=0, ep_size=1, group=None):
        super().__init__(ep_rank, ep_size, 0, group)

    def all_to_all(self, x):
        if self.tp_size == 1:   # a fresh tensor, as a collective's: consumers save it as they would on ranks
            return x.copy()
        n = self.tp_size
        if ms.get_context("device_target") != "CPU":
            prim = self._prims.get("AlltoAll")
            if prim is None:
                kwargs = {} if self.group is None else {"group": self.group}
                prim = self._prims["AlltoAll"] = ops.AlltoAll(n, 0, 0, **kwargs)
            return prim(x)
        prim = self._prims.get("AllToAll")
        if prim is None:
            prim = ops.AllGather() if self.group is None else ops.AllGather(group=self.group)
            setattr(prim, OP_NAME_ATTR, "AllToAll")
            self._prims["AllToAll"] = prim
        gathered = prim(x).reshape((n, n, x.shape[0] // n) + x.shape[1:])   # (source, destination, block...)
        # a copy, not a view: consumers save a private copy of a view, which output recompute can't match
        return mint.narrow(gathered, 1, self.tp_rank, 1).reshape(x.shape).copy()

    def construct(self, x):
        self._count_forward()
        return self.all_to_all(x)

    def bprop(self, x, out, dout):
        self.bwd_calls += 1
        return (self.all_to_all(dout),)


class DispatchAllToAll(AllToAll):
    """The dispatch all-to-all: ``(E * C, h)`` buffer in expert order in, one ``(ep * C, h)`` tensor per
    local expert out (every rank's tokens for it, in rank order).

    Handing each expert its own (non-view) output tensor lets output recompute (``recompute_comm``) find
    the tensors the experts' first linears save: a slice of one output would be a view, which they copy.
    """

    def __init__(self, num_local_experts, ep_rank=0, ep_size=1, group=None):
        super().__init__(ep_rank, ep_size, group)
        self.num_local = num_local_experts

    def construct(self, x):
        self._count_forward()
        received = self.all_to_all(x)
        per_expert = received.reshape(self.tp_size, self.num_local, -1, x.shape[-1]).swapaxes(0, 1)
        # copies: unstack's outputs are views, and a linear saves a private copy of a view input
        return tuple(t.copy() for t in ops.unstack(per_expert.reshape(self.num_local, -1, x.shape[-1]), 0))

    def bprop(self, x, out, dout):
        self.bwd_calls += 1
        grads = ops.stack([d.reshape(self.tp_size, -1, x.shape[-1]) for d in dout])   # (local, ep, C, h)
        return (self.all_to_all(grads.swapaxes(0, 1).reshape(x.shape)),)


class TopKRouter(nn.Cell):
    """Scores ``(T, E)`` of the tokens, their top-k experts and weights, and the load-balancing loss."""

    def __init__(self, config, seeds):
        super().__init__()
        # NumPy's global RNG, which build_moe_gpt seeds as it seeds MindSpore's
        self.weight = Parameter(Tensor(np.random.normal(0, 0.2, (config.num_experts, config.hidden_size))
                                       .astype(np.float32)), name="weight")
        self.num_experts, self.top_k, self.score_func = config.num_experts, config.top_k, config.score_func
        self.jitter = config.router_jitter
        self.jitter_replayable = config.jitter_replayable
        self.seeds = seeds
        self.site = seeds.new_site()

    def apply_jitter(self, x):
        uniform = ops.UniformReal(*self.seeds.seeds_at(self.site))
        # a fresh seeded primitive draws the same numbers again: the engine may re-run it (see models.SeededKernelDropout)
        setattr(uniform, REPLAYABLE_ATTR, self.jitter_replayable)
        noise = uniform(x.shape)
        return x * (noise * (2 * self.jitter) + (1 - self.jitter))

    def construct(self, x):
        if self.jitter > 0 and self.training:
            x = self.apply_jitter(x)
        logits = ops.matmul(x, self.weight.T)
        if self.score_func == "softmax":
            scores = mint.nn.functional.softmax(logits, dim=-1)
            weights, indices = ops.topk(scores, self.top_k)
        else:
            scores = ops.sigmoid(logits)
            weights, indices = ops.topk(scores, self.top_k)
            weights = weights / weights.sum(-1, keepdims=True)
        # Switch/GShard: fraction of the k*T choices per expert times the mean score, scaled to 1 when even
        chosen = ops.one_hot(indices, self.num_experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        fraction = ops.stop_gradient(chosen.sum((0, 1))) / (indices.shape[0] * self.top_k)
        aux = (fraction * scores.mean(0)).sum() * self.num_experts
        return weights, indices, aux


class MoEAlltoAllTokenDispatcher(nn.Cell):
    """Fixed-capacity dispatch of tokens to experts and back; its collectives sit in ``_comm_ops``."""

    def __init__(self, config, ep_rank=0, ep_size=1, group=None):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = config.num_experts, config.top_k, config.capacity_factor
        self.ep_size = ep_size
        self.num_local = config.num_experts // ep_size
        self._comm_ops = {"dispatch_all_to_all": DispatchAllToAll(self.num_local, ep_rank, ep_size, group),
                          "combine_all_to_all": AllToAll(ep_rank, ep_size, group)}

    def capacity(self, num_tokens):
        return min(num_tokens, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def routing_masks(self, weights, indices):
        """``(dispatch, combine)``, both ``(T, E * C)``: which buffer slot each token fills, with which weight.

        Queue order is choice-major (every token's first choice before any second
        choice), then token order; a choice past an expert's capacity is dropped.
        """
        t, k, e = indices.shape[0], self.top_k, self.num_experts
        c = self.capacity(t)
        one, zero = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
        chosen = ops.one_hot(indices.T.reshape(-1), e, one, zero)              # (k*T, E), choice-major
        rank_in_queue = ops.cumsum(chosen, 0) * chosen                         # 1-based slot, 0 if not chosen
        kept = chosen * (rank_in_queue <= c).astype(ms.float32)
        slot = ops.clip_by_value((rank_in_queue - 1).astype(ms.int32), 0, c - 1)
        slots = ops.one_hot(slot, c, one, zero) * kept.expand_dims(-1)        # (k*T, E, C)
        slots = slots.reshape(k, t, e * c)
        dispatch = slots.sum(0)
        combine = (slots * weights.T.reshape(k, t, 1)).sum(0)
        return ops.stop_gradient(dispatch), combine

    def token_permutation(self, tokens, dispatch):
        """One ``(ep * C, h)`` input per local expert: every rank's tokens routed to it."""
        return self._comm_ops["dispatch_all_to_all"](ops.matmul(dispatch.T, tokens))   # (E * C, h) sent

    def token_unpermutation(self, expert_outputs, combine):
        """``(T, h)``: the local experts' outputs sent back to their tokens' ranks, weighted and summed."""
        h = expert_outputs[0].shape[-1]
        stacked = ops.stack(expert_outputs).reshape(self.num_local, self.ep_size, -1, h)   # (local, ep, C, h)
        returned = self._comm_ops["combine_all_to_all"](stacked.swapaxes(0, 1).reshape(-1, h))   # (E * C, h)
        return ops.matmul(combine, returned)


class SequentialMLP(nn.Cell):
    """This rank's experts, each an ``MLP``, run one after the other on their buffers."""

    def __init__(self, config, num_local_experts):
        super().__init__()
        self.local_experts = nn.CellList([MLP(config) for _ in range(num_local_experts)])

    def construct(self, buffers):
        return tuple(expert(x) for expert, x in zip(self.local_experts, buffers))


class MoELayer(nn.Cell):
    """Router, dispatcher, routed experts and a shared expert; returns ``(output, aux_loss)``."""

    def __init__(self, config, seeds, ep_rank=0, ep_size=1, group=None):
        super().__init__()
        expert_dims = dataclasses.replace(config, ffn_ratio=config.moe_ffn_ratio)
        self.router = TopKRouter(config, seeds)
        self.token_dispatcher = MoEAlltoAllTokenDispatcher(config, ep_rank, ep_size, group)
        self.experts = SequentialMLP(expert_dims, config.num_experts // ep_size)
        self.shared_experts = MLP(expert_dims)

    def construct(self, x):
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        weights, indices, aux = self.router(tokens)
        dispatch, combine = self.token_dispatcher.routing_masks(weights, indices)
        expert_out = self.experts(self.token_dispatcher.token_permutation(tokens, dispatch))
        out = self.token_dispatcher.token_unpermutation(expert_out, combine) + self.shared_experts(tokens)
        return out.reshape(b, s, h), aux


class MoETransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose MLP is a ``MoELayer`` when ``is_moe_layer``; then it returns ``(x, aux)``."""

    def __init__(self, config, layer_number, seeds, ep):
        super().__init__(config, layer_number, seeds)
        self.is_moe_layer = layer_number % config.moe_layer_freq == 0
        if self.is_moe_layer:
            self.mlp = MoELayer(config, seeds, **ep)

    def construct(self, x, attention_mask):
        if not self.is_moe_layer:
            return super().construct(x, attention_mask)
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), attention_mask))
        out, aux = self.mlp(self.pre_mlp_layernorm(x))
        return x + self.mlp_dropout(out), aux


class MoETransformerBlock(TransformerBlock):
    def __init__(self, config, seeds, ep):
        super().__init__(dataclasses.replace(config, num_layers=0), seeds)
        self.config = config
        self.layers = nn.CellList([MoETransformerLayer(config, i, seeds, ep) for i in range(config.num_layers)])

    def construct(self, x, attention_mask):
        aux_total = None
        for layer in self.layers:
            if layer.is_moe_layer:
                x, aux = layer(x, attention_mask)
                aux_total = aux if aux_total is None else aux_total + aux
            else:
                x = layer(x, attention_mask)
        return self.final_layernorm(x), aux_total


class MoEGPTModel(GPTModel):
    """``GPTModel`` with MoE layers: ``model(tokens, labels)`` is cross-entropy + ``aux_loss_coeff`` x aux."""

    def __init__(self, config, seed=0, ep_rank=0, ep_size=1, group=None):
        check_moe_config(config, ep_size)
        super().__init__(dataclasses.replace(config, num_layers=0), seed)
        self.config = config
        self.ep_rank, self.ep_size, self.group = ep_rank, ep_size, group
        ep = {"ep_rank": ep_rank, "ep_size": ep_size, "group": group}
        self.decoder = MoETransformerBlock(config, self.dropout_seeds, ep)
        self.grad_sync_calls = 0
        # Comm cells by path, as built (tp.comm_cells reads it): recompute_comm puts proxies into the slots
        self._tp_comm_index = dict(registry_cells(self))

    def construct(self, tokens, labels):
        self.dropout_seeds.step += 1   # as GPTModel: one dropout/jitter step per forward
        s = tokens.shape[1]
        hidden, aux = self.decoder(self.embedding(tokens), self.attention_mask[:, :, :s, :s])
        logits = self.output_layer(hidden)
        loss = self.loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return loss if aux is None else loss + self.config.aux_loss_coeff * aux


def moe_config(config=None, **dims):
    """``config`` (default ``MoEConfig()``) with the ``MoEConfig`` fields in ``dims`` replaced."""
    base = config if config is not None else MoEConfig()
    if not isinstance(base, MoEConfig):   # a dense GPTConfig: its dimensions, the MoE defaults
        base = MoEConfig(**dataclasses.asdict(base))
    return gpt_config(base, **dims)


def build_moe_gpt(config=None, seed=0, *, ep=1, rank=0, group=None, full_model=None, **dims):
    """A ``MoEGPTModel`` with deterministic weights for ``seed``, in training mode.

    ``config``/``dims`` as in ``models.build_gpt`` (``MoEConfig`` fields, e.g.
    ``build_moe_gpt(num_layers=2, hidden_size=32, num_experts=4, top_k=2)``).
    ``ep > 1``: ``rank``'s expert-parallel slice, its experts' weights copied from
    ``full_model`` (built with ``ep=1`` when not given), every other weight as in
    ``full_model``. Raises ``ConfigError`` naming the field for a bad MoE setting.
    """
    config = moe_config(config, **dims)
    check_moe_config(config, ep)
    if ep > 1 and full_model is None:
        full_model = build_moe_gpt(config, seed)
    ms.set_seed(seed)
    np.random.seed(seed)
    model = MoEGPTModel(config, seed, rank, ep, group)
    if ep > 1:
        full = {p.name: p for p in full_model.get_parameters()}
        for param in model.get_parameters():
            source = full[expert_owner(param.name, config.num_experts // ep, rank)]
            param.set_data(Tensor(source.asnumpy().copy(), param.dtype))
    model.set_train(True)
    ms.set_seed(seed)
    return model


def expert_owner(name, num_local, rank):
    """The single-process name of local parameter ``name`` of ``rank`` (local expert i is global rank*num_local+i)."""
    marker = ".local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker, 1)
    index, rest = tail.split(".", 1)
    return f"{head}{marker}{rank * num_local + int(index)}.{rest}"


def is_expert_param(name):
    return ".local_experts." in name


def sync_expert_parallel_grads(model, params, grads):
    """Average the gradients over the expert-parallel (= data-parallel) ranks; returns a new tuple.

    Replicated parameters: one fused AllReduce, divided by ``ep``. Experts: their
    gradient already sums every rank's tokens (the all-to-all's bprop), so only
    the division. The result is the gradient of the mean of the ranks' losses.
    """
    ep = model.ep_size
    if ep == 1:
        return tuple(grads)
    out = [g / ep for g in grads]
    idx = [i for i, p in enumerate(params) if not is_expert_param(p.name)]
    if idx:
        flat = ops.cat([grads[i].reshape(-1) for i in idx])
        flat = (ops.AllReduce() if model.group is None else ops.AllReduce(group=model.group))(flat) / ep
        model.grad_sync_calls += 1
        offset = 0
        for i in idx:
            n = int(np.prod(grads[i].shape))
            out[i] = flat[offset:offset + n].reshape(grads[i].shape)
            offset += n
    return tuple(out)


def reference_moe_model():
    """``--model`` factory: the reference MoE GPT (``MoEConfig()``)."""
    return build_moe_gpt()


# --------------------------------------------------------------------------- command line (train / plan / explain)

# The MoE flags and the ``MoEConfig`` field each one sets; ``--ep`` is the expert-parallel size.
MOE_FLAGS = (("num-experts", "num_experts", int), ("top-k", "top_k", int),
             ("capacity-factor", "capacity_factor", float), ("moe-layer-freq", "moe_layer_freq", int))


def add_moe_arguments(parser):
    """``--moe`` (the reference MoE GPT instead of the dense one) and its ``MOE_FLAGS``, all defaulting to None."""
    defaults = MoEConfig()
    parser.add_argument("--moe", action="store_true",
                        help="the reference MoE GPT (harness/moe.py) instead of the dense one, its dimensions "
                             "from --layers/--hidden/... (default: the dense GPT)")
    for flag, name, kind in MOE_FLAGS:
        parser.add_argument(f"--{flag}", type=kind, default=None, metavar=flag.split("-")[-1].upper(),
                            help=f"{name} of the MoE model (default {getattr(defaults, name)}; with --moe)")


def moe_from_args(args, gpt, ep=1):
    """The ``MoEConfig`` fields the MoE flags give (a dict, None without ``--moe``), checked against the
    dense dimensions ``gpt`` and the expert-parallel size ``ep``.

    Raises ``ConfigError`` naming the flag: a MoE flag without ``--moe``, ``--ep`` > 1
    without it, and the settings ``check_moe_config`` refuses.
    """
    given = {name: getattr(args, flag.replace("-", "_")) for flag, name, _ in MOE_FLAGS}
    given = {name: value for name, value in given.items() if value is not None}
    if not getattr(args, "moe", False):
        for flag, name, _ in MOE_FLAGS:
            if name in given:
                raise ConfigError(f"--{flag}", "applies to the MoE model only; add --moe")
        if ep > 1:
            raise ConfigError("--ep", "expert parallelism needs the MoE model; add --moe")
        return None
    flags = {name: f"--{flag}" for flag, name, _ in MOE_FLAGS}
    flags.update(ep="--ep", num_layers="--layers")
    try:
        check_moe_config(moe_config(gpt, **given), ep)
    except ConfigError as exc:
        raise ConfigError(flags.get(exc.field, exc.field), exc.reason) from None
    return given


def check_ep_world(ep, world):
    """Raise ``ConfigError`` naming ``--ep`` unless the job's ``world`` ranks are exactly the ``ep`` ranks."""
    if world % ep:
        raise ConfigError("--ep", f"{ep} does not divide the number of ranks {world}")
    if world != ep:
        raise ConfigError("--ep", f"{ep} but the job has {world} ranks: the expert-parallel group is the whole "
                                  f"job; launch it with msrun --worker_num {ep} --local_worker_num {ep}")
