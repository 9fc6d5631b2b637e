"""Random ops by MindSpore's facts (issue 49, point 2): every primitive of
``mindspore.ops.operations.random_ops`` that has a CPU kernel, held by a recomputed layer, is kept (never
re-run) and trains bitwise like the layer without AC; the ``mint`` random functions are recognised by
MindSpore's op tables (none has a CPU kernel in 2.10, measured: ``test_mint_random_ops_are_known``).

One small layer per op, 2 steps: the layer scales its output by the mean of what the op drew, so another
draw in the re-run would change every gradient. A seedless op (``NonDeterministicInts``, ...) draws
differently in two instances, so its twin can't be compared bitwise: it is checked kept and not re-run.
"""
import inspect

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops
from mindspore.ops import Primitive
from mindspore.ops.operations import random_ops

import mindformers_ac as mac
from mindformers_ac.recompute.random_ops import RANDOM_OP_PATTERN, is_random_op, is_random_primitive

from model_patterns import init_weights
from steps import first_difference, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")

_I32 = lambda *v: Tensor(np.array(v), ms.int32)   # noqa: E731
_POS = lambda *s: Tensor(np.abs(np.random.RandomState(1).randn(*s)).astype(np.float32) + 0.5)   # noqa: E731
_IDS = lambda: Tensor(np.array([[1], [2]]), ms.int64)   # noqa: E731

# op -> (primitive, its inputs); seeds where the op takes them
CASES = {
    "NonDeterministicInts": (lambda: random_ops.NonDeterministicInts(), lambda: (_I32(2, 3),)),
    "TruncatedNormal": (lambda: random_ops.TruncatedNormal(seed=1, seed2=2), lambda: (_I32(2, 3),)),
    "StandardNormal": (lambda: random_ops.StandardNormal(1, 2), lambda: ((2, 3),)),
    "StandardLaplace": (lambda: random_ops.StandardLaplace(1, 2), lambda: ((2, 3),)),
    "RandomGamma": (lambda: random_ops.RandomGamma(1, 2), lambda: (_I32(2, 3), _POS(1))),
    "LogNormalReverse": (lambda: random_ops.LogNormalReverse(), lambda: (_POS(2, 3),)),
    "Gamma": (lambda: random_ops.Gamma(1, 2), lambda: ((2, 3), _POS(1), _POS(1))),
    "ParameterizedTruncatedNormal": (lambda: random_ops.ParameterizedTruncatedNormal(1, 2),
                                     lambda: (_I32(2, 3), _POS(2) * 0, _POS(2), _POS(2) * 0 - 2, _POS(2) + 2)),
    "Poisson": (lambda: random_ops.Poisson(1, 2), lambda: ((2, 3), _POS(1))),
    "RandomPoisson": (lambda: random_ops.RandomPoisson(1, 2), lambda: (_I32(2, 3), _POS(1))),
    "UniformInt": (lambda: random_ops.UniformInt(1, 2), lambda: ((2, 3), Tensor(0, ms.int32), Tensor(5, ms.int32))),
    "UniformReal": (lambda: random_ops.UniformReal(1, 2), lambda: ((2, 3),)),
    "RandomChoiceWithMask": (lambda: random_ops.RandomChoiceWithMask(4, 1, 2),
                             lambda: (Tensor(np.array([[True, False, True], [True, True, False]])),)),
    "RandomCategorical": (lambda: random_ops.RandomCategorical(), lambda: (_POS(2, 3), 4, 3)),
    "Multinomial": (lambda: random_ops.Multinomial(1, 2), lambda: (_POS(2, 3), 4)),
    "MultinomialWithReplacement": (lambda: random_ops.MultinomialWithReplacement(4, True),
                                   lambda: (_POS(2, 3), Tensor(np.array([1]), ms.int64),
                                            Tensor(np.array([0]), ms.int64))),
    "UniformCandidateSampler": (lambda: random_ops.UniformCandidateSampler(1, 3, False, 5, seed=1),
                                lambda: (_IDS(),)),
    "LogUniformCandidateSampler": (lambda: random_ops.LogUniformCandidateSampler(1, 3, True, 5, seed=1),
                                   lambda: (_IDS(),)),
    "RandomShuffle": (lambda: random_ops.RandomShuffle(1, 2), lambda: (_POS(4, 3),)),
    "Uniform": (lambda: random_ops.Uniform(0.0, 1.0, seed=1, offset=0), lambda: (_POS(2, 3),)),
    "Cauchy": (lambda: ops.Cauchy([2, 3], 0.0, 1.0), lambda: ()),
}
SEEDLESS = {"NonDeterministicInts", "LogNormalReverse", "RandomCategorical", "MultinomialWithReplacement", "Cauchy"}


