"""MindFormers 2.1.0's collective registry as it is, under ``exclude_op`` and ``recompute_comm``.

``register_comm_op`` fills ``module._comm_ops`` with ``{'fn': fn, 'domain': d}`` dicts under dotted slot
names, and ``RowwiseParallel`` / ``ColwiseParallel`` call them through ``_call_comm_op`` from a forward
(pre-)hook of the linear (``mindformers_standin``, in MindFormers' shape). Each test trains a 2-layer model
for 3 steps against the same model without AC, bitwise, and counts the collectives that really ran in the
last step (an outer ``MsDispatchMode``: the stand-in all-reduce is the model's only ``Identity``, the stand-in
all-gather its only ``Concat``).
"""
from typing import NamedTuple

import mindformers_standin as mf
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.accounting import StepMeter
from mindformers_ac.errors import ConfigError
from mindformers_ac.harness.cli import main

from model_patterns import init_weights
from steps import CountOps

H, S, B, STEPS = 16, 4, 2, 3
SLOTS = {".*linear_proj.output.allreduce": [0, 1], ".*linear_fc1.input.allgather": [0, 1]}


class Collectives(NamedTuple):
    """The all-reduce and the sequence all-gather the model's registry slots run, and their op names."""

    all_reduce: object
    all_gather: object
    all_reduce_op: str
    all_gather_op: str
    rank: int = 0


ONE_PROCESS = Collectives(mf.single_process_all_reduce, mf.two_rank_all_gather, "Identity", "Concat")


def on_two_ranks():
    """The real collectives of a 2-rank job (``init`` done): MindFormers' all-reduce and all-gather."""
    from mindspore.communication import get_rank
    all_reduce, all_gather = ops.AllReduce(), ops.AllGather()
    return Collectives(lambda t: (all_reduce(t), None), all_gather, "AllReduce", "AllGather", get_rank())


class SelfAttention(nn.Cell):
    def __init__(self, comm):
        super().__init__()
        self.linear_proj = mf.rowwise_parallel(mint.nn.Linear(H, H), comm.all_reduce)

    def construct(self, x):
        return self.linear_proj(ops.tanh(x))


class MLP(nn.Cell):
    """fc1 gathers the sequence-sharded input (a group of two ranks holding the same shard)."""

    def __init__(self, comm):
        super().__init__()
        self.linear_fc1 = mf.colwise_parallel(mint.nn.Linear(H, H), comm.all_gather, comm.rank)
        self.linear_fc2 = mint.nn.Linear(H, H)

    def construct(self, x):
        return self.linear_fc2(mint.nn.functional.silu(self.linear_fc1(x)))[:S]


class Layer(nn.Cell):
    def __init__(self, comm):
        super().__init__()
        self.self_attention = SelfAttention(comm)
        self.mlp = MLP(comm)

    def construct(self, x):
        h = x + mint.nn.functional.silu(self.self_attention(x))   # silu saves the all-reduce's output
        return h + self.mlp(h)


class Model(nn.Cell):
    def __init__(self, comm=ONE_PROCESS):
        super().__init__()
        self.layers = nn.CellList([Layer(comm) for _ in range(2)])

    def construct(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x.sum(-1) - y) ** 2).mean()



def _batch(step):
    rng = np.random.RandomState(step)
    return Tensor(rng.randn(S, B, H).astype(np.float32)), Tensor(rng.randn(S, B).astype(np.float32))


def train(config=None, comm=ONE_PROCESS):
    """(per step: loss and grads as bytes; per step: layer 0's kept bytes; last step's collective counts)."""
    model = init_weights(Model(comm))
    if config is not None:
        mac.apply_ac(model, config=config)
    grad_fn, meter = ms.value_and_grad(model, None, model.trainable_params()), StepMeter(model)
    history, kept, counter = [], [], CountOps()
    for step in range(STEPS):
        with meter.step() as figures:
            if step == STEPS - 1:
                with counter:
                    loss, grads = grad_fn(*_batch(step))
            else:
                loss, grads = grad_fn(*_batch(step))
        history.append([loss.asnumpy().tobytes()] + [g.asnumpy().tobytes() for g in grads])
        kept.append(figures.layers[0].kept_bytes)
    counts = counter.counts
    return history, kept, {"allreduce": counts[comm.all_reduce_op], "allgather": counts[comm.all_gather_op]}


