"""Gradients computed inside a checkpointed function's forward (issue 38, point 2).

Ported from PyTorch test/test_autograd.py, TestNestedCheckpoint.test_nested_checkpoint: its ``g``
computes two inner gradients inside the forward and does not use them; every way of wrapping it in
checkpoint (``c(g)``, ``c(c(g))``, under one or two grads) must give what ``g`` gives without
checkpoint. And from HyperParallel's tests/torch/activation_checkpoint/checkpoint_cases.py,
TestCheckpoint.test_grad_inside_forward_matches_regular_autograd, whose function uses its inner
gradient in its output. Saves made inside such an inner grad call belong to its own graph (its
backward runs before the region's forward ends), so the region keeps them as they are and
recomputes the rest. Higher-order gradients through a recomputed region, and PyTorch's whole
``TestNestedCheckpoint`` matrix: ``test_higher_order.py``.
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.recompute import get_checkpoint_stats

X = Tensor(np.array([0.3, -0.7, 1.1, 0.05], np.float32))


def f(x):
    return ops.sin(ops.exp(ops.sin(x)))


def g(x):
    ms.grad(lambda v: f(v).sum())(x)   # computed inside the forward, not used
    ms.grad(lambda v: f(v).sum())(x)
    return ops.sin(ops.exp(x))   # PyTorch's returns x.sin(): exp gives the region a tensor to rebuild


def uses_inner_grad(x):
    intermediate = ops.sin(x)
    return intermediate * ms.grad(lambda v: ops.sin(v).sum())(x)


def grad(fn):
    return lambda x: ms.grad(lambda v: fn(v).sum())(x)


def c(fn, stats=None):
    return lambda x: mac.checkpoint(fn, x, use_reentrant=False, stats=stats)


@pytest.mark.parametrize("fn", [g, uses_inner_grad], ids=["g", "uses_inner_grad"])
def test_inner_gradients_in_a_forward_train_exactly(fn):
    stats = mac.RecomputeStats()
    cases = [(grad(fn), grad(c(fn, stats))), (grad(fn), grad(c(c(fn), stats))), (fn, c(fn, stats))]
    for expected_fn, actual_fn in cases:
        assert np.array_equal(expected_fn(X).asnumpy(), actual_fn(X).asnumpy())
    assert stats.recompute_calls >= 1 and stats.ops_rerun > 0


class Block(nn.Cell):
    """A cell whose construct computes a gradient it does not use (a gradient-norm probe)."""

    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(4, 4)
        self.fc.weight.set_data(Tensor(np.linspace(-0.5, 0.5, 16, dtype=np.float32).reshape(4, 4)))
        self.fc.bias.set_data(Tensor(np.zeros(4, np.float32)))

    def construct(self, x):
        h = ops.tanh(self.fc(x))
        ms.grad(lambda v: (ops.exp(v) * v).sum())(h)
        return ops.sin(h) * h


def test_checkpoint_wrapper_keeps_such_a_cell_on_the_intercepting_path():
    x = Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
    plain = Block()
    expected = ms.grad(lambda v: plain(v).sum(), 0, plain.trainable_params())(x)
    block = mac.checkpoint_wrapper(Block())
    for _ in range(3):   # a light path would be taken from the second call on
        got = ms.grad(lambda v: block(v).sum(), 0, block.trainable_params())(x)
        assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(expected[1], got[1]))
    stats = get_checkpoint_stats(block)
    assert stats.light_calls == 0 and stats.intercepted_calls == 3 and stats.recompute_calls == 3
    assert "its function computes gradients inside its forward" in str(stats.as_dict())


def uses_vjp(x):
    """``ms.vjp`` inside the forward: its two halves are separate calls (``grad_func`` imported MindSpore's
    grad entry points by name), each counted as a grad call of the region's own function."""
    _, pullback = ms.vjp(lambda v: ops.sin(ops.exp(v)) * v, x)
    pullback(ops.ones_like(x))   # computed inside the forward, not used
    return ops.sin(ops.exp(x))


def test_a_vjp_inside_a_forward_trains_exactly():
    stats = mac.RecomputeStats()
    for expected_fn, actual_fn in [(grad(uses_vjp), grad(c(uses_vjp, stats))), (uses_vjp, c(uses_vjp, stats))]:
        assert np.array_equal(expected_fn(X).asnumpy(), actual_fn(X).asnumpy())
    assert stats.recompute_calls == 1 and stats.ops_rerun > 0
    wrapped = mac.checkpoint_wrapper(uses_vjp)
    for _ in range(3):   # its saves inside the vjp are the vjp's: it stays on the intercepting path
        assert np.array_equal(grad(uses_vjp)(X).asnumpy(), grad(wrapped)(X).asnumpy())
    wrapped_stats = get_checkpoint_stats(wrapped)
    assert wrapped_stats.light_calls == 0 and wrapped_stats.recompute_calls == 3
    assert "its function computes gradients inside its forward" in str(wrapped_stats.as_dict())
