"""Megatron-style tensor parallelism for the reference GPT (``models.py``), PyNative on CPU.

Layout (``tp`` ranks, ``sequence_parallel=True``, the default)::

    embedding (replicated) -> scatter (seq dim, no comm)          GPTModel._comm_ops['scatter']
    layer i, activations split along the sequence dim (b, s/tp, h):
      input_layernorm (local shard)
      self_attention.linear_qkv   ColumnParallel: all_gather(seq) -> x @ W_qkv[heads of rank]
      self_attention.core_attention  (local heads, full sequence)
      self_attention.linear_proj  RowParallel:  x_local @ W_proj[:, cols of rank] -> reduce_scatter(seq) + bias
      pre_mlp_layernorm (local shard)
      mlp.linear_fc1              ColumnParallel: all_gather(seq) -> x @ W_fc1[rows of rank]
      mlp.activation_func         (local columns)
      mlp.linear_fc2              RowParallel:  reduce_scatter(seq) + bias
    final_layernorm (local shard) -> all_gather (seq dim)            GPTModel._comm_ops['all_gather']
    output_layer + loss (replicated)

This is MindFormers' ``use_seq_parallel`` layout: the input of every
column-parallel linear is all-gathered along the sequence, which is exactly
what ``recompute_comm`` (``configs/comm_recompute.yaml``: ``'.*\\.all_gather'``)
re-runs in backward instead of keeping the gathered tensor alive. The
collectives sit in a plain-dict registry ``_comm_ops`` on each linear, so a
layer's whitelist shows ``self_attention.linear_qkv.all_gather``,
``self_attention.linear_proj.reduce_scatter``, ``mlp.linear_fc1.all_gather``,
``mlp.linear_fc2.reduce_scatter``. Here each slot holds a collective cell;
MindFormers 2.1.0's ``register_comm_op`` holds ``{'fn': fn, 'domain': d}``
under dotted names (``output.allreduce``), called from forward hooks: that
form is an op slot too (``tests/test_mindformers_comm_ops.py``, and on two
ranks in ``tests/parallel_worker.py``'s tp job).

With ``sequence_parallel=False`` the layout is plain Megatron TP: activations
are replicated, column-parallel linears hold ``copy_to_tp`` (identity forward,
AllReduce backward) and row-parallel linears ``all_reduce`` (AllReduce
forward, identity backward); there is no ``all_gather`` in a layer then.

CPU (mccl) has no ReduceScatter kernel, so no autodiff through ``ops.AllGather``
either (its bprop is a ReduceScatter). Every collective here is a Cell with a
custom ``bprop``: reduce-scatter is AllReduce + own slice (twice the traffic
of a real ReduceScatter, same result), the backward of all-gather is AllReduce
+ own slice. Each comm cell counts its forward (``fwd_calls``) and backward
(``bwd_calls``) runs; ``fwd_collective`` / ``bwd_collective`` name the
primitive each direction runs (``None``: no communication).

Gradients: with sequence parallelism the LayerNorm parameters and the
row-parallel biases see only this rank's sequence shard, so their gradients
are partial sums; call ``sync_sequence_parallel_grads(model, grads)`` after
backward (one fused AllReduce). Everything else comes out right by the comm
cells' bprops. The word/position embeddings and the output layer are not
split (no vocab parallelism).

Dropout: ``build_tp_gpt`` sets the same seed on every rank, so dropout on
replicated activations (the embedding dropout; with ``sequence_parallel=False``
also hidden/mlp dropout) draws identical masks on all ranks. Dropout on split
activations (attention heads, sequence shards) draws the same pattern on
different slices, which is valid but not the single-process mask.

With ``world_size == 1`` (or before communication is initialised, as long as
the model is not run with ``tp > 1``) the comm cells are identities, so TP
cells can be built and inspected in a single process.
"""
import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

from ..recompute import is_in_recompute
from .models import MLP, GPTModel, SelfAttention, TransformerBlock, TransformerLayer, build_gpt, gpt_config