FULL = {"mode": "full", "full_recompute_layer": [0, 1]}
COMM = {"recompute_comm": {"enable": True, "select_module": {".*linear_fc1.input.allgather": [0, 1]}}}


def registry_results(comm):
    """What the tests below check, for a job of several ranks (``parallel_worker.py tp``): bitwise against no
    AC, kept bytes of layer 0 per step, and the collectives run in the last step, per mode."""
    runs = {"none": train(None, comm), "full": train({"recompute": FULL}, comm),
            "exclude": train({"recompute": {**FULL, "exclude_op": SLOTS}}, comm), "comm": train(COMM, comm)}
    return {mode: {"bitwise": history == runs["none"][0], "kept": kept, "counts": counts}
            for mode, (history, kept, counts) in runs.items()}


@pytest.fixture(scope="module")
def plain():
    return train()


@pytest.fixture(scope="module")
def full():
    return train({"recompute": FULL})


def test_exclude_op_keeps_mindformers_registry_collectives(plain, full):
    """The slots' outputs are kept (more than plain full keeps, the same every step) and their collectives
    run once, in forward, as without AC."""
    history, kept, counts = train({"recompute": {**FULL, "exclude_op": SLOTS}})
    assert history == plain[0] == full[0]
    assert counts == plain[2] == {"allreduce": 2, "allgather": 2}
    assert full[2] == {"allreduce": 4, "allgather": 4}
    assert kept[0] > full[1][0] and len(set(kept)) == 1


def test_recompute_comm_reruns_mindformers_registry_collectives_bitwise(plain):
    """The all-gather's output (fc1's saved input, twice the gathered shard) is dropped and re-run."""
    history, kept, counts = train(COMM)
    assert history == plain[0]
    assert counts == {"allreduce": 2, "allgather": 4}
    assert kept[-1] < plain[1][-1]


@pytest.mark.parametrize("field", ["recompute_comm.select_module", "recompute.exclude_op"])
def test_a_registry_slot_without_a_callable_is_refused_naming_the_field(field):
    model = init_weights(Model())
    entry = model.layers[1].self_attention.linear_proj._comm_ops["output.allreduce"]
    entry["fn"] = "all_reduce"   # a name where the op should be
    section, key = field.split(".")
    config = {"recompute": FULL, section: {"enable": True, key: SLOTS}} if section == "recompute_comm" else \
        {"recompute": {**FULL, key: SLOTS}}
    with pytest.raises(ConfigError) as err:
        mac.apply_ac(model, config=config)
    assert str(err.value).startswith(f"{field}['.*linear_proj.output.allreduce']: ")
    assert "self_attention.linear_proj.output.allreduce in layer 1" in str(err.value)
    assert "_comm_ops['output.allreduce']['fn'] of Linear is str, expected a callable" in str(err.value)
    assert mac.ac_state(model) is None and entry["fn"] == "all_reduce"
    assert type(model.layers[0].self_attention.linear_proj._comm_ops["output.allreduce"]["fn"]).__name__ \
        == "function"


def test_a_list_form_exclude_op_name_that_matches_no_op_is_told_once(plain, full, caplog):
    """``FlashAttentionScore`` (no such op on CPU) keeps nothing: one warning naming it after the first step's
    forwards; ``tanh``, which matches, is not named."""
    with caplog.at_level("WARNING", logger="mindformers_ac"):
        history, kept, _ = train({"recompute": {**FULL, "exclude_op": ["FlashAttentionScore", "tanh"]}})
    told = [r.getMessage() for r in caplog.records if "matched no op" in r.getMessage()]
    assert history == plain[0]
    assert len(told) == 1 and told[0].startswith("recompute.exclude_op: 'FlashAttentionScore' matched no op")
    assert kept[0] > full[1][0]   # tanh's outputs are kept
    assert len(set(kept)) == 1    # ops.tanh is called by its global name: every step intercepted, the same bytes


# -- a select op target that saves nothing (issue 52): mindcv's ConvNeXt block, LayerNorm then the matmul ------

D = 8


