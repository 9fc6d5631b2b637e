"""exclude_op on the light path: the kept ops are installed where they are reached (``keep_sites``).

One layer reaches an excluded op each way a keep site covers: a Primitive
attribute, a function attribute, a Primitive built lazily into a dict, a
``functools.partial`` and a callable object in a sub-cell's attributes.
Each test trains it for 3 steps against the same model without AC, bitwise,
and counts the ops that really ran (an outer ``MsDispatchMode`` sees every op
of the light re-run): the excluded ops run once, in forward. Ops reached where
no proxy can stand keep the layer intercepted, with the reason in
``RecomputeStats.intercept_reasons``.
"""
import copy
import functools

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, mint, nn, ops

from mindformers_ac import recompute as rc
from mindformers_ac.checkpoint_policy import CheckpointPolicy
from mindformers_ac.recompute.op_slot import OpSlot

from isolated import run_isolated
from steps import CountOps

H, S, B = 8, 6, 2
SCALE = 1.0


class SoftmaxKernel:
    """A callable object in an op slot (a kernel wrapper, MindFormers' flash-attention stand-in on CPU)."""

    def __call__(self, x):
        return ops.softmax(x, -1)


class Sub(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.random.RandomState(3).randn(H, H).astype(np.float32) * 0.3), name="w")
        self.mm = functools.partial(ops.matmul)
        self.softmax = SoftmaxKernel()

    def construct(self, x):
        return self.softmax(self.mm(x, self.w)) * SCALE


class Layer(nn.Cell):
    def __init__(self, seed, tensor_method=False):
        super().__init__()
        rs = np.random.RandomState(seed)
        self.dense = mint.nn.Linear(H, H)
        self.w2 = Parameter(Tensor(rs.randn(H, H).astype(np.float32) * 0.3), name="w2")
        self.bmm = ops.BatchMatMul(transpose_b=True)
        self.act = mint.nn.functional.softmax
        self.pv = ops.matmul
        self._prims = {}
        self.sub = Sub()
        self.tensor_method = tensor_method

    def _prim(self, kind):
        if kind not in self._prims:
            self._prims[kind] = ops.MatMul()
        return self._prims[kind]

    def construct(self, x):
        y = ops.sin(self.dense(x))   # recomputed: it saves its input
        p = self.act(self.bmm(y, y) * SCALE, dim=-1)
        z = p.matmul(y) if self.tensor_method else self.pv(p, y)
        z = self._prim("mm")(z.reshape(-1, H), self.w2).reshape(x.shape)
        return self.sub(z) * ops.cos(z) + x