__all__ = [
    "ColumnParallelLinear", "CopyToTP", "GatherFromTP", "ReduceFromTP", "ReduceScatterToTP",
    "RowParallelLinear", "ScatterToTP", "TPGPTModel", "build_tp_gpt", "collective_counts", "comm_cells",
    "expected_collectives",
    "init_tp", "reset_comm_counters", "shard_full_params", "sync_sequence_parallel_grads",
    "unshard_param",
]


def init_tp():
    """``mindspore.communication.init()`` (mccl on CPU) unless done already in this process (several
    comparisons in one msrun job), then ``(rank, world_size)``."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank, init
    if not GlobalComm.INITED:
        init()
    return get_rank(), get_group_size()


# --------------------------------------------------------------------------- comm cells

class TPComm(nn.Cell):
    """Base of the collectives: rank/size/group, lazily built primitives, call counters."""

    fwd_collective = None
    bwd_collective = None

    def __init__(self, tp_rank=0, tp_size=1, dim=-1, group=None):
        super().__init__()
        self.tp_rank = int(tp_rank)
        self.tp_size = int(tp_size)
        self.dim = dim
        self.group = group
        self.fwd_calls = 0
        self.bwd_calls = 0
        self.recompute_calls = 0  # forward runs made by a backward-time recompute (recompute_comm)
        self._prims = {}

    def _count_forward(self):
        if is_in_recompute():
            self.recompute_calls += 1
        else:
            self.fwd_calls += 1

    def _prim(self, kind):
        prim = self._prims.get(kind)
        if prim is None:
            cls = {"AllReduce": ops.AllReduce, "AllGather": ops.AllGather}[kind]
            prim = cls() if self.group is None else cls(group=self.group)
            self._prims[kind] = prim
        return prim

    def _axis(self, x):
        return self.dim % x.ndim

    def all_reduce(self, x):
        return x if self.tp_size == 1 else self._prim("AllReduce")(x)

    def all_gather(self, x):
        """Concatenate the ranks' ``x`` along ``self.dim`` (ops.AllGather works on dim 0)."""
        if self.tp_size == 1:
            return x
        axis = self._axis(x)
        if axis == 0:
            return self._prim("AllGather")(x)
        # contiguous: a strided view would make consumers save a private copy, which output
        # recompute (recompute_comm) can't recognise as this op's output
        return self._prim("AllGather")(x.swapaxes(0, axis)).swapaxes(0, axis).contiguous()

    def own_slice(self, x):
        if self.tp_size == 1:
            return x
        axis = self._axis(x)
        size = x.shape[axis] // self.tp_size
        return mint.narrow(x, axis, self.tp_rank * size, size)

    def extend_repr(self):
        return f"tp_rank={self.tp_rank}, tp_size={self.tp_size}, dim={self.dim}"


class CopyToTP(TPComm):
    """Enter a tensor-parallel region: forward identity, backward AllReduce (sum)."""

    bwd_collective = "AllReduce"

    def construct(self, x):
        self._count_forward()
        return x * 1

    def bprop(self, x, out, dout):
        self.bwd_calls += 1
        return (self.all_reduce(dout),)


class ReduceFromTP(TPComm):
    """Leave a row-parallel matmul: forward AllReduce (sum), backward identity."""

    fwd_collective = "AllReduce"

    def construct(self, x):
        self._count_forward()
        return self.all_reduce(x)

    def bprop(self, x, out, dout):
        self.bwd_calls += 1
        return (dout,)


