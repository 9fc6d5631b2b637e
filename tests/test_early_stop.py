"""Early stop (issue 38, point 6): the re-run stops after the last op that left a dropped tensor.

PyTorch's non-reentrant checkpoint stops its recomputation once every tensor the backward needs is
rebuilt (``early_stop=True``, its default). Here: on the intercepting path (``checkpoint`` and
regions that stay intercepted); ``early_stop=False`` runs the whole function again. Ported from
HyperParallel's tests/torch/activation_checkpoint/checkpoint_cases.py,
TestCheckpoint.test_early_stop_controls_tail_execution (a tail recorded after the function's last op
runs once with early stop, twice without), plus a training loop that must stay bitwise.
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac

X = Tensor(np.array([0.3, -0.7, 1.1], np.float32))


@pytest.mark.parametrize("early_stop, tail_runs", [(True, 1), (False, 2)])
def test_early_stop_controls_tail_execution(early_stop, tail_runs):
    tail = []

    def fn(v):
        out = ops.cos(ops.sin(v)) * 2
        tail.append(None)   # after the last op: a re-run that stopped early does not get here
        return out

    stats = mac.RecomputeStats()
    got = ms.grad(lambda v: mac.checkpoint(fn, v, use_reentrant=False, early_stop=early_stop, stats=stats).sum())(X)
    expected = ms.grad(lambda v: (ops.cos(ops.sin(v)) * 2).sum())(X)
    assert np.array_equal(got.asnumpy(), expected.asnumpy())
    assert len(tail) == tail_runs
    assert stats.recompute_calls == 1 and stats.early_stops == (1 if early_stop else 0)


class Layer(nn.Cell):
    """LayerNorm (a legacy op: it saves inside its call) and nn.Dropout (rebuilt from its mask), then
    trailing ops that leave nothing for backward."""

    def __init__(self):
        super().__init__()
        self.up = mint.nn.Linear(16, 16)
        self.norm = nn.LayerNorm((16,))
        self.drop = nn.Dropout(p=0.1)
        self.down = mint.nn.Linear(16, 16)

    def construct(self, x):
        h = self.drop(ops.gelu(self.up(self.norm(x))))
        return x + self.down(h) + ops.tanh(x) * 0.5


def _train(wrap, stats=None, steps=4, layer_type=None, num_layers=3):
    ms.set_seed(3)
    layers = nn.CellList([(layer_type or Layer)() for _ in range(num_layers)])
    for i, p in enumerate(layers.trainable_params()):
        p.set_data(Tensor(np.random.RandomState(i).uniform(-0.3, 0.3, p.shape).astype(np.float32)))

    def forward(v):
        for layer in layers:
            v = wrap(layer, v, stats)
        return (v * v).mean()

    ms.set_seed(7)
    opt = nn.SGD(layers.trainable_params(), 0.1)
    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    history = []
    for step in range(steps):
        loss, grads = grad_fn(Tensor(np.random.RandomState(step).randn(4, 16).astype(np.float32)))
        opt(grads)
        history.append([loss.asnumpy().tobytes()] + [g.asnumpy().tobytes() for g in grads])
    return history


def test_early_stop_trains_bitwise_and_reruns_fewer_ops():
    expected = _train(lambda layer, v, stats: layer(v))
    early, whole = mac.RecomputeStats(), mac.RecomputeStats()
    assert _train(lambda layer, v, s: mac.checkpoint(layer, v, stats=s), early) == expected
    assert _train(lambda layer, v, s: mac.checkpoint(layer, v, early_stop=False, stats=s), whole) == expected
    assert early.recompute_calls == whole.recompute_calls == 12
    assert early.early_stops == 12 and whole.early_stops == 0
    assert early.ops_rerun < whole.ops_rerun   # the trailing tanh, mul and adds are not run again


def test_checkpoint_wrapper_passes_early_stop_to_its_regions():
    x = Tensor(np.random.RandomState(0).randn(4, 16).astype(np.float32))
    counts = {}
    for early_stop in (True, False):
        layer = Layer()
        stats = mac.RecomputeStats()
        # light_path=False: a policy-free wrapper leaves the intercepting path after its first call
        mac.checkpoint_wrapper(layer, early_stop=early_stop, light_path=False, stats=stats)
        for _ in range(2):
            ms.grad(lambda v, layer=layer: layer(v).sum())(x)
        counts[early_stop] = stats.early_stops
    assert counts == {True: 2, False: 0}


class ExpLayer(nn.Cell):
    """``exp`` as a Tensor method: an excluded op no keep site can hold keeps its region intercepted."""

    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(16, 16)

    def construct(self, x):
        h = ops.sin(self.fc(x).exp() * 0.1)
        return x + h * 0.5   # trailing ops that save nothing (the re-run may stop before them)


class ExpModel(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([ExpLayer() for _ in range(2)])
        for i, p in enumerate(self.trainable_params()):
            p.set_data(Tensor(np.random.RandomState(i).uniform(-0.3, 0.3, p.shape).astype(np.float32)))

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).mean()


@pytest.mark.parametrize("early_stop", [True, False])
def test_the_config_field_reaches_apply_acs_regions(early_stop):
    x = Tensor(np.random.RandomState(5).randn(4, 16).astype(np.float32))
    base = ExpModel()
    expected = ms.value_and_grad(base, None, base.trainable_params())(x)
    model = ExpModel()
    mac.apply_ac(model, config=mac.AcConfig.from_dict({"recompute": {
        "mode": "full", "full_recompute_layer": ["0-1"], "exclude_op": ["Exp"], "early_stop": early_stop}}))
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    for _ in range(3):
        loss, grads = grad_fn(x)
        assert loss.asnumpy().tobytes() == expected[0].asnumpy().tobytes()
        assert all(a.asnumpy().tobytes() == b.asnumpy().tobytes() for a, b in zip(grads, expected[1]))
    stats = list(mac.ac_state(model).recompute_stats.values())
    assert sum(s.light_calls for s in stats) == 0 and sum(s.recompute_calls for s in stats) == 6
    assert sum(s.early_stops for s in stats) == (4 if early_stop else 0)   # the first call checks, whole


class HalfTail(nn.Cell):
    """Runs under ``to_float(float16)``: ``Cell.__call__`` pushes that type on MindSpore's executor and pops it
    only when ``construct`` returns. Its ``sin`` makes the region's last save, so an early stop is due inside
    it; stopping there would leave the type pushed, and every later op in the process cast."""

    def __init__(self):
        super().__init__()
        self.to_float(ms.float16)

    def construct(self, h):
        return ops.sin(h) * 2


class TailLayer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(16, 16)
        self.tail = HalfTail()

    def construct(self, x):
        return x + self.tail(ops.tanh(self.fc(x))).astype(ms.float32)


def test_no_early_stop_inside_a_cell_that_pushed_executor_state():
    """A region whose cells push executor state in Cell.__call__ (a mixed-precision type; rule S1, decided once
    when the region is made, from the cells' attributes: nothing of MindSpore is wrapped) re-runs whole and
    trains bitwise; the same layer without the type stops early."""
    def train(layer_type, stats=None):
        wrap = (lambda layer, v, s: layer(v)) if stats is None else \
            (lambda layer, v, s: mac.checkpoint(layer, v, stats=s))
        return _train(wrap, stats, steps=3, layer_type=layer_type, num_layers=2)

    class PlainTail(TailLayer):
        def __init__(self):
            super().__init__()
            self.tail.to_float(ms.float32)
            self.tail.mixed_precision_type = None   # no type pushed at all

    half, plain = mac.RecomputeStats(), mac.RecomputeStats()
    assert train(TailLayer, half) == train(TailLayer)
    assert half.recompute_calls == 6 and half.early_stops == 0
    assert train(PlainTail, plain) == train(PlainTail)
    assert plain.recompute_calls == 6 and plain.early_stops == 6