class Net(nn.Cell):
    def __init__(self, tensor_method=False):
        super().__init__()
        self.layers = nn.CellList([Layer(i, tensor_method) for i in range(2)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


EXCLUDE = ["MatMul", "Softmax"]
KEPT = {"BatchMatMul": 1, "Softmax": 2, "MatMulExt": 2, "MatMul": 1}   # per layer call, in forward



def _train(wrap=None, steps=3, tensor_method=False, between=None):
    """(losses and grads per step, op counts of the last step, the model)."""
    ms.set_seed(0)
    model = Net(tensor_method)
    if wrap is not None:
        wrap(model)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    x = Tensor(np.random.RandomState(9).randn(B, S, H).astype(np.float32))
    history, counter = [], None
    for step in range(steps):
        if between is not None:
            between(step)
        counter = CountOps() if step == steps - 1 else None
        if counter is not None:
            with counter:
                loss, grads = grad_fn(x)
        else:
            loss, grads = grad_fn(x)
        history.append([loss.asnumpy()] + [g.asnumpy() for g in grads])
    return history, counter.counts, model


def _assert_bitwise(a, b):
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            assert x.dtype == y.dtype and np.array_equal(x, y)


def _wrap(policy_fn, stats):
    def wrap(model):
        for layer in model.layers:
            stats.append(rc.RecomputeStats())
            rc.checkpoint_wrapper(layer, policy_fn=policy_fn, stats=stats[-1])
    return wrap


def test_every_keep_site_goes_light_bitwise_and_the_kept_ops_run_once():
    base, base_ops, _ = _train()
    full, full_ops, _ = _train(_wrap(None, []))
    stats = []
    kept, kept_ops, model = _train(_wrap(rc.exclude_policy(EXCLUDE), stats))
    _assert_bitwise(base, kept)
    _assert_bitwise(base, full)
    for s in stats:   # the first call checks the signature, the other two are light
        assert (s.intercepted_calls, s.light_calls) == (1, 2) and not s.intercept_reasons
        assert s.ops_reused == 3 * sum(KEPT.values())   # 3 steps
        assert not set(s.rerun_by_op) & set(KEPT)
    # the last (light) step, forward and backward: the excluded ops ran as often as without AC, and full
    # recompute ran each once more per layer
    for name, n in KEPT.items():
        assert kept_ops[name] == base_ops[name], name
        assert full_ops[name] == base_ops[name] + 2 * n, name
    assert kept_ops["AddExt"] == full_ops["AddExt"] > base_ops["AddExt"]   # the rest is re-run
    layer = model.layers[0]
    assert layer._prims["mm"].mac_keep and vars(layer.sub)["softmax"].mac_keep   # one slot, keep role set
    plain = copy.deepcopy(model)   # a copy gets the plain ops
    assert not isinstance(plain.layers[0]._prims["mm"], OpSlot)
    assert isinstance(vars(plain.layers[0].sub)["softmax"], SoftmaxKernel)
    for layer in model.layers:
        rc.unwrap(layer)
        assert not isinstance(layer._prims["mm"], OpSlot) and isinstance(vars(layer.sub)["softmax"], SoftmaxKernel)
        assert not isinstance(vars(layer)["bmm"], OpSlot) and vars(layer)["bmm"].name == "BatchMatMul"


class FunctionLayer(nn.Cell):
    """Calls the excluded op by its global name: no slot holds it, so no proxy can stand for it."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.random.RandomState(5).randn(H, H).astype(np.float32) * 0.3), name="w")

    def construct(self, x):
        return ops.sin(ops.matmul(x, self.w)).sum()


def test_an_op_called_by_its_global_name_keeps_the_layer_intercepted_and_says_why():
    """No frame is read: an op reached through no slot has no keep site (issue 37)."""
    x = Tensor(np.random.RandomState(9).randn(B, S, H).astype(np.float32))
    want = ms.grad(FunctionLayer(), grad_position=0)(x).asnumpy()
    cell, stats = FunctionLayer(), rc.RecomputeStats()
    rc.checkpoint_wrapper(cell, policy_fn=rc.exclude_policy(["MatMul"]), stats=stats)
    grad_fn = ms.grad(cell, grad_position=0)
    assert all(np.array_equal(grad_fn(x).asnumpy(), want) for _ in range(2))
    assert (stats.intercepted_calls, stats.light_calls) == (2, 0) and stats.ops_reused == 2
    (reason,) = stats.intercept_reasons
    assert "MatMulExt" in reason and "not called through an op attribute of the region's cells" in reason


def test_a_callable_object_slot_keeps_what_a_function_slot_keeps():
    """Issue 42: an op attribute holding a callable object, a ``functools.partial`` or a bound method, named by
    a path pattern, is kept as the same slot holding a function is: the same bytes, the same ops re-run and
    reused, bitwise."""
    class Attn(nn.Cell):
        def __init__(self, kernel):
            super().__init__()
            self.q = Parameter(Tensor(np.random.RandomState(4).randn(H, H).astype(np.float32) * 0.3), name="q")
            self.flash_attention = kernel

        def construct(self, x):
            s = ops.matmul(x, self.q)
            return ops.sin(self.flash_attention(s * 2.0)).sum()

    x = Tensor(np.random.RandomState(9).randn(B, S, H).astype(np.float32))
    want = ms.grad(Attn(SoftmaxKernel()), grad_position=0)(x).asnumpy()
    figures = []
    def softmax_last(t):   # the same slot holding a plain function
        return ops.softmax(t, -1)

    for kernel in (softmax_last, SoftmaxKernel(), functools.partial(ops.softmax, axis=-1), SoftmaxKernel().__call__):
        cell, stats = Attn(kernel), rc.RecomputeStats()
        rc.checkpoint_wrapper(cell, policy_fn=rc.exclude_policy(path_patterns=[r"flash_attention"]), stats=stats)
        grad_fn = ms.grad(cell, grad_position=0)
        assert all(np.array_equal(grad_fn(x).asnumpy(), want) for _ in range(3))
        assert (stats.intercepted_calls, stats.light_calls) == (1, 2) and not stats.intercept_reasons
        figures.append((stats.peak_kept_bytes, stats.ops_rerun, stats.ops_reused))
    assert all(f == figures[0] for f in figures) and figures[0][2] == 3, figures   # Softmax kept in each call


def test_an_excluded_op_without_a_keep_site_keeps_its_layer_intercepted_and_says_why():
    base, base_ops, _ = _train(tensor_method=True)
    stats = []
    kept, kept_ops, _ = _train(_wrap(rc.exclude_policy(EXCLUDE), stats), tensor_method=True)
    _assert_bitwise(base, kept)
    for s in stats:
        assert (s.intercepted_calls, s.light_calls) == (3, 0)
        (reason,) = [r for r in s.intercept_reasons if "Tensor method" in r]
        assert "MatMulExt" in reason and "kept, but it is not called through an op attribute" in reason
    assert kept_ops["MatMulExt"] == base_ops["MatMulExt"]   # the intercepting path keeps it as before


def test_a_site_that_also_runs_recomputed_ops_is_not_kept_whole():
    """``ops.gelu`` runs Erf among other ops: excluding Erf can't keep the whole call."""
    class Gelu(nn.Cell):
        def __init__(self):
            super().__init__()
            self.act = ops.gelu

        def construct(self, x):
            return self.act(x) * 2

    ms.set_seed(0)
    cell, stats = Gelu(), rc.RecomputeStats()
    rc.checkpoint_wrapper(cell, policy_fn=rc.exclude_policy(["Erf"]), stats=stats)
    x = Tensor(np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4))
    grad_fn = ms.grad(lambda t: cell(t).sum())
    got = [grad_fn(x).asnumpy() for _ in range(2)]
    want = ms.grad(lambda t: Gelu()(t).sum())(x).asnumpy()
    assert all(np.array_equal(g, want) for g in got)
    assert (stats.intercepted_calls, stats.light_calls) == (2, 0)
    (reason,) = stats.intercept_reasons
    assert "attribute act also runs" in reason and "which is recomputed" in reason


def test_a_policy_that_decides_per_call_stays_intercepted_and_says_so():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if "matmul" in ctx.op_name.lower() else CheckpointPolicy.PREFER_RECOMPUTE
    base, _, _ = _train()
    stats = []
    kept, _, _ = _train(_wrap(policy, stats))
    _assert_bitwise(base, kept)
    assert all((s.intercepted_calls, s.light_calls) == (3, 0) for s in stats)
    assert any("decides per op call" in r for r in stats[0].intercept_reasons)
    policy.decides_by_site = True   # the user's word that it answers by the op's name and place only
    stats = []
    kept, _, _ = _train(_wrap(policy, stats))
    _assert_bitwise(base, kept)
    assert all((s.intercepted_calls, s.light_calls) == (1, 2) for s in stats)


@pytest.mark.parametrize("base_site", [True, False])
def test_exclude_policy_decides_by_site_only_when_its_base_policy_does(base_site):
    def base(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if base_site:
        base.decides_by_site = True
    assert rc.exclude_policy(["x"]).decides_by_site is True
    assert rc.exclude_policy(["x"], base_policy=base).decides_by_site is base_site


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["skips_kept_op", "other_shape"])
def test_a_light_rerun_that_reaches_its_kept_ops_otherwise_raises_naming_the_site(kind):
    """A re-run (the second light one) that skips the kept BatchMatMul, or calls it on other shapes."""
    change = ("return ops.sin(y) * 2" if kind == "skips_kept_op"
              else "return self.bmm(y[:, :3], y[:, :3]).sum(-1).sum(-1, keepdims=True) * y")
    res = run_isolated(f"""
        import numpy as np
        from mindspore import Tensor, nn, ops
        from mindformers_ac import recompute as rc
        from mindformers_ac.recompute.state import ENGINE
        from mindspore.graph.api import _pynative_executor
        calls = [0]

        class Cell(nn.Cell):
            def __init__(self):
                super().__init__()
                self.bmm = ops.BatchMatMul(transpose_b=True)

            def construct(self, x):
                y = ops.sin(x)
                if rc.is_in_recompute():
                    calls[0] += 1
                    if calls[0] == 3:
                        {change}
                return self.bmm(y, y).sum(-1, keepdims=True) * y

        cell, stats = Cell(), rc.RecomputeStats()
        rc.checkpoint_wrapper(cell, policy_fn=rc.exclude_policy(["matmul"]), stats=stats)
        grad_fn = ms.grad(lambda t: cell(t).sum())
        x = Tensor(np.ones((2, 4, 3), np.float32))
        grad_fn(x); grad_fn(x)
        assert stats.light_calls == 1, stats
        try:
            grad_fn(x)
        except RuntimeError as e:
            print("RAISED", type(e).__name__, e)
        assert ENGINE.top() is None and not _pynative_executor.is_saved_tensor_hook_active()
        print("CLEAN")
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "RAISED RecomputeError mindformers_ac: recompute diverged from forward" in res.stdout, res.stdout
    if kind == "skips_kept_op":
        assert "the forward made 1 call(s) of ops exclude_op keeps, its recompute 0 (at attribute bmm)" in res.stdout
    else:
        assert "at kept call #0: forward called attribute bmm on (2, 4, 3) Float32, (2, 4, 3) Float32" in res.stdout
        assert "recompute calls attribute bmm on (2, 3, 3) Float32" in res.stdout
    assert "CLEAN" in res.stdout


def test_apply_ac_reports_per_layer_which_path_exclude_op_took_and_why():
    """exclude_op [BatchMatMul, Muls] on the reference GPT: bmm_qk / bmm_pv are attributes (kept at their
    sites), the scaling ``scores * scale`` is a Tensor operator (no site): every layer stays intercepted,
    and the step's figures and train's table say why; [BatchMatMul] alone goes light."""
    import mindformers_ac as mac
    from mindformers_ac.accounting import StepMeter
    from mindformers_ac.harness.models import build_gpt, synthetic_batch
    from mindformers_ac.harness.report import layer_table

    def steps(exclude):
        model = build_gpt(num_layers=2, hidden_size=32, num_heads=4, seq_length=8, vocab_size=32, dropout=0.0)
        mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": [0, 1], "exclude_op": exclude}})
        grad_fn, meter = ms.value_and_grad(model, None, model.trainable_params()), StepMeter(model)
        memory = []
        for step in range(2):
            with meter.step() as figures:
                grad_fn(*synthetic_batch(2, 8, 32, seed=step))
            memory.append(figures)
        return memory

    first, second = steps(["BatchMatMul", "Muls"])
    for layer in (0, 1):
        assert (first.layers[layer].intercepted_calls, second.layers[layer].intercepted_calls) == (1, 1)
        (reason,) = first.layers[layer].intercept_reasons
        assert "Muls" in reason and "a Tensor method or an operator" in reason
    rows = [{**lm.as_dict(), "layer": str(lm.layer), "applied": [], "baseline_kept_bytes": 0,
             "light_calls": lm.light_calls, "intercept_reasons": sorted(lm.intercept_reasons)}
            for lm in first.layers.values()]
    table = layer_table({"layers": rows})
    assert "intercepting path kept by:\n  0: op #" in table and "\n  1: op #" in table
    first, second = steps(["BatchMatMul"])
    assert all((lm.intercepted_calls, lm.light_calls) == (0, 1) and not lm.intercept_reasons
               for lm in second.layers.values() if lm.layer != "other")


def test_a_function_rebound_after_apply_is_the_one_that_runs(monkeypatch):
    """Issue 37, case 6: a profiler or numerics hook patches ``ops.matmul`` after the engine kept MatMul;
    the wrapped layer calls what the module holds now, as the plain model does."""
    x = Tensor(np.random.RandomState(9).randn(B, S, H).astype(np.float32))
    plain, cell = FunctionLayer(), FunctionLayer()
    rc.checkpoint_wrapper(cell, policy_fn=rc.exclude_policy(["MatMul"]))
    original = ops.matmul
    for step in range(3):
        if step == 1:
            monkeypatch.setattr(ops, "matmul", lambda a, b: original(a, b) * 2.0)
        want = ms.grad(plain, grad_position=0)(x).asnumpy()
        assert np.array_equal(ms.grad(cell, grad_position=0)(x).asnumpy(), want), step


class InputViewLayer(nn.Cell):
    """Two kept MatMuls whose first argument is a view of the layer's input (issue 52): a legacy op saves a
    converted copy of it, which the re-run's argument stands for (rule K1) on both paths."""

    def __init__(self):
        super().__init__()
        rs = np.random.RandomState(4)
        self.wa = Parameter(Tensor(rs.randn(H, H).astype(np.float32) * 0.3), name="wa")
        self.wb = Parameter(Tensor(rs.randn(H, H).astype(np.float32) * 0.3), name="wb")
        self.mm = ops.MatMul()

    def construct(self, x):
        flat = x.reshape(-1, H)
        return (ops.sin(self.mm(flat, self.wa)) * ops.relu(self.mm(flat, self.wb))).sum()


def _step_figures(cell, x, steps, stats=None):
    """Per step: the gradients (input and weights), and with ``stats`` the bytes kept and which path ran."""
    grad_fn = ms.grad(cell, 0, cell.trainable_params())
    figures = []
    for _ in range(steps):
        if stats is not None:
            stats.reset()   # each step's peak on its own
        dx, dw = grad_fn(x)
        grads = [dx.asnumpy()] + [g.asnumpy() for g in dw]
        path = None if stats is None else ("light" if stats.light_calls else "intercepted", stats.peak_kept_bytes)
        figures.append((grads, path))
    return figures


def test_kept_bytes_are_the_same_on_the_intercepting_and_the_light_path():
    """Issue 52: the light path kept the copies its kept MatMuls saved of the input's view on top of the
    input, one per call; it keeps what the intercepting path keeps (the input and the kept outputs)."""
    x = Tensor(np.random.RandomState(9).randn(B, S, H).astype(np.float32))
    want = _step_figures(InputViewLayer(), x, 4)
    cell, stats = InputViewLayer(), rc.RecomputeStats()
    rc.checkpoint_wrapper(cell, policy_fn=rc.exclude_policy(["MatMul"]), stats=stats)
    got = _step_figures(cell, x, 4, stats)
    paths = [path for _, path in got]
    assert [p for p, _ in paths] == ["intercepted"] + ["light"] * 3
    assert {kept for _, kept in paths} == {3 * B * S * H * 4}, paths   # x and the two MatMuls' outputs
    _assert_bitwise([g for g, _ in got], [g for g, _ in want])


class ViewsLayer(nn.Cell):
    """``mint.t``, ``mint.reshape``, ``mint.flatten`` and ``mint.squeeze`` share one code object in MindSpore
    2.10; keeping them by name must not mix them up (issue 37, case 7)."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.random.RandomState(6).randn(H, H).astype(np.float32) * 0.3), name="w")

    def construct(self, x):
        y = mint.reshape(ops.sin(x), (B * S, H))
        z = ops.matmul(y, mint.t(self.w))
        return ops.cos(mint.squeeze(mint.flatten(z, 0, 1).reshape(1, -1), 0)).sum()


def test_functions_sharing_one_code_object_are_kept_apart():
    x = Tensor(np.random.RandomState(9).randn(B, S, H).astype(np.float32))
    want = ms.grad(ViewsLayer(), grad_position=0)(x).asnumpy()
    cell, stats = ViewsLayer(), rc.RecomputeStats()
    rc.checkpoint_wrapper(cell, policy_fn=rc.exclude_policy(["Reshape", "Transpose", "Flatten", "Squeeze"]),
                          stats=stats)
    grad_fn = ms.grad(cell, grad_position=0)
    assert all(np.array_equal(grad_fn(x).asnumpy(), want) for _ in range(3))
    assert stats.ops_reused > 0


def test_a_layer_called_with_a_cell_argument_says_why_it_stays_intercepted():
    """Issue 42: MindFormers' MTP layer gets ``embedding=self.embedding``; a Cell argument can't be part of a
    call signature, so no call is checked and every one is intercepted: each counts that reason."""
    class Embed(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.random.RandomState(7).randn(H, H).astype(np.float32) * 0.3), name="w")

        def construct(self, x):
            return ops.matmul(x, self.w)

    class MtpLike(nn.Cell):
        def construct(self, x, embedding):
            return ops.sin(embedding(x)).sum()

    x = Tensor(np.random.RandomState(9).randn(B, S, H).astype(np.float32))
    embed = Embed()
    want = ms.grad(lambda t: MtpLike()(t, embed), grad_position=0)(x).asnumpy()
    cell, stats = MtpLike(), rc.RecomputeStats()
    rc.checkpoint_wrapper(cell, stats=stats)
    grad_fn = ms.grad(lambda t: cell(t, embed), grad_position=0)
    assert all(np.array_equal(grad_fn(x).asnumpy(), want) for _ in range(3))
    assert (stats.intercepted_calls, stats.light_calls) == (3, 0)
    (reason,) = stats.intercept_reasons
    assert "can't be part of a call signature" in reason and stats.intercept_reasons[reason] == 3


def test_calls_intercepted_while_their_signature_is_checked_or_past_the_bound_say_why():
    """Issue 42: two forwards before their backwards (the first still being checked), and a new shape every
    call past ``PathChecks.MAX_KEYS`` signatures: each intercepted call counts its reason."""
    from mindformers_ac.recompute.path_choice import PathChecks

    cell, stats = FunctionLayer(), rc.RecomputeStats()
    rc.checkpoint_wrapper(cell, stats=stats)
    x = Tensor(np.random.RandomState(9).randn(B, S, H).astype(np.float32))
    ms.grad(lambda t: cell(t) + cell(t), grad_position=0)(x)
    assert stats.intercepted_calls == 2
    (reason,) = stats.intercept_reasons
    assert "still being checked" in reason and stats.intercept_reasons[reason] == 1
    for n in range(PathChecks.MAX_KEYS + 1):
        ms.grad(cell, grad_position=0)(Tensor(np.ones((1, n + 1, H), np.float32)))
    assert any(f"checked {PathChecks.MAX_KEYS} call signatures" in r for r in stats.intercept_reasons)
