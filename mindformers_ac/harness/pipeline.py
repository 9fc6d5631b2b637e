"""``mindformers-ac train --pp 2 --microbatches M`` under msrun: the reference GPT as two pipeline stages.

The GPT is cut at half its layers: stage 0 (rank 0) holds the embedding and layers ``0..cut-1``, stage 1
(rank 1) layers ``cut..`` (its ``layer_start``), the final norm, the head and the loss, as MindFormers'
stage models do. Each step runs the M microbatches' forwards (``ms.vjp`` per stage and microbatch) before
their backwards, in reverse order (GPipe: the only order with several graphs in flight that MindSpore
2.10 runs; first-in-first-out backwards, which 1F1B needs, fail with ``Can not find top cell for
backward``). Activations go forward and gradients back with what CPU mccl has: ``Broadcast`` in the
2-rank group (it has no Send/Recv kernels). Each stage sums its gradients over the microbatches, then
takes one optimizer step.

Each rank trains its stage without and with AC (the config's global ids: each stage applies its own
layers), and compares the two runs bitwise: the microbatches' losses (stage 1 broadcasts them), every
gradient and every parameter. It also trains the unsplit model with gradient accumulation over the same
microbatches, summed in the pipeline's order, and says whether the pipeline without AC matches it.
Memory is measured over the whole step, so the per-layer peak is the peak with M microbatches in flight.
"""
import time

import mindspore as ms
from mindspore import nn, ops

from ..accounting import StepMeter
from ..apply import ac_state, apply_ac
from ..planner.stages import stage_layers
from .exactness import record_initial_state, record_step, tensor_digest
from .models import build_gpt

MAX_MICROBATCHES = 64


class FirstStage(nn.Cell):
    """The embedding and layers ``0..cut-1`` of ``gpt``; ``stage(tokens)`` returns the hidden states."""

    def __init__(self, gpt, cut):
        super().__init__()
        self.embedding, self.seeds, self.attention_mask = gpt.embedding, gpt.dropout_seeds, gpt.attention_mask
        self.layers = nn.CellList(list(gpt.decoder.layers)[:cut])
        self.layer_start, self.config = 0, gpt.config

    def construct(self, tokens):
        self.seeds.step += 1   # one dropout step per microbatch forward, as GPTModel's
        s = tokens.shape[1]
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, self.attention_mask[:, :, :s, :s])
        return x


class LastStage(nn.Cell):
    """Layers ``cut..`` of ``gpt``, its final norm, head and loss; ``stage(hidden, labels)`` returns the loss.

    ``count_steps``: this stage counts the dropout steps itself (it runs in a process of its own; in one
    process with the first stage, that one counts them for both).
    """

    def __init__(self, gpt, cut, count_steps=False):
        super().__init__()
        self.seeds, self.attention_mask, self.count_steps = gpt.dropout_seeds, gpt.attention_mask, count_steps
        self.layers = nn.CellList(list(gpt.decoder.layers)[cut:])
        self.final_layernorm, self.output_layer, self.loss = gpt.decoder.final_layernorm, gpt.output_layer, gpt.loss
        self.layer_start, self.config = cut, gpt.config

    def construct(self, x, labels):
        if self.count_steps:
            self.seeds.step += 1
        s = x.shape[1]
        for layer in self.layers:
            x = layer(x, self.attention_mask[:, :, :s, :s])
        logits = self.output_layer(self.final_layernorm(x))
        return self.loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def default_cut(num_layers):
    """Where two stages meet: the planner's stages (``planner.stages.stage_layers``; the first takes the
    odd layer)."""
    return stage_layers(num_layers, 2)[1][0]


def split_gpt(gpt, cut=None, own_process=False):
    """``(FirstStage, LastStage)`` of ``gpt``, cut at ``cut`` (default: ``default_cut``)."""
    cut = default_cut(gpt.config.num_layers) if cut is None else cut
    return FirstStage(gpt, cut), LastStage(gpt, cut, count_steps=own_process)


def summed(total, grads):
    return grads if total is None else tuple(a + b for a, b in zip(total, grads))


class BroadcastLink:
    """What stage ``rank`` sends and receives, with ``Broadcast`` in the 2-rank group: the sender's tensor is
    the root's; the receiver passes a buffer of the same shape and gets the sender's values."""

    def __init__(self, rank):
        self.rank = rank
        self._from = {0: ops.Broadcast(0), 1: ops.Broadcast(1)}

    def exchange(self, tensor, src):
        return self._from[src]((tensor,))[0]


