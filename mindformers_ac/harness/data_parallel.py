"""``mindformers-ac train --dp N`` (alone, with ``--tp 2`` or with ``--pp 2``) under msrun: data parallel
with MindSpore's own reducer.

MindSpore 2.10's ``DistributedDataParallel`` has no CPU kernels (``scripts/probe_ddp.py``, docs/distributed.md);
its older data-parallel path does run here: ``ms.set_auto_parallel_context(parallel_mode=DATA_PARALLEL,
gradients_mean=True, device_num=<ranks>)`` then ``nn.DistributedGradReducer(params, mean=True, degree=dp,
group=...)`` on the gradients of a PyNative ``value_and_grad`` step, before the optimizer. The AC library
needs nothing for it: the reducer averages gradients that AC computed bitwise (``tests/test_data_parallel.py``).

Layout, in MindFormers' parallel config terms (``data_parallel`` x ``model_parallel`` or x ``pipeline_stage``):
``rank = d * inner + i`` with ``d`` the data-parallel rank and ``i`` the rank inside the model-parallel group
(tensor parallel) or the stage (pipeline); the model-parallel group (or the pipeline) is ranks
``d * inner .. d * inner + inner - 1``, the data-parallel group ranks ``i, inner + i, ...``. Data-parallel rank
``d`` trains on the synthetic batches of seed ``seed + 1000 * d`` (the TP ranks of one group, and the stages
of one pipeline, on the same ones).

What CPU mccl has decides the rest (measured, 4 ranks): ``AllReduce`` runs in any group (the reducer in the
data-parallel group, tensor parallel's all-reduces in its group), ``AllGather`` and ``Broadcast`` only in
the world group ("AllGather only support mccl_world_group on CPU"). So tensor parallel runs without
sequence parallelism (its all-gathers would need the world group), and the pipeline's link between the
stages (``harness.pipeline.BroadcastLink``, a world Broadcast with 2 ranks) is an ``AllGather`` of the world
group from which each stage takes its own pipeline's sender (``WorldGatherLink``).

Each rank trains its slice without and with AC (the same data-parallel run twice), compares the two bitwise
(loss, every averaged gradient, every parameter, every step) and reports its own memory. It also checks
what makes it data parallel: the averaged gradients differ from the rank's local ones, and at the end the
replicas of every data-parallel group (the same TP slice, or the same stage) hold bitwise the same parameters.
"""
from dataclasses import dataclass

DP_DATA_STRIDE = 1000   # data-parallel rank d trains on the synthetic batches of seed ``seed + DP_DATA_STRIDE * d``


@dataclass(frozen=True)
class DataParallelLayout:
    """Where this rank sits: ``dp`` replicas of a model-parallel unit of ``inner`` ranks (TP group or pipeline)."""

    rank: int
    dp: int
    inner: int

    @property
    def world(self):
        return self.dp * self.inner

    @property
    def dp_rank(self):
        return self.rank // self.inner

    @property
    def inner_rank(self):
        return self.rank % self.inner

    @property
    def dp_ranks(self):
        return [d * self.inner + self.inner_rank for d in range(self.dp)]

    @property
    def inner_ranks(self):
        return [self.dp_rank * self.inner + i for i in range(self.inner)]

    @property
    def dp_group(self):
        """The data-parallel group's name (None: the world group)."""
        return None if self.inner == 1 else f"dp_group_{self.inner_rank}"

    @property
    def inner_group(self):
        """The model-parallel group's name (None: the world group, or no such group)."""
        return None if self.dp == 1 or self.inner == 1 else f"mp_group_{self.dp_rank}"

    def describe(self, inner_kind):
        text = f"data-parallel rank {self.dp_rank} of {self.dp}"
        if self.inner > 1:
            text += f", {inner_kind} rank {self.inner_rank} of {self.inner}"
        return f"rank {self.rank} of {self.world} ({text})"


def init_data_parallel(world_expected):
    """MindSpore's data-parallel context for ``world_expected`` ranks, then ``init()``; ``(rank, world)``."""
    import mindspore as ms

    from .tp import init_tp
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=world_expected)
    return init_tp()


def create_groups(layout):
    """The communication groups of ``layout`` this rank belongs to (only its own: mccl builds a group from its
    members' calls)."""
    from mindspore.communication import create_group
    if layout.dp_group is not None:
        create_group(layout.dp_group, layout.dp_ranks)
    if layout.inner_group is not None:
        create_group(layout.inner_group, layout.inner_ranks)