class GatherFromTP(TPComm):
    """Forward AllGather along ``dim``; backward depends on who consumes the gathered tensor.

    ``grad="reduce_scatter"`` (column-parallel input): every rank's gradient of the
    gathered tensor is a partial sum (its weight shard only), so backward is
    AllReduce + own slice, i.e. ReduceScatter. ``grad="split"`` (replicated
    consumer, e.g. the output layer): every rank holds the full gradient,
    backward takes the own slice without communication.
    """

    fwd_collective = "AllGather"

    def __init__(self, tp_rank=0, tp_size=1, dim=1, group=None, grad="reduce_scatter"):
        super().__init__(tp_rank, tp_size, dim, group)
        if grad not in ("reduce_scatter", "split"):
            raise ValueError(f"grad must be 'reduce_scatter' or 'split', got {grad!r}")
        self.grad_mode = grad
        self.bwd_collective = "AllReduce" if grad == "reduce_scatter" else None

    def construct(self, x):
        self._count_forward()
        return self.all_gather(x)

    def bprop(self, x, out, dout):
        self.bwd_calls += 1
        if self.grad_mode == "reduce_scatter":
            dout = self.all_reduce(dout)
        return (self.own_slice(dout),)


class ScatterToTP(TPComm):
    """Split a replicated tensor along ``dim``: forward own slice, backward AllGather."""

    bwd_collective = "AllGather"

    def construct(self, x):
        self._count_forward()
        return self.own_slice(x)

    def bprop(self, x, out, dout):
        self.bwd_calls += 1
        return (self.all_gather(dout),)


class ReduceScatterToTP(TPComm):
    """Forward ReduceScatter along ``dim`` (AllReduce + own slice on CPU), backward AllGather."""

    fwd_collective = "AllReduce"
    bwd_collective = "AllGather"

    def construct(self, x):
        self._count_forward()
        return self.own_slice(self.all_reduce(x))

    def bprop(self, x, out, dout):
        self.bwd_calls += 1
        return (self.all_gather(dout),)


# --------------------------------------------------------------------------- parallel linears

SEQ_DIM = 1  # activations are (batch, seq, hidden)