def _has_cpu_kernel(name):
    make, inputs = CASES[name]
    try:
        make()(*inputs())
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


class NoisyLayer(nn.Cell):
    """A dense layer whose output is scaled by the mean of what its random op drew."""

    def __init__(self, name):
        super().__init__()
        self.fc = nn.Dense(8, 8)
        make, self.inputs = CASES[name]
        self.noise = make()

    def construct(self, x):
        drawn = self.noise(*self.inputs())
        drawn = drawn[0] if isinstance(drawn, tuple) else drawn
        return ops.tanh(self.fc(x)) * (1.0 + 0.01 * ops.cast(drawn, ms.float32).mean())


class Net(nn.Cell):
    def __init__(self, name):
        super().__init__()
        self.layers = nn.CellList([NoisyLayer(name)])

    def construct(self, x):
        return (self.layers[0](x) ** 2).mean()


def _batch(step):
    return (Tensor(np.random.RandomState(step).randn(2, 8).astype(np.float32)),)


def test_every_random_primitive_is_marked_by_mindspore():
    """The facts the engine reads: all 20 primitives of random_ops.py carry side_effect_hidden or seeds,
    whatever their names (StandardLaplace and Cauchy match none of the old name list)."""
    prims = [o for o in vars(random_ops).values()
             if inspect.isclass(o) and issubclass(o, Primitive) and o.__module__ == random_ops.__name__]
    assert len(prims) == 20
    for name, (make, _) in CASES.items():
        if name == "Cauchy":   # ops.Cauchy (not in random_ops.py) is marked neither way: the name fallback
            assert not is_random_primitive(make()) and RANDOM_OP_PATTERN.search(name)
            continue
        assert is_random_primitive(make()), name
        assert is_random_op("AnyName", (make(), "AnyName", ())), name


def test_mint_random_ops_are_known():
    """The generator-based functional ops (what mint's random functions dispatch) are random by MindSpore's
    op tables, not only by their names."""
    for name in ("InplaceRandom", "RandpermV2", "DropoutExt"):
        assert is_random_op(name, ()), name
    assert not is_random_op("MatMulExt", ())
    with pytest.raises(RuntimeError):   # no CPU kernel in 2.10: the sweep can't run them
        mint.rand_like(_POS(2, 3))


@pytest.mark.parametrize("config", [
    {"recompute": {"mode": "full", "full_recompute_layer": ["0"]}},
    {"recompute": {"mode": "full", "full_recompute_layer": ["0"], "exclude_op": ["MatMul"]}},
], ids=["full", "exclude_op"])
def test_every_random_primitive_with_a_cpu_kernel_is_kept_bitwise(config):
    swept, skipped = [], []
    for name in CASES:
        if not _has_cpu_kernel(name):
            skipped.append(name)
            continue
        model = init_weights(Net(name))
        mac.apply_ac(model, config=config)
        history = run_steps(model, _batch, steps=2)
        stats = mac.ac_state(model).recompute_stats["0"] if "0" in mac.ac_state(model).recompute_stats else \
            next(iter(mac.ac_state(model).recompute_stats.values()))
        assert name not in stats.rerun_by_op, (name, stats.rerun_by_op)   # kept, never drawn again
        assert stats.ops_rerun > 0 and stats.recompute_calls == 2, (name, stats)   # the layer was recomputed
        if name not in SEEDLESS:
            base = run_steps(init_weights(Net(name)), _batch, steps=2)
            assert first_difference(base, history) is None, name
        swept.append(name)
    assert len(swept) >= 17, (swept, skipped)   # Gamma and Poisson have no CPU kernel in 2.10