class GradientAverage:
    """``reduce_grads(params, grads)`` for ``run_variant`` / ``run_stage``: MindSpore's
    ``nn.DistributedGradReducer`` (mean over the data-parallel group), built on the first call from the
    optimizer's parameters (the model's, AC applied or not). ``differs_from_local``: whether the first step's
    averaged gradients differ from this rank's own (they must: each rank trains on its own batches)."""

    def __init__(self, layout):
        self.layout = layout
        self.reducer = None
        self.differs_from_local = None

    def __call__(self, params, grads):
        from mindspore import nn
        from mindspore.communication import GlobalComm
        if self.reducer is None:
            group = self.layout.dp_group or GlobalComm.WORLD_COMM_GROUP
            self.reducer = nn.DistributedGradReducer(params, mean=True, degree=self.layout.dp, group=group)
        averaged = self.reducer(tuple(grads))
        if self.differs_from_local is None:
            self.differs_from_local = any(a.asnumpy().tobytes() != g.asnumpy().tobytes()
                                          for a, g in zip(averaged, grads))
        return averaged


class WorldGatherLink:
    """The pipeline's link between the stages of one data-parallel replica, as ``pipeline.BroadcastLink``:
    ``exchange(tensor, src)`` returns what stage ``src`` of this rank's pipeline passed. CPU mccl runs
    ``AllGather`` in the world group only: every rank passes a tensor of the same shape (the sender its
    own, the receiver a buffer), all pipelines exchange at once, each takes its sender's block, bit for bit."""

    def __init__(self, layout):
        from mindspore import ops
        self.layout = layout
        self._gather = ops.AllGather()

    def exchange(self, tensor, src):
        gathered = self._gather(tensor)
        block = tensor.shape[0] if tensor.ndim else 1
        k = self.layout.dp_rank * self.layout.inner + src
        return gathered[k * block:(k + 1) * block] if tensor.ndim else gathered[k]


def replicas_identical(params, layout):
    """Whether every replica of this rank's data-parallel group holds bitwise the same ``params`` (a world
    ``AllGather`` of them all, compared block by block). Every rank calls it; the ranks' parameters may differ
    in size (pipeline stages): each rank's count goes round first (an ``AllReduce`` of one-hot counts) and
    every block is padded to the largest."""
    import mindspore as ms
    from mindspore import ops
    flat = ops.cat([p.reshape(-1) for p in params])
    counts = ops.zeros((layout.world,), ms.float32)
    counts[layout.rank] = float(flat.shape[0])
    counts = ops.AllReduce()(counts).asnumpy().astype(int)
    padded = ops.cat([flat, ops.zeros((int(counts.max()) - flat.shape[0],), flat.dtype)])
    gathered = ops.AllGather()(padded).asnumpy().reshape(layout.world, -1)
    mine = gathered[layout.rank].tobytes()
    return all(counts[r] == counts[layout.rank] and gathered[r].tobytes() == mine for r in layout.dp_ranks)


def dp_batches(spec, layout):
    """The synthetic batches of this rank's data-parallel replica."""
    from .models import SyntheticBatches
    return SyntheticBatches(spec.batch, spec.gpt.seq_length, spec.gpt.vocab_size,
                            spec.seed + DP_DATA_STRIDE * layout.dp_rank)


def _dp_model(spec, layout):
    if spec.tp > 1:   # tensor parallel inside the replica, without sequence parallelism (module docstring)
        from .tp import build_tp_gpt
        return build_tp_gpt(spec.tp, layout.inner_rank, spec.gpt, spec.seed, sequence_parallel=False,
                            group=layout.inner_group)
    from .models import build_gpt
    return build_gpt(spec.gpt, spec.seed)


def _one_run(spec, config_path, label, layout):
    """This rank's record of one data-parallel run (with ``config_path``, or without AC), and its checks."""
    average = GradientAverage(layout)
    if spec.pp > 1:
        from .pipeline import run_stage
        stages = []
        record = run_stage(spec, config_path, label, layout.inner_rank, WorldGatherLink(layout),
                           make_inputs=dp_batches(spec, layout), reduce_grads=average, on_stage=stages.append,
                           budget_group=layout.dp_group)
        params = list(stages[0].get_parameters())
    else:
        from .variant import run_variant
        model = _dp_model(spec, layout)
        record = run_variant(spec, config_path, label, layout.rank, show_progress=layout.rank == 0,
                             built=(model, dp_batches(spec, layout)), reduce_grads=average)
        params = list(model.get_parameters())
    return record, average, params