class StageRun:
    """One stage trained in GPipe order: ``step(microbatches)`` runs every forward, then the backwards in
    reverse order, exchanging with the other stage through ``link``; returns
    ``(losses, grads, StepMemory, seconds)`` (``losses``: the microbatches' losses, on both stages)."""

    def __init__(self, stage, rank, link, config=None, lr=0.05, hidden_shape=None, reduce_grads=None,
                 budget_group=None):
        self.stage, self.rank, self.link, self.hidden_shape = stage, rank, link, hidden_shape
        self.reduce_grads = reduce_grads   # (params, grads) -> grads before the update: data parallel's average
        self.plan = apply_ac(stage, config=config, pp=2) if config else None
        budget = ac_state(stage).budget if self.plan is not None else None
        if budget is not None and budget_group is not None:
            budget.agree_within(budget_group)   # this stage's ranks across the replicas choose together
        self.optimizer = nn.SGD(stage.trainable_params(), learning_rate=lr)
        self.meter = StepMeter(stage)

    def step(self, microbatches):
        start = time.perf_counter()
        params, grads, losses, in_flight = self.optimizer.parameters, None, [], []
        with self.meter.step() as memory:
            for tokens, labels in microbatches:
                if self.rank == 0:
                    hidden, back = ms.vjp(lambda t: self.stage(t), tokens, weights=params)
                    self.link.exchange(hidden, src=0)
                else:
                    received = self.link.exchange(ops.zeros(self.hidden_shape, ms.float32), src=0)
                    loss, back = ms.vjp(lambda x, labels=labels: self.stage(x, labels), received, weights=params)
                    losses.append(loss)
                in_flight.append(back)
            for back in reversed(in_flight):
                if self.rank == 1:
                    (sent,), g = back(ms.Tensor(1.0, ms.float32))
                    self.link.exchange(sent, src=1)
                else:
                    _, g = back(self.link.exchange(ops.zeros(self.hidden_shape, ms.float32), src=1))
                grads = summed(grads, g)
            del in_flight
        mine = ops.stack(losses) if losses else ops.zeros((len(microbatches),), ms.float32)
        losses = self.link.exchange(mine, src=1)
        if self.reduce_grads is not None:
            grads = self.reduce_grads(params, grads)
        self.optimizer(grads)
        return losses, grads, memory, time.perf_counter() - start


def run_stage(spec, config_path, label, rank, link, make_inputs=None, reduce_grads=None, on_stage=None,
              budget_group=None):
    """Train this rank's stage for ``spec.steps`` steps; the record ``harness.train.compare`` reads.

    ``rank`` is the stage; ``make_inputs`` (default: the spec's synthetic batches), ``reduce_grads`` and
    ``on_stage(stage)`` (called with the stage cell as built) are data parallel's: this pipeline's batches,
    the gradient average before the update, and the parameters the replicas compare; ``budget_group``: the
    communication group whose ranks choose a ``memory_budget`` plan with this one (the stage's replicas)."""
    from .process_memory import reset_hwm, vm_hwm
    gpt = build_gpt(spec.gpt, spec.seed)
    stage = split_gpt(gpt, own_process=True)[rank]
    if on_stage is not None:
        on_stage(stage)
    make_inputs = make_inputs or spec.synthetic_batches()
    hidden_shape = (spec.batch, spec.gpt.seq_length, spec.gpt.hidden_size)
    run = StageRun(stage, rank, link, config_path, spec.lr, hidden_shape, reduce_grads, budget_group)
    record = {"losses": [], "step_times": [], "memory": [], "collectives": []}
    record_initial_state(record, stage, [p.name for p in run.optimizer.parameters])
    reset_hwm()
    m = spec.microbatches
    for step in range(spec.steps):
        losses, grads, memory, seconds = run.step([make_inputs(step * m + k) for k in range(m)])
        record["losses"].append(float(losses.mean().asnumpy()))
        record_step(record, stage, losses, grads)
        record["step_times"].append(seconds)
        record["memory"].append(memory.as_dict())
    record["vm_hwm_bytes"] = vm_hwm()
    state = ac_state(stage)
    plan = state.plan if state is not None else None   # with memory_budget: the plan it chose
    record["plan"] = {str(i): lp.describe() for i, lp in plan.layers.items()} if plan else {}
    if state is not None and state.budget is not None:
        record["budget"] = state.budget.as_record()
    return record


def unsplit_record(spec, rank):
    """The unsplit model trained with gradient accumulation over the same microbatches (gradients summed in
    the pipeline's order, the last microbatch first): the digests of this rank's stage's share."""
    gpt = build_gpt(spec.gpt, spec.seed)
    view = build_gpt(spec.gpt, spec.seed)   # built alike: its stage says which parameters are the stage's
    position = {id(p): k for k, p in enumerate(view.get_parameters())}
    picks = [position[id(p)] for p in split_gpt(view, own_process=True)[rank].get_parameters()]
    params = list(gpt.get_parameters())
    optimizer = nn.SGD(gpt.trainable_params(), learning_rate=spec.lr)
    grad_fn = ms.value_and_grad(gpt, None, optimizer.parameters)
    trainable = {id(p): k for k, p in enumerate(optimizer.parameters)}
    grad_picks = [trainable[id(params[k])] for k in picks if id(params[k]) in trainable]
    make_inputs, m = spec.synthetic_batches(), spec.microbatches
    record = {"loss_digests": [], "grad_digests": [], "param_digests": []}
    for step in range(spec.steps):
        results = [grad_fn(*make_inputs(step * m + k)) for k in range(m)]
        grads = None
        for _, g in reversed(results):
            grads = summed(grads, g)
        optimizer(grads)
        record["loss_digests"].append(tensor_digest(ops.stack([loss for loss, _ in results])))
        record["grad_digests"].append([tensor_digest(grads[k]) for k in grad_picks])
        record["param_digests"].append([tensor_digest(params[k]) for k in picks])
    return record