class ConvNeXtBlock(nn.Cell):
    """mindcv's ConvNeXt ``Block``: depthwise conv, channels last, LayerNorm, pointwise Dense, GELU, Dense."""

    def __init__(self):
        super().__init__()
        self.dwconv = nn.Conv2d(D, D, kernel_size=3, group=D, has_bias=True, pad_mode="same")
        self.norm = nn.LayerNorm((D,), epsilon=1e-6)
        self.pwconv1 = nn.Dense(D, 4 * D)
        self.act = nn.GELU()
        self.pwconv2 = nn.Dense(4 * D, D)

    def construct(self, x):
        y = ops.transpose(self.dwconv(x), (0, 2, 3, 1))
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + ops.transpose(y, (0, 3, 1, 2))


class ConvNeXt(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([ConvNeXtBlock() for _ in range(2)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).sum()


def _convnext_steps(config=None):
    model = init_weights(ConvNeXt())
    if config is not None:
        mac.apply_ac(model, config=config)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    x = Tensor(np.random.RandomState(0).randn(2, D, 4, 4).astype(np.float32))
    return [[t.asnumpy().tobytes() for t in (loss, *grads)] for loss, grads in (grad_fn(x) for _ in range(STEPS))], model


def test_a_select_op_target_that_saves_nothing_is_taken_off_and_never_rerun(caplog):
    """``pwconv1.matmul``'s output is read by BiasAdd only (which saves nothing): its output recompute saves
    nothing, says so once, and is taken off after the first step: no call of it is re-run, and the layer's
    plan notes why; ``norm.layer_norm`` (whose output the matmul saves) is re-run every step."""
    config = {"recompute": {"mode": "select", "select_module": {"norm.layer_norm|pwconv1.matmul": [0, 1]}}}
    plain, _ = _convnext_steps()
    with caplog.at_level("WARNING", logger="mindformers_ac"):
        history, model = _convnext_steps(config)
    assert history == plain
    state = mac.ac_state(model)
    assert [dict(s.rerun_by_op) for s in state.recompute_stats.values()] == [{"LayerNorm.layer_norm": STEPS}] * 2
    told = [r.getMessage() for r in caplog.records if "saves nothing" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("output recompute of Dense.matmul saves nothing")
    for lp in state.plan.layers.values():
        assert lp.notes == (f"output recompute of op 'pwconv1.matmul' is not in effect: taken off after the first "
                            f"training step, nothing re-runs it ({told[0]})",)
    slot = model.layers[0].pwconv1.matmul
    assert slot.mac_output.retired == told[0]
    assert "Notes:\n  layer 0: output recompute of op 'pwconv1.matmul' is not in effect" in str(state.plan)


def convnext_model():
    """``(model, make_inputs)`` of the ConvNeXt above, for ``--model test_mindformers_comm_ops:convnext_model``."""
    x = Tensor(np.random.RandomState(0).randn(2, D, 4, 4).astype(np.float32))
    return init_weights(ConvNeXt()), lambda step: (x,)


def test_explain_step_shows_the_op_target_that_saves_nothing_taken_off(tmp_path, capsys):
    """``explain`` plans without a step, so it lists ``pwconv1.matmul`` as planned; ``explain --step`` runs one
    training step first and its notes say the target was taken off, as ``train``'s plan does; the model the
    command built is left without AC."""
    config = tmp_path / "convnext.yaml"
    config.write_text("recompute:\n  mode: select\n  select_module:\n    'norm.layer_norm|pwconv1.matmul': [0-1]\n")
    model = [str(config), "--model", "test_mindformers_comm_ops:convnext_model"]
    assert main(["explain", *model]) == 0
    assert "not in effect" not in capsys.readouterr().out
    assert main(["explain", *model, "--step"]) == 0
    out = capsys.readouterr().out
    assert "Notes:\n  layer 0: output recompute of op 'pwconv1.matmul' is not in effect: taken off after the " \
           "first training step" in out and "layer 1: output recompute of op 'pwconv1.matmul'" in out
    assert main(["explain", *model, "--step", "--pp", "2"]) == 2
    assert "error: --step: runs the whole model in this process; drop --pp" in capsys.readouterr().err
