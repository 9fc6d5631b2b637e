"""A NaN/Inf step decides no cached Dropout formula check (issue 29, point 7).

The check of whether a Dropout output rebuilds bitwise from its mask is cached
for the process per (dtype, keep_prob). A first step that overflowed (which a
loss scaler skips) must not cache a failure: later finite steps keep 1-bit
masks, nothing false is logged, and training is bitwise equal to the plain
model. Each run draws at most 3 launches per ``nn.Dropout`` (the CPU kernel is
reproducible for 5), and a plain control twin checks that the comparison
itself holds.
"""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import mindformers_ac as mac
from mindformers_ac.recompute.random_ops import DropoutFormulaCheck
from mindformers_ac.recompute.state import ENGINE

from steps import first_difference

HIDDEN, BATCH, LAYERS, STEPS = 64, 8, 2, 3
KEY = ("Float32", 0.9)


class Block(nn.Cell):
    def __init__(self, rng):
        super().__init__()
        self.dense1 = nn.Dense(HIDDEN, HIDDEN, weight_init=Tensor(rng.standard_normal((HIDDEN, HIDDEN),
                                                                                      np.float32) * 0.1))
        self.dense2 = nn.Dense(HIDDEN, HIDDEN, weight_init=Tensor(rng.standard_normal((HIDDEN, HIDDEN),
                                                                                      np.float32) * 0.1))
        self.dropout = nn.Dropout(p=0.1)

    def construct(self, x):
        return x + self.dense2(self.dropout(ops.tanh(self.dense1(x))))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        ms.set_seed(11)   # the same Dropout seeds in every twin
        rng = np.random.default_rng(0)
        self.layers = nn.CellList([Block(rng) for _ in range(LAYERS)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return ops.mean(ops.square(x))


def batch(step):
    x = np.random.default_rng(100 + step).standard_normal((BATCH, HIDDEN)).astype(np.float32)
    if step == 0:
        x[0, 3] = np.nan
        x[1, 5] = np.inf
    return Tensor(x)


def train(with_ac):
    """Per step: (loss bytes, gradient bytes, parameters) and the bytes the layers kept for backward.

    Step 0 overflows: its gradients are computed but not applied, as a loss scaler skips the step.
    """
    model = Net()
    model.set_train(True)
    stats = None
    if with_ac:
        stats = mac.RecomputeStats()
        for layer in model.layers:
            mac.checkpoint_wrapper(layer, stats=stats)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history, kept = [], []
    for step in range(STEPS):
        if stats is not None:
            stats.reset()
        loss, grads = grad_fn(batch(step))
        if step > 0:
            opt(grads)
        history.append((loss.asnumpy().tobytes(), [g.asnumpy().tobytes() for g in grads],
                        [(name, p.asnumpy().tobytes()) for name, p in model.parameters_and_names()]))
        kept.append(stats.peak_kept_bytes if stats is not None else 0)
    return history, kept, stats


@pytest.fixture
def fresh_check(monkeypatch):
    """A Dropout check that has seen nothing yet (the engine's is process-wide)."""
    check = DropoutFormulaCheck()
    monkeypatch.setattr(ENGINE, "dropout_formula_ok", check)
    return check


def test_check_ignores_non_finite_calls(fresh_check):
    drop = ops.Dropout(keep_prob=0.9)
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    x[0, 0], x[1, 1] = np.nan, -np.inf
    out, mask = drop(Tensor(x))
    assert fresh_check(Tensor(x), out, mask, 0.9) is True   # bit patterns: NaN equals itself
    assert KEY not in fresh_check._ok                         # and it decided nothing for later calls
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    out, mask = drop(Tensor(x))
    assert fresh_check(Tensor(x), out, mask, 0.9) is True
    assert fresh_check._ok[KEY] is True


def test_check_compares_bit_patterns(fresh_check):
    """A rebuilt -0 where the kernel wrote +0 is a difference (value comparison would call them equal)."""
    x = Tensor(np.array([[-1.0, 2.0]], np.float32))
    mask = Tensor(np.array([[0.0, 1.0]], np.float32))
    out = Tensor(np.array([[0.0, 2.0 / np.float32(0.9)]], np.float32))
    assert fresh_check(x, out, mask, 0.9) is False
    assert fresh_check._ok[KEY] is False


def _preset(ok):
    check = DropoutFormulaCheck()
    check._ok[KEY] = ok
    return check


def test_nan_first_step_keeps_masks_and_is_bitwise(fresh_check, caplog, monkeypatch):
    base, _, _ = train(with_ac=False)
    control, _, _ = train(with_ac=False)
    assert first_difference(base, control) is None   # the plain twins draw alike: the comparison holds
    assert np.isnan(np.frombuffer(base[0][0], np.float32)).all()   # step 0 really overflowed

    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        history, kept, stats = train(with_ac=True)
    assert first_difference(base, history) is None
    assert "can't be rebuilt bitwise" not in caplog.text
    assert fresh_check._ok[KEY] is True
    assert stats.recompute_calls == LAYERS and stats.ops_reused > 0

    # The finite steps keep what a run whose check had passed keeps: 1-bit masks.
    monkeypatch.setattr(ENGINE, "dropout_formula_ok", _preset(True))
    _, kept_masks, _ = train(with_ac=True)
    assert kept[1:] == kept_masks[1:], (kept, kept_masks)


def test_a_cached_failure_keeps_outputs_exactly(monkeypatch):
    """What a NaN step used to cache: every later Dropout keeps its fp32 output and mask instead of 1 bit
    per element (still exact). The difference is what the NaN step must not cost."""
    base, _, _ = train(with_ac=False)
    monkeypatch.setattr(ENGINE, "dropout_formula_ok", _preset(True))
    _, kept_masks, _ = train(with_ac=True)
    monkeypatch.setattr(ENGINE, "dropout_formula_ok", _preset(False))
    history, kept_outputs, _ = train(with_ac=True)
    assert first_difference(base, history) is None
    out_and_mask = 2 * BATCH * HIDDEN * 4 * LAYERS   # fp32 output and mask per Dropout
    bits = BATCH * HIDDEN // 8 * LAYERS
    assert [o - m for o, m in zip(kept_outputs, kept_masks)] == [out_and_mask - bits] * STEPS