def _unsplit_difference(pipeline, unsplit):
    """Where the pipeline without AC first differs from the unsplit model, in words; None when bitwise."""
    for step in range(len(unsplit["loss_digests"])):
        for kind in ("loss", "grad", "param"):
            if pipeline[f"{kind}_digests"][step] != unsplit[f"{kind}_digests"][step]:
                return {"step": step + 1, "what": {"grad": "gradient", "param": "parameter"}.get(kind, kind)}
    return None


def measure_stage_peaks(spec, config=None, microbatches=1, steps=2):
    """Both stages in this process, GPipe order, ``steps`` steps: each stage's peak kept bytes (the largest
    over the steps) with its ``microbatches`` in flight, with ``config`` applied to each (None: without AC).

    Stage 0 runs every microbatch's forward under its meter, then stage 1 (a GPipe order too), so each
    meter sees its own stage's tensors only; then stage 1's backwards, last microbatch first, then stage
    0's (one process runs backwards in the reverse order of all its forwards).
    """
    first, last = split_gpt(build_gpt(spec.gpt, spec.seed))
    stages = (first, last)
    if config:
        for stage in stages:
            apply_ac(stage, config=config, pp=2)
    meters = [StepMeter(stage) for stage in stages]
    opts = [nn.SGD(stage.trainable_params(), learning_rate=spec.lr) for stage in stages]
    make_inputs, peaks = spec.synthetic_batches(), [0, 0]
    for step in range(steps):
        batches = [make_inputs(step * microbatches + k) for k in range(microbatches)]
        with meters[0].step() as memory:
            sent = [ms.vjp(lambda t: first(t), tokens, weights=opts[0].parameters) for tokens, _ in batches]
        peaks[0] = max(peaks[0], memory.kept_bytes)
        with meters[1].step() as memory:
            done = [ms.vjp(lambda x, labels=labels: last(x, labels), hidden.copy(), weights=opts[1].parameters)
                    for (hidden, _), (_, labels) in zip(sent, batches)]
        peaks[1] = max(peaks[1], memory.kept_bytes)
        # backwards in the reverse order of every forward in this process: stage 1's, then stage 0's
        grads, received = [None, None], []
        for _, back_last in reversed(done):
            (dh,), g_last = back_last(ms.Tensor(1.0, ms.float32))
            grads[1] = summed(grads[1], g_last)
            received.append(dh)
        for (_, back_first), dh in zip(reversed(sent), received):
            grads[0] = summed(grads[0], back_first(dh)[1])
        del sent, done, received
        for opt, g in zip(opts, grads):
            opt(g)
    return peaks


def train_and_compare_pp(spec, config_path, comm=None):
    """Under msrun (2 ranks): this rank's stage without and with AC, and the unsplit model; ``(rank, result)``.

    ``comm``: ``(rank, world size)`` when communication is initialised already (several comparisons in one
    job); else it is initialised here.
    """
    from .tp import init_tp
    from .train import compare
    rank, world = comm if comm is not None else init_tp()
    if world != spec.pp:
        raise RuntimeError(f"--pp {spec.pp} but the job has {world} ranks: launch it with "
                           f"python -m mindformers_ac.harness.launch --nproc {spec.pp}")
    link = BroadcastLink(rank)
    baseline = run_stage(spec, None, "baseline", rank, link)
    ac = run_stage(spec, config_path, "with AC", rank, link)
    result = compare(spec, config_path, baseline, ac)
    unsplit = _unsplit_difference(baseline, unsplit_record(spec, rank))
    peaks = {"baseline": max(m["kept_bytes"] for m in baseline["memory"]),
             "ac": max(m["kept_bytes"] for m in ac["memory"])}
    cut = default_cut(spec.gpt.num_layers)
    layers = (0, cut - 1) if rank == 0 else (cut, spec.gpt.num_layers - 1)
    result["summary"]["pipeline"] = {
        "stage": rank, "stages": spec.pp, "layers": list(layers), "microbatches": spec.microbatches,
        "schedule": "GPipe", "peak_in_flight_bytes": peaks,
        "kept_per_microbatch_bytes": {k: v // spec.microbatches for k, v in peaks.items()},
        "unsplit_first_difference": unsplit, "unsplit_matches": unsplit is None}
    return rank, result
