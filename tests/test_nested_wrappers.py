"""checkpoint_wrapper and swap_wrapper one inside the other (issue 38, points 7 and 9).

On one cell or one function the two are refused, in either order. One inside
the other's cell tree composes exactly, and is warned once per pair (as
HyperParallel warns: its guide says not to nest wrappers), whichever was
wrapped first. Scenario ported from HyperParallel's
tests/torch/activation_checkpoint/test_activation_checkpoint_swap.py (a model
whose layers mix checkpoint_wrapper and swap_wrapper).
"""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.recompute import get_checkpoint_stats

D = 32


def _linear(seed):
    fc = mint.nn.Linear(D, D)
    rng = np.random.RandomState(seed)
    fc.weight.set_data(Tensor((rng.randn(D, D) * 0.1).astype(np.float32)))
    fc.bias.set_data(Tensor((rng.randn(D) * 0.1).astype(np.float32)))
    return fc


class Inner(nn.Cell):
    def __init__(self, seed):
        super().__init__()
        self.fc = _linear(seed)

    def construct(self, x):
        return ops.sin(ops.exp(self.fc(x))) * x


class Outer(nn.Cell):
    def __init__(self, seed):
        super().__init__()
        self.inner = Inner(seed)
        self.fc2 = _linear(seed + 50)

    def construct(self, x):
        return ops.tanh(self.fc2(self.inner(x))) * x


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([Outer(1), Outer(2)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).sum()


X = Tensor(np.random.RandomState(0).randn(8, D).astype(np.float32))


def _train(net, steps=2):
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(net, None, opt.parameters)
    history = []
    for _ in range(steps):
        loss, grads = grad_fn(X)
        opt(grads)
        history.append([loss.asnumpy().tobytes()] + [g.asnumpy().tobytes() for g in grads])
    return history


def _ckpt(cell):
    return mac.checkpoint_wrapper(cell)


def _swap(cell):
    return mac.swap_wrapper(cell)


NESTINGS = {   # name -> (outer wrapper, inner wrapper, wrap the outer first)
    "swap_around_checkpoint": (_swap, _ckpt, False),
    "swap_around_checkpoint_outer_first": (_swap, _ckpt, True),
    "checkpoint_around_swap": (_ckpt, _swap, False),
    "checkpoint_around_swap_outer_first": (_ckpt, _swap, True),
}


@pytest.mark.parametrize("name", sorted(NESTINGS))
def test_nested_wrappers_compose_exactly_and_are_warned_once(name, caplog, fresh_swap_manager):
    outer_wrap, inner_wrap, outer_first = NESTINGS[name]
    expected = _train(Net())
    net = Net()
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        for layer in net.layers:
            if outer_first:
                outer_wrap(layer)
                inner_wrap(layer.inner)
            else:
                inner_wrap(layer.inner)
                outer_wrap(layer)
        assert _train(net) == expected
    warned = [r.getMessage() for r in caplog.records if "sub-cell 'inner'" in r.getMessage()]
    assert len(warned) == 2, warned   # once per pair: one per layer, not per call
    outer_kind, inner_kind = ("swap_wrapper", "checkpoint_wrapper") if outer_wrap is _swap else \
        ("checkpoint_wrapper", "swap_wrapper")
    assert f"Outer is wrapped by {outer_kind} and its sub-cell 'inner' (Inner) by {inner_kind}" in warned[0]
    # both acted
    recomputed = get_checkpoint_stats(net.layers[0] if outer_wrap is _ckpt else net.layers[0].inner)
    assert recomputed.recompute_calls > 0
    assert mac.SwapManager().report.as_dict()["offloaded_bytes"] > 0


@pytest.mark.parametrize("wrap", [_ckpt, _swap])
def test_the_same_kind_nested_is_not_warned(wrap, caplog, fresh_swap_manager):
    net = Net()
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        for layer in net.layers:
            wrap(layer.inner)
            wrap(layer)
        _train(net, steps=1)
    assert not [r for r in caplog.records if "sub-cell" in r.getMessage()]


@pytest.mark.parametrize("first, second", [(mac.swap_wrapper, mac.checkpoint_wrapper),
                                           (mac.checkpoint_wrapper, mac.swap_wrapper)])
def test_one_function_wrapped_by_both_is_refused(first, second):
    def block(x):
        return ops.sin(x)
    with pytest.raises(ValueError, match=f"block is already wrapped by {first.__name__}: {second.__name__} and "
                                         f"{first.__name__} can't wrap the same function"):
        second(first(block))
