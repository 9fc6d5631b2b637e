"""Nested checkpoints and higher-order gradients (issue 50): bitwise against the same without AC.

Each backward that reaches a region's saved tensors re-runs it once, keyed by
MindSpore's autodiff engine (rule R1 of docs/exactness.md): the backward of a
grad of a grad reaches them a second time. A region nested in another is
replayed by the enclosing region's re-run and re-run by its own backward
(rule N1), so an op at nesting depth ``k`` runs ``k`` more times in backward,
as JAX's remat and PyTorch's non-reentrant checkpoint run it. Where
MindSpore 2.10 can't compute a case without AC (a Hessian-vector product
through the reference GPT's layers: its forward's ``qkv[0]`` fails under a
grad of a grad, "Only support integers ... but got 0 with type int"), the
layer model below stands for it.
"""
import gc

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.recompute import get_checkpoint_stats

X = Tensor(np.float32(0.3))
V = Tensor(np.array([0.3, -0.7, 1.1, 0.05], np.float32))


def ckpt(fn, stats=None, **options):
    return lambda *args: mac.checkpoint(fn, *args, stats=stats, **options)


def grad(fn):
    """The gradient of ``fn``'s sum, as a function of the same input (PyTorch's test ``grad``, create_graph)."""
    return lambda x: ms.grad(lambda v: fn(v).sum())(x)


def same(a, b):
    return np.array_equal(a.asnumpy(), b.asnumpy())


def live_regions():
    """Every region object alive now (the objects themselves: held, their ids can't be reused meanwhile)."""
    gc.collect()
    return [o for o in gc.get_objects() if type(o).__name__ in ("Region", "LightRegion")]


def regions_alive(before=()):
    """How many regions are alive that were not in ``before`` (another module's, on the same worker)."""
    held = {id(o) for o in before}
    return sum(id(o) not in held for o in live_regions())


# -- the issue's table ------------------------------------------------------------------------------------------
def test_the_issue_table_rows_give_what_mindspore_gives_without_ac():
    f = lambda v: ops.exp(ops.sin(v))   # noqa: E731
    second, nested = mac.RecomputeStats(), mac.RecomputeStats()
    assert ms.grad(ms.grad(f))(X).asnumpy() == np.float32(0.82933795)
    assert same(ms.grad(ms.grad(ckpt(f, second)))(X), ms.grad(ms.grad(f))(X))
    assert second.recompute_calls == 2   # the recorded first backward's re-run, and the second backward's
    inner = lambda t: ops.exp(ckpt(ops.exp, nested)(t))   # noqa: E731
    assert ms.grad(lambda v: ops.exp(ops.exp(v)))(X).asnumpy() == np.float32(5.206238)
    assert same(ms.grad(ckpt(inner, nested))(X), ms.grad(lambda v: ops.exp(ops.exp(v)))(X))
    assert nested.recompute_calls == 2   # the outer region (replaying the inner), then the inner one


def test_third_order_through_a_recomputed_region():
    f = lambda v: ops.exp(ops.sin(v))   # noqa: E731
    stats = mac.RecomputeStats()
    assert same(ms.grad(ms.grad(ms.grad(ckpt(f, stats))))(X), ms.grad(ms.grad(ms.grad(f)))(X))
    assert stats.recompute_calls == 3   # one per backward reaching the region


# -- PyTorch: test/test_autograd.py, TestNestedCheckpoint -----------------------------------------------------
def f(x):
    return ops.sin(ops.exp(ops.sin(x)))


def g(x):
    a = ops.sin(ops.exp(ops.sin(x)))
    b = ops.sin(ops.exp(ops.sin(x)))
    ms.grad(lambda v: ops.sin(ops.exp(ops.sin(v))).sum())(x)   # gradients computed in the forward, unused
    return ops.sin(a) + b


