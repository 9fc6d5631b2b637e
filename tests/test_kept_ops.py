"""Kept means kept (issue 49, point 3): an op its policy keeps with MUST_SAVE (``exclude_op``) is never run
again, even when no backward reads its output and the region then keeps more than the model without AC;
that excess is reported (``RecomputeStats.kept_over_bytes``, a warning). Rule K2 (re-run unread kept ops
while the region keeps more than its forward saved) applies to PREFER_SAVE only.
"""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import mindformers_ac as mac
from mindformers_ac import CheckpointPolicy
from mindformers_ac.recompute import RecomputeStats, checkpoint_wrapper

from model_patterns import init_weights


def _grads(model, x):
    return [g.asnumpy() for g in ms.grad(lambda v: model(v), 0, model.trainable_params())(x)[1]]


def _same(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a, b))


# -- torchtitan tests/unit_tests/test_activation_checkpoint.py, TestApplyAC (test_flops, test_mem,
# test_correctness): gate -> wq -> output, the save list keeps gate's and output's matmuls, wq is recomputed:
# one matmul re-run in backward (flops 9 against 8 without AC), and the region keeps more than without AC
# ("SAC > no-AC here because it unnecessarily saves output").

class _Router(nn.Cell):
    def __init__(self):
        super().__init__()
        self.gate = nn.Dense(16, 16, has_bias=False)


class _Moe(nn.Cell):
    def __init__(self):
        super().__init__()
        self.router = _Router()


class _Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.wq = nn.Dense(16, 16, has_bias=False)


class TransformerBlock(nn.Cell):
    def __init__(self):
        super().__init__()
        self.moe, self.attention = _Moe(), _Attention()
        self.output = nn.Dense(16, 32, has_bias=False)

    def construct(self, x):
        return self.output(self.attention.wq(self.moe.router.gate(x))).sum()


def _save_gate_and_output(ctx, func, *args, **kwargs):
    saved = ctx.op_name.startswith("MatMul") and ctx.cell_path in ("moe.router.gate", "output")
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("policy, reruns", [(CheckpointPolicy.MUST_SAVE, 1), (CheckpointPolicy.PREFER_SAVE, 2)])
def test_torchtitan_selective_ac_saves_its_matmuls(policy, reruns, caplog):
    """MUST_SAVE: one matmul (wq's) re-run, output's kept although no backward reads it, its bytes reported.
    PREFER_SAVE: K2 re-runs output's matmul (unread) instead, and the region keeps no more than without AC."""
    def chosen(ctx, func, *args, **kwargs):
        kept = _save_gate_and_output(ctx, func, *args, **kwargs)
        return policy if kept is CheckpointPolicy.MUST_SAVE else kept

    x = Tensor(np.random.RandomState(0).randn(8, 16).astype(np.float32))
    base = _grads(init_weights(TransformerBlock()), x)
    model, stats = init_weights(TransformerBlock()), RecomputeStats()
    checkpoint_wrapper(model, policy_fn=chosen, stats=stats)
    with caplog.at_level(logging.WARNING, logger="mindformers_ac.recompute"):
        got = _grads(model, x)
    assert _same(base, got)
    matmuls = sum(n for name, n in stats.rerun_by_op.items() if name.startswith("MatMul"))
    assert matmuls == reruns, stats.rerun_by_op
    if policy is CheckpointPolicy.MUST_SAVE:
        assert stats.unread_kept == 0
        # kept: x, gate's and output's outputs (512 + 512 + 1024 bytes); saved without AC: x, gate's and wq's
        # outputs (3 x 512): output's (8, 32) float32 output, read by no backward, is the 512 bytes more
        assert stats.kept_over_bytes == 512, stats
        assert any("keeps 512 bytes more than the model keeps without AC" in r.getMessage() for r in caplog.records)
    else:
        assert stats.unread_kept == 1 and stats.kept_over_bytes == 0


# -- HyperParallel's adjacent-save case (tests/torch/activation_checkpoint/checkpoint_cases.py, as issue 49
# reports it): MUST_SAVE on two adjacent ops, Square and ReLU; neither may be re-run.

class _Adjacent(nn.Cell):
    """Square's output is read by no backward (ReLU's reads its own output): K2 re-ran it on main."""

    def __init__(self):
        super().__init__()
        self.w = ms.Parameter(Tensor(np.linspace(0.5, 1.5, 8).astype(np.float32)), name="w")

    def construct(self, x):
        return (ops.relu(ops.square(x)) * self.w).sum()


def _keep_square_and_relu(ctx, func, *args, **kwargs):
    kept = ctx.op_name in ("Square", "ReLU")
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("api", ["checkpoint_wrapper", "exclude_op"])
def test_hyperparallel_adjacent_must_save_ops_are_never_rerun(api):
    x = Tensor(np.random.RandomState(1).randn(4, 8).astype(np.float32))
    base = _grads(init_weights(_Adjacent()), x)
    model = init_weights(_Adjacent())
    if api == "checkpoint_wrapper":
        stats = RecomputeStats()
        checkpoint_wrapper(model, policy_fn=_keep_square_and_relu, stats=stats)
    else:
        stats = RecomputeStats()
        checkpoint_wrapper(model, policy_fn=mac.recompute.exclude_policy(["Square", "ReLU"]), stats=stats)
    for _ in range(2):   # the intercepted call, then the light one (exclude_op at keep sites)
        got = _grads(model, x)
        assert _same(base, got)
    assert not {"Square", "ReLU"} & set(stats.rerun_by_op), stats.rerun_by_op
    assert stats.unread_kept == 0 and stats.recompute_calls == 2
    assert stats.kept_over_bytes == 4 * 8 * 4   # Square's (4, 8) float32 output, kept as asked