class ColumnParallelLinear(mint.nn.Linear):
    """``y = x @ W[rows of rank].T + b[rows of rank]``: output features split over ranks.

    ``partition_groups``: the output is ``groups`` stacked blocks (q, k, v for
    ``linear_qkv``), each split separately so a rank owns whole heads of each.
    Input comm (in ``self._comm_ops``): ``all_gather`` along the sequence with
    sequence parallelism, else ``copy_to_tp``.
    """

    def __init__(self, in_features, out_features, *, tp_rank=0, tp_size=1, sequence_parallel=True,
                 partition_groups=1, group=None):
        if out_features % (tp_size * partition_groups):
            raise ValueError(f"out_features {out_features} not divisible by tp {tp_size} x "
                             f"groups {partition_groups}")
        super().__init__(in_features, out_features // tp_size)
        self.tp_rank, self.tp_size, self.partition_groups = tp_rank, tp_size, partition_groups
        self.full_out_features = out_features
        if sequence_parallel:
            self.input_comm = "all_gather"
            comm = GatherFromTP(tp_rank, tp_size, SEQ_DIM, group, grad="reduce_scatter")
        else:
            self.input_comm = "copy_to_tp"
            comm = CopyToTP(tp_rank, tp_size, -1, group)
        self._comm_ops = {self.input_comm: comm}

    def construct(self, x):
        return super().construct(self._comm_ops[self.input_comm](x))

    def shard(self, full, attr):
        """This rank's slice of the full ``weight`` (out, in) or ``bias`` (out,) array."""
        g, k = self.partition_groups, self.full_out_features // (self.partition_groups * self.tp_size)
        blocks = full.reshape((g, -1) + full.shape[1:])
        return blocks[:, self.tp_rank * k:(self.tp_rank + 1) * k].reshape((-1,) + full.shape[1:])

    def unshard(self, shards, attr):
        """Full array from every rank's slice (rank order)."""
        g = self.partition_groups
        blocks = [s.reshape((g, -1) + s.shape[1:]) for s in shards]
        full = np.concatenate(blocks, axis=1)
        return full.reshape((-1,) + full.shape[2:])


class RowParallelLinear(mint.nn.Linear):
    """``y = reduce(x_local @ W[:, cols of rank].T) + b``: input features split over ranks.

    Output comm (in ``self._comm_ops``): ``reduce_scatter`` along the sequence
    with sequence parallelism, else ``all_reduce``. The bias is added once,
    after the reduction.
    """

    def __init__(self, in_features, out_features, *, tp_rank=0, tp_size=1, sequence_parallel=True,
                 group=None):
        if in_features % tp_size:
            raise ValueError(f"in_features {in_features} not divisible by tp {tp_size}")
        super().__init__(in_features // tp_size, out_features)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if sequence_parallel:
            self.output_comm = "reduce_scatter"
            comm = ReduceScatterToTP(tp_rank, tp_size, SEQ_DIM, group)
        else:
            self.output_comm = "all_reduce"
            comm = ReduceFromTP(tp_rank, tp_size, -1, group)
        self._comm_ops = {self.output_comm: comm}

    def construct(self, x):
        y = self.dense(x, self.weight)
        return self._comm_ops[self.output_comm](y) + self.bias

    def shard(self, full, attr):
        if attr == "bias":
            return full
        k = full.shape[1] // self.tp_size
        return full[:, self.tp_rank * k:(self.tp_rank + 1) * k]

    def unshard(self, shards, attr):
        return shards[0] if attr == "bias" else np.concatenate(shards, axis=1)


# --------------------------------------------------------------------------- TP model (models.py subclasses)

def _tp_kwargs(tp):
    return dict(tp_rank=tp["rank"], tp_size=tp["size"], sequence_parallel=tp["sp"], group=tp["group"])


class TPSelfAttention(SelfAttention):
    """``SelfAttention`` with this rank's heads: column-parallel qkv, row-parallel proj."""

    def __init__(self, config, tp, seeds):
        super().__init__(config, seeds)
        h = config.hidden_size
        if config.num_heads % tp["size"]:
            raise ValueError(f"num_heads {config.num_heads} not divisible by tp {tp['size']}")
        self.head_dim = h // config.num_heads
        self.num_heads = config.num_heads // tp["size"]
        self.linear_qkv = ColumnParallelLinear(h, 3 * h, partition_groups=3, **_tp_kwargs(tp))
        self.linear_proj = RowParallelLinear(h, h, **_tp_kwargs(tp))

    def construct(self, x, attention_mask):
        qkv = self.linear_qkv(x)  # (b, s, 3 * local_heads * head_dim), full sequence
        b, s, _ = qkv.shape
        qkv = qkv.reshape(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        context = self.core_attention(qkv[0], qkv[1], qkv[2], attention_mask)
        return self.linear_proj(context.permute(0, 2, 1, 3).reshape(b, s, self.num_heads * self.head_dim))


class TPMLP(MLP):
    """``MLP`` with column-parallel ``linear_fc1`` and row-parallel ``linear_fc2``."""

    def __init__(self, config, tp):
        super().__init__(config)
        h, f = config.hidden_size, config.ffn_ratio * config.hidden_size
        self.linear_fc1 = ColumnParallelLinear(h, f, **_tp_kwargs(tp))
        self.linear_fc2 = RowParallelLinear(f, h, **_tp_kwargs(tp))


class TPTransformerLayer(TransformerLayer):
    def __init__(self, config, layer_number, tp, seeds):
        super().__init__(config, layer_number, seeds)
        self.self_attention = TPSelfAttention(config, tp, seeds)
        self.mlp = TPMLP(config, tp)


class TPTransformerBlock(TransformerBlock):
    def __init__(self, config, tp, seeds):
        super().__init__(config, seeds)
        self.layers = nn.CellList([TPTransformerLayer(config, i, tp, seeds) for i in range(config.num_layers)])


class TPGPTModel(GPTModel):
    """``GPTModel`` whose decoder layers are tensor parallel (see the module docstring)."""

    def __init__(self, config, tp_rank=0, tp_size=1, sequence_parallel=True, group=None, seed=0):
        super().__init__(config, seed)
        if sequence_parallel and config.seq_length % tp_size:
            raise ValueError(f"seq_length {config.seq_length} not divisible by tp {tp_size}")
        tp = {"rank": tp_rank, "size": tp_size, "sp": sequence_parallel, "group": group}
        self.tp_rank, self.tp_size, self.sequence_parallel, self.group = tp_rank, tp_size, sequence_parallel, group
        self.decoder = TPTransformerBlock(config, tp, self.dropout_seeds)
        self._comm_ops = {}
        if sequence_parallel:
            self._comm_ops = {"scatter": ScatterToTP(tp_rank, tp_size, SEQ_DIM, group),
                              "all_gather": GatherFromTP(tp_rank, tp_size, SEQ_DIM, group, grad="split")}
        self.grad_sync_calls = 0
        # Comm cells by path, fixed at build time: apply_ac may later put wrappers into the
        # ``_comm_ops`` slots; counting goes to the cells themselves.
        self._tp_comm_index = dict(registry_cells(self))

    def construct(self, tokens, labels):
        self.dropout_seeds.step += 1   # as GPTModel: one dropout step per forward
        s = tokens.shape[1]
        hidden = self.embedding(tokens)
        if self.sequence_parallel:
            hidden = self._comm_ops["scatter"](hidden)
        hidden = self.decoder(hidden, self.attention_mask[:, :, :s, :s])
        if self.sequence_parallel:
            hidden = self._comm_ops["all_gather"](hidden)
        logits = self.output_layer(hidden)
        return self.loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def sequence_parallel_param_names(self):
        """Parameters whose gradient is a per-shard partial sum under sequence parallelism."""
        if not self.sequence_parallel:
            return []
        names = []
        for path, cell in self.decoder.cells_and_names(name_prefix="decoder"):
            if isinstance(cell, nn.LayerNorm):
                names += [p.name for p in cell.get_parameters(expand=False)]
            elif isinstance(cell, RowParallelLinear):
                names.append(cell.bias.name)
        return names


# --------------------------------------------------------------------------- building, sharding, grads

def _owners(model):
    """Parameter name -> (owning cell, attribute name)."""
    owners = {}
    for _, cell in model.cells_and_names():
        for attr, param in cell.parameters_and_names(expand=False):
            owners[param.name] = (cell, attr.rsplit(".", 1)[-1])
    return owners


def shard_full_params(tp_model, full_model):
    """Copy ``full_model``'s parameters into ``tp_model``, sliced for this rank (matched by name)."""
    full = {p.name: p for p in full_model.get_parameters()}
    owners = _owners(tp_model)
    for param in tp_model.get_parameters():
        if param.name not in full:
            raise KeyError(f"{param.name} has no counterpart in the single-process model")
        value = full[param.name].asnumpy()
        cell, attr = owners[param.name]
        if isinstance(cell, (ColumnParallelLinear, RowParallelLinear)):
            value = cell.shard(value, attr)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{param.name}: shard shape {value.shape} != {param.shape}")
        param.set_data(Tensor(np.ascontiguousarray(value), param.dtype))
    return tp_model


def unshard_param(tp_model, name, shards):
    """Full array of parameter ``name`` from every rank's local arrays (rank order)."""
    cell, attr = _owners(tp_model)[name]
    if isinstance(cell, (ColumnParallelLinear, RowParallelLinear)):
        return cell.unshard(shards, attr)
    return shards[0]


def build_tp_gpt(tp, rank, config=None, seed=0, *, sequence_parallel=True, group=None, full_model=None, **dims):
    """A ``TPGPTModel`` for ``rank`` of ``tp``, weights sliced from ``models.build_gpt(config, seed, **dims)``.

    ``config`` and ``dims`` give the dimensions as in ``build_gpt``.
    ``full_model``: an already built ``build_gpt`` model with the same arguments
    (saves building it twice; it is read, not changed). After building, the
    same ``seed`` is set on every rank so dropout on replicated activations
    draws identical masks on all ranks.
    """
    config = gpt_config(config, **dims)
    if full_model is None:
        full_model = build_gpt(config, seed)
    model = TPGPTModel(config, tp_rank=rank, tp_size=tp, sequence_parallel=sequence_parallel, group=group,
                       seed=seed)
    shard_full_params(model, full_model)
    model.set_train(True)   # nn.Dropout is the identity outside training mode
    ms.set_seed(seed)
    np.random.seed(seed)
    return model


def sync_sequence_parallel_grads(model, params, grads):
    """AllReduce (one fused call) the gradients of the sequence-parallel parameters.

    ``params`` / ``grads``: matching sequences (e.g. ``model.trainable_params()``
    and the grads of ``ms.value_and_grad``). Returns a new tuple of grads.
    """
    names = set(model.sequence_parallel_param_names())
    idx = [i for i, p in enumerate(params) if p.name in names]
    if not idx or model.tp_size == 1:
        return tuple(grads)
    flat = ops.cat([grads[i].reshape(-1) for i in idx])
    reduce = ops.AllReduce() if model.group is None else ops.AllReduce(group=model.group)
    flat = reduce(flat)
    model.grad_sync_calls += 1
    out, offset = list(grads), 0
    for i in idx:
        n = int(np.prod(grads[i].shape))
        out[i] = flat[offset:offset + n].reshape(grads[i].shape)
        offset += n
    return tuple(out)


def comm_cells(model):
    """``[(path, comm_cell)]`` for every ``_comm_ops`` slot of ``model`` (``path.slot``), as built."""
    index = vars(model).get("_tp_comm_index")
    return list(index.items()) if isinstance(index, dict) else registry_cells(model)


def registry_cells(model):
    """``(path, op)`` for every collective in a ``_comm_ops`` registry under ``model`` (TP and EP comm cells)."""
    found = []
    for path, cell in model.cells_and_names():
        registry = vars(cell).get("_comm_ops")
        if isinstance(registry, dict):
            for slot, op in registry.items():
                found.append((f"{path}.{slot}" if path else slot, op))
    return found


def _base_comm(op):
    return op if isinstance(op, TPComm) else None


def reset_comm_counters(model):
    for _, op in comm_cells(model):
        base = _base_comm(op)
        if base is not None:
            base.fwd_calls = base.bwd_calls = base.recompute_calls = 0
    model.grad_sync_calls = 0


def collective_counts(model):
    """Counts since the last reset: per slot name and per primitive.

    ``forward`` / ``backward``: calls in the forward pass / bprops; ``recompute``
    (present only when non-zero): forward runs re-done in backward by
    ``recompute_comm`` (or a recomputed region holding the op).
    """
    per_slot, per_prim = {}, {"forward": {}, "backward": {}}
    for path, op in comm_cells(model):
        base = _base_comm(op)
        if base is None:
            continue
        slot = path.rsplit(".", 1)[-1]
        key = slot if "." in path else f"model.{slot}"
        entry = per_slot.setdefault(key, {"forward": 0, "backward": 0})
        entry["forward"] += base.fwd_calls
        entry["backward"] += base.bwd_calls
        if base.recompute_calls:
            entry["recompute"] = entry.get("recompute", 0) + base.recompute_calls
        if base.tp_size > 1:
            for direction, prim, calls in (("forward", base.fwd_collective, base.fwd_calls),
                                           ("backward", base.bwd_collective, base.bwd_calls),
                                           ("recompute", base.fwd_collective, base.recompute_calls)):
                if prim and calls:
                    per_prim.setdefault(direction, {})
                    per_prim[direction][prim] = per_prim[direction].get(prim, 0) + calls
    if getattr(model, "grad_sync_calls", 0):
        per_prim["grad_sync"] = {"AllReduce": model.grad_sync_calls}
    return {"per_slot": per_slot, "per_collective": per_prim}


def expected_collectives(num_layers, sequence_parallel=True):
    """Collectives one training step runs (tp > 1), as the layout above implies."""
    L = num_layers
    if sequence_parallel:
        return {"forward": {"AllGather": 2 * L + 1, "AllReduce": 2 * L},
                "backward": {"AllReduce": 2 * L, "AllGather": 2 * L + 1},
                "grad_sync": {"AllReduce": 1}}
    return {"forward": {"AllReduce": 2 * L}, "backward": {"AllReduce": 2 * L}}