def train_and_compare_dp(spec, config_path, comm=None):
    """Under msrun with ``spec.dp * (spec.tp or spec.pp)`` ranks: this rank's data-parallel run without and with
    AC, compared; ``(rank, result)``. ``comm``: ``(rank, world size)`` when communication is initialised
    already (several comparisons in one job, with the data-parallel context set)."""
    from .train import compare
    inner = spec.tp if spec.tp > 1 else spec.pp
    rank, world = comm if comm is not None else init_data_parallel(spec.dp * inner)
    if world != spec.dp * inner:
        flags = f"--dp {spec.dp}" + (f" --tp {spec.tp}" if spec.tp > 1 else "") + \
            (f" --pp {spec.pp}" if spec.pp > 1 else "")
        raise RuntimeError(f"{flags} needs {spec.dp * inner} ranks but the job has {world}: launch it with "
                           f"python -m mindformers_ac.harness.launch --nproc {spec.dp * inner}")
    layout = DataParallelLayout(rank, spec.dp, inner)
    if comm is None:
        create_groups(layout)
    baseline, base_average, base_params = _one_run(spec, None, "baseline", layout)
    ac, ac_average, ac_params = _one_run(spec, config_path, "with AC", layout)
    result = compare(spec, config_path, baseline, ac)
    kind = "tensor-parallel" if spec.tp > 1 else "pipeline-stage"
    dp = {"rank": rank, "world": world, "data_parallel": spec.dp, "dp_rank": layout.dp_rank,
          "dp_group_ranks": layout.dp_ranks, "model_parallel": spec.tp, "pipeline_stage": spec.pp,
          "inner_rank": layout.inner_rank, "inner_group_ranks": layout.inner_ranks,
          "layout": layout.describe(kind), "reducer": "nn.DistributedGradReducer(mean=True)",
          "averaged_grads_differ_from_local": bool(base_average.differs_from_local and ac_average.differs_from_local)}
    dp["replicas_identical"] = bool(replicas_identical(base_params, layout) & replicas_identical(ac_params, layout))
    result["summary"]["data_parallel"] = dp
    if spec.pp > 1:
        peaks = {"baseline": max(m["kept_bytes"] for m in baseline["memory"]),
                 "ac": max(m["kept_bytes"] for m in ac["memory"])}
        from .pipeline import default_cut
        cut = default_cut(spec.gpt.num_layers)
        stage = layout.inner_rank
        layers = (0, cut - 1) if stage == 0 else (cut, spec.gpt.num_layers - 1)
        result["summary"]["pipeline"] = {
            "stage": stage, "stages": spec.pp, "layers": list(layers), "microbatches": spec.microbatches,
            "schedule": "GPipe", "peak_in_flight_bytes": peaks,
            "kept_per_microbatch_bytes": {k: v // spec.microbatches for k, v in peaks.items()},
            "unsplit_first_difference": None, "unsplit_matches": None}
    if spec.tp > 1:
        result["summary"]["collectives_per_step"] = {"baseline": baseline["collectives"][-1],
                                                     "ac": ac["collectives"][-1]}
    return rank, result


def data_parallel_lines(dp):
    """The report's lines for ``summary["data_parallel"]``."""
    if not dp:
        return []
    lines = [f"data parallel: {dp['layout']}; data_parallel {dp['data_parallel']}, model_parallel "
             f"{dp['model_parallel']}, pipeline_stage {dp['pipeline_stage']}; gradients averaged over ranks "
             f"{dp['dp_group_ranks']} ({dp['reducer']}): they differ from this rank's own: "
             f"{'yes' if dp['averaged_grads_differ_from_local'] else 'NO'}"]
    if "replicas_identical" in dp:
        lines.append(f"  replicas {dp['dp_group_ranks']} hold bitwise the same parameters after the last step: "
                     f"{'yes' if dp['replicas_identical'] else 'NO'}")
    return lines


__all__ = ["DP_DATA_STRIDE", "DataParallelLayout", "GradientAverage", "WorldGatherLink", "create_groups",
           "data_parallel_lines", "dp_batches", "init_data_parallel", "replicas_identical", "train_and_compare_dp"]