def nested_cases(fn, c):
    """PyTorch's ``get_tests``: a function, and the same arbitrarily wrapped in checkpoint and grad."""
    return [(fn, (c(fn), c(c(fn)))),
            (grad(fn), (grad(c(fn)), grad(c(c(fn))))),
            (grad(grad(fn)), (grad(c(grad(fn))), c(grad(grad(c(fn)))), grad(c(grad(c(fn)))))),
            (grad(grad(grad(fn))), (grad(c(grad(grad(c(fn))))), grad(c(grad(c(grad(c(fn))))))))]


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("fn", [f, g], ids=["f", "g"])
def test_nested_checkpoint_of_pytorch(fn, early_stop):
    """TestNestedCheckpoint.test_nested_checkpoint (with check_graph_dies): every wrapping gives what the
    function gives, bitwise, and no region outlives its call once MindSpore's last graph is let go."""
    before = live_regions()   # a module run before this one on the same worker may hold some
    c = lambda h: ckpt(h, early_stop=early_stop)   # noqa: E731
    for expected_fn, actual_fns in nested_cases(fn, c):
        expected = expected_fn(V)
        for actual_fn in actual_fns:
            assert same(actual_fn(V), expected)
    grad(ops.sin)(V)   # MindSpore holds the last grad call's graph until the next one
    assert regions_alive(before) == 0


def test_nested_checkpoint_two_children_of_pytorch():
    """TestNestedCheckpoint.test_nested_checkpoint_two_children: two regions inside one, under one and two
    grads."""
    def h(x):
        return ops.cos(ops.log(ops.cos(x) + 2))

    def double(x):
        return ckpt(f)(x) + ckpt(h)(x)

    def plain(x):
        return f(x) + h(x)

    for wrap in (lambda fn: fn, grad, lambda fn: grad(grad(fn))):
        assert same(wrap(ckpt(double))(V), wrap(plain)(V))


def test_an_inner_grad_call_keeps_no_region_alive():
    """PyTorch's nested-grad test (``g`` computes gradients inside its forward), ported: over four steps the
    regions alive after each (``RecomputeStats.live_regions``) stay at most the one MindSpore's last graph
    holds (on main: 1, 2, 3, 4), and none once the next grad call lets that graph go. (MindSpore itself keeps
    what a pass-through saved-tensor hook packs inside ``g``'s inner grad call, without AC: 2, 4, 6, 8 objects,
    measured; the region holds none of it.)"""
    for nest in (lambda s: ckpt(g, s), lambda s: ckpt(ckpt(g, s), s)):
        stats = mac.RecomputeStats()
        alive = []
        for _ in range(4):
            grad(nest(stats))(V)
            gc.collect()
            alive.append(stats.live_regions)
        assert max(alive) <= 1, alive
        grad(ops.sin)(V)
        gc.collect()
        assert stats.live_regions == 0


# -- JAX: tests/api_test.py, RematTest ----------------------------------------------------------------------------
def test_remat_eval_counter_of_jax():
    """RematTest.test_remat_eval_counter: an op that saves its own output (JAX's ``add_one`` saves ``pout``;
    Exp here), ``g = remat(lambda x: add_one(f(x)))`` with ``f = remat(add_one)``: 2 evaluations in forward, 3
    in backward (2 re-running g, which replays f; 1 re-running f)."""
    evals = []

    def add_one(x):
        evals.append(1)
        return ops.exp(x)

    g_ = ckpt(lambda x: add_one(ckpt(add_one)(x)))
    expected = grad(lambda x: add_one(add_one(x)))(V)
    evals.clear()
    out = ms.value_and_grad(lambda v: g_(v).sum())
    loss, got = out(V)
    assert same(got, expected) and len(evals) == 5   # 2 forward + 3 backward


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_remat_recursive_checkpoint_recompute_counts(depth):
    """After JAX's recursive remat counts (the issue names the test; written from its description): checkpoint
    nested ``depth`` deep, one Exp at each level; the Exp at level ``k`` runs once in forward and ``k`` times
    in backward (each enclosing re-run replays it, then its own re-runs it), and the gradient is bitwise."""
    evals = {}

    def level(k):
        def fn(x):
            evals[k] = evals.get(k, 0) + 1
            y = ops.exp(ops.sin(x))
            return y if k == depth else ckpt(level(k + 1))(y)
        return fn

    def plain(x, k=1):
        y = ops.exp(ops.sin(x))
        return y if k == depth else plain(y, k + 1)

    expected = grad(plain)(V)
    evals.clear()
    assert same(grad(ckpt(level(1)))(V), expected)
    assert evals == {k: 1 + k for k in range(1, depth + 1)}


# -- checkpoint_wrapper and apply_ac regions nested -------------------------------------------------------------
class Attention(nn.Cell):
    """A sub-cell whose last op saves its own output (the case that failed nested, issue 50), with a Dropout.

    MindSpore 2.10 fails a grad of a grad through Softmax and through nn.Dropout without AC ("The
    pointer[input_tensor] is null"): for a second order (``second_order``) Tanh stands for Softmax (it saves
    its output too) and there is no Dropout."""

    def __init__(self, seed, second_order):
        super().__init__()
        self.fc = mint.nn.Linear(8, 8)
        for i, p in enumerate(self.fc.trainable_params()):
            p.set_data(Tensor(np.random.RandomState(seed + i).uniform(-0.5, 0.5, p.shape).astype(np.float32)))
        self.softmax = ops.tanh if second_order else nn.Softmax()
        self.dropout = nn.Identity() if second_order else nn.Dropout(p=0.25)

    def construct(self, x):
        return self.dropout(self.softmax(self.fc(x)))


class Layer(nn.Cell):
    def __init__(self, seed, second_order):
        super().__init__()
        self.attention = Attention(seed, second_order)
        self.fc = mint.nn.Linear(8, 8)
        for i, p in enumerate(self.fc.trainable_params()):
            p.set_data(Tensor(np.random.RandomState(seed + 10 + i).uniform(-0.5, 0.5, p.shape).astype(np.float32)))
        self.act = ops.silu

    def construct(self, x):
        return self.act(self.fc(self.attention(x))) * x


class Model(nn.Cell):
    def __init__(self, second_order=False, layers=3):
        super().__init__()
        self.layers = nn.CellList([Layer(10 * i, second_order) for i in range(layers)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * x).sum()


INPUT = Tensor(np.random.RandomState(9).randn(2, 8).astype(np.float32))


def train(model, steps=3, order=1):
    """Gradients of ``steps`` steps (first order: the parameters'; second: the input's grad of grad), each from
    the same seed, as numpy arrays."""
    out = []
    for _ in range(steps):
        ms.set_seed(5)
        if order == 1:
            out += [g.asnumpy() for g in ms.grad(model, None, model.trainable_params())(INPUT)]
        else:
            first = ms.grad(model)
            out.append(ms.grad(lambda v: first(v).sum())(INPUT).asnumpy())
    return out


def equal(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("order", [1, 2])
def test_checkpoint_wrapper_on_a_sub_cell_and_on_its_layer_trains_bitwise(order):
    """A wrapped softmax-and-Dropout sub-cell inside a wrapped layer (every step failed on main), first and
    second order, three steps (the light path from the second on)."""
    expected = train(Model(order == 2), order=order)
    model = Model(order == 2)
    for layer in model.layers:
        mac.checkpoint_wrapper(layer.attention)
        mac.checkpoint_wrapper(layer)
    assert equal(train(model, order=order), expected)
    inner, outer = get_checkpoint_stats(model.layers[0].attention), get_checkpoint_stats(model.layers[0])
    per_step = 1 if order == 1 else 2   # one re-run per backward reaching the region (R1)
    assert outer.recompute_calls == 3 * per_step and inner.recompute_calls == 3 * per_step


MODES = {
    "full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"]}},
    "group": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"], "group_layers": 3}},
    "select_op": {"recompute": {"mode": "select", "select_module": {"act": ["0-2"]}}},
    "select_in_full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"],
                                     "select_module": {"attention": ["0-2"]}}},
    "select_in_full_exclude": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"],
                                             "select_module": {"attention": ["0-2"]}, "exclude_op": ["MatMul"]}},
    "layer_swap": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_nested_and_plain_regions_with_dropout_train_bitwise_in_each_ac_mode(mode):
    """First order, three steps, with Softmax and nn.Dropout in the attention sub-cell: a select region inside
    a full one (kept matmuls inside both, ``exclude_op``) and every other mode, bitwise."""
    expected = train(Model())
    model = Model()
    mac.apply_ac(model, config=mac.AcConfig.from_dict(MODES[mode]))
    assert equal(train(model), expected)


@pytest.mark.parametrize("mode", list(MODES))
def test_grad_of_grad_through_each_ac_mode_is_bitwise(mode):
    """A Hessian-vector-style grad of a grad of the layer model, cold (first call intercepted) then warm (light
    path), through every AC mode; first-order training after it is still bitwise."""
    expected, expected_first = train(Model(True), order=2), train(Model(True), steps=1)
    model = Model(True)
    mac.apply_ac(model, config=mac.AcConfig.from_dict(MODES[mode]))
    assert equal(train(model, order=2), expected)
    assert equal(train(model, steps=1), expected_first)
