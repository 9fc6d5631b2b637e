"""The light path of checkpoint_wrapper: saved-tensor hooks only, from the second call of a signature.

A region goes light only after a first op-intercepting call showed it safe;
these tests check when it does and doesn't, that it is bitwise equal to the
baseline and to the op-intercepting path, that a diverging light recompute
raises the clear error, and that failures leave nothing behind.
"""
import json
import textwrap

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops
from test_recompute_engine import SMALL, assert_bitwise_equal, train, wrap_layers

import mindformers_ac as mac
from mindformers_ac import recompute as rc
from mindformers_ac.harness.models import synthetic_batch
from mindformers_ac.recompute import light
from mindformers_ac.recompute.api import _wrap_info
from mindformers_ac.recompute.op_slot import OpSlot

from isolated import run_isolated


@pytest.fixture
def light_calls(monkeypatch):
    """Counts light-path region forwards."""
    calls = []
    original = light.LightRegion.run_forward

    def run_forward(self, args, kwargs):
        calls.append(1)   # not the region: holding it would keep its bytes alive
        return original(self, args, kwargs)

    monkeypatch.setattr(light.LightRegion, "run_forward", run_forward)
    return calls


@pytest.mark.parametrize("dropout_kind", ["seeded", "kernel", "nn"],
                         ids=["host_mask_dropout", "replayable_dropout", "nn_dropout"])
@pytest.mark.parametrize("target", ["full", "select_mlp"])
def test_light_path_from_second_call_bitwise_equal_to_baseline_and_full_path(light_calls, dropout_kind, target):
    sub = (lambda layer: layer) if target == "full" else (lambda layer: layer.mlp)
    base = train(dropout_kind=dropout_kind)[0]
    # early_stop=False: the light path re-runs the whole layer, so its counters match a whole re-run's
    slow, slow_stats, _ = train(wrap_layers(sub, light_path=False, early_stop=False), dropout_kind=dropout_kind)
    assert not light_calls
    history, stats, _ = train(wrap_layers(sub), dropout_kind=dropout_kind)
    assert_bitwise_equal(base, history)
    assert_bitwise_equal(slow, history)
    # 2 layers x 3 steps: the first step of each layer checks the path, the other two are light
    assert len(light_calls) == 2 * 2
    for light_stats, full_stats in zip(stats, slow_stats):   # counters as the full path's
        for name in ("ops_forward", "ops_rerun", "ops_reused", "recompute_calls", "peak_kept_bytes"):
            assert getattr(light_stats, name) == getattr(full_stats, name), name
        assert light_stats.rerun_by_op == full_stats.rerun_by_op


def test_no_path_hooks_without_policy():
    model = build_small()
    layer = model.decoder.layers[0]
    rc.checkpoint_wrapper(layer)
    assert _wrap_info(layer).tracker is None
    assert not layer.mlp._forward_pre_hook
    rc.unwrap(layer)
    rc.checkpoint_wrapper(layer, policy_fn=rc.exclude_policy(["matmul"]))
    assert _wrap_info(layer).tracker is not None and layer.mlp._forward_pre_hook


def build_small(stateful=False):
    from mindformers_ac.harness.models import build_gpt, use_nn_dropout
    model = build_gpt(dropout=0.1, **SMALL)
    return use_nn_dropout(model) if stateful else model


def _per_call_policy(ctx, op, *args, **kwargs):   # not marked decides_by_site: asked per op call
    return rc.CheckpointPolicy.MUST_SAVE if "matmul" in ctx.op_name.lower() else rc.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("kw", [dict(policy_fn=_per_call_policy), dict(light_path=False)],
                         ids=["policy", "disabled"])
def test_policy_or_disabled_regions_never_go_light(light_calls, kw):
    base = train()[0]
    history, stats, _ = train(wrap_layers(**kw))
    assert_bitwise_equal(base, history)
    assert not light_calls and stats[0].ops_rerun > 0


@pytest.mark.parametrize("dropout_kind", ["seeded", "kernel", "nn"],
                         ids=["host_mask_dropout", "replayable_dropout", "nn_dropout"])
def test_stats_count_which_path_each_call_took(light_calls, dropout_kind):
    """A safe full-recompute layer: the first call per signature intercepted, the later ones light."""
    _, stats, _ = train(wrap_layers(), dropout_kind=dropout_kind)
    assert len(light_calls) == 2 * 2
    for s in stats:   # 3 steps per layer
        assert (s.intercepted_calls, s.light_calls) == (1, 2)
        assert s.as_dict()["intercepted_calls"] == 1 and s.as_dict()["light_calls"] == 2
    s.reset()
    assert (s.intercepted_calls, s.light_calls) == (0, 0)


def test_stats_count_which_path_a_policy_and_exclude_op_took(light_calls):
    _, stats, _ = train(wrap_layers(policy_fn=_per_call_policy))
    assert not light_calls
    assert all((s.intercepted_calls, s.light_calls) == (3, 0) for s in stats)
    # exclude_op decides by name: its kept ops (bmm_qk, bmm_pv) are installed at their attributes
    _, stats, _ = train(wrap_layers(policy_fn=rc.exclude_policy(["matmul"])))
    assert all((s.intercepted_calls, s.light_calls) == (1, 2) for s in stats)

    model = build_small()
    mac.apply_ac(model, {"mode": "full", "full_recompute_layer": [0, 1], "exclude_op": ["MatMul"]})
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    for step in range(3):
        grad_fn(*synthetic_batch(2, SMALL["seq_length"], SMALL["vocab_size"], seed=step))
    layer_stats = mac.ac_state(model).recompute_stats.values()
    assert len(layer_stats) == 2
    assert all((s.intercepted_calls, s.light_calls) == (1, 2) and not s.intercept_reasons for s in layer_stats)


def test_recompute_error_is_one_runtime_error_type_exported_for_trainers():
    from mindformers_ac import errors
    assert rc.RecomputeError is errors.RecomputeError and issubclass(rc.RecomputeError, RuntimeError)


class _PrimitiveDropoutLayer(nn.Cell):
    """A Dropout primitive called directly, not through an nn.Dropout cell: no proxy sees it."""

    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(16, 16)
        self.drop = ops.Dropout(keep_prob=0.8, Seed0=5, Seed1=7)   # seeded: both nets draw alike

    def construct(self, x):
        return ops.gelu(self.drop(self.fc(x))[0])


class _BatchNormLayer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def construct(self, x):
        return ops.gelu(self.bn(self.fc(x)))


class _NNDropoutLayer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(16, 16)
        self.drop = nn.Dropout(p=0.2)

    def construct(self, x):
        return ops.gelu(self.drop(self.fc(x)))


class _Net(nn.Cell):
    def __init__(self, layer_cls):
        super().__init__()
        self.layers = nn.CellList([layer_cls(), layer_cls()])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x ** 2).mean()


def _train_net(layer_cls, wrap, steps=3):
    ms.set_seed(3)
    np.random.seed(3)
    net = _Net(layer_cls)
    for i, p in enumerate(net.trainable_params()):
        p.set_data(Tensor(np.random.default_rng(i).standard_normal(p.shape).astype(np.float32) * 0.3))
    net.set_train(True)
    if wrap:
        for layer in net.layers:
            rc.checkpoint_wrapper(layer)
    grad_fn = ms.value_and_grad(net, None, net.trainable_params())
    ms.set_seed(11)
    out = []
    for step in range(steps):
        x = Tensor(np.random.default_rng(100 + step).standard_normal((4, 16)).astype(np.float32))
        loss, grads = grad_fn(x)
        out.append((loss.asnumpy().copy(), [g.asnumpy().copy() for g in grads]))
        for p, g in zip(net.trainable_params(), grads):
            p.set_data(Tensor(p.asnumpy() - 0.1 * g.asnumpy()))
    state = [p.asnumpy().copy() for p in net.get_parameters()]   # BatchNorm's moving statistics too
    return out, state


@pytest.mark.parametrize("layer_cls, goes_light", [(_PrimitiveDropoutLayer, False), (_BatchNormLayer, False),
                                                   (_NNDropoutLayer, True)],
                         ids=["primitive_dropout", "batchnorm", "nn_dropout"])
def test_which_regions_go_light_and_all_stay_exact(light_calls, layer_cls, goes_light):
    base, base_state = _train_net(layer_cls, wrap=False)
    history, state = _train_net(layer_cls, wrap=True)
    assert_bitwise_equal(base, history)
    assert all(np.array_equal(a, b) for a, b in zip(base_state, state))
    assert (len(light_calls) == 4) if goes_light else not light_calls


def test_unwrap_restores_dropout_primitives_shared_by_nested_wrappers():
    model = build_small(stateful=True)
    layer = model.decoder.layers[0]
    prim = layer.mlp_dropout.dropout
    rc.checkpoint_wrapper(layer.self_attention)
    rc.checkpoint_wrapper(layer)
    attention_dropout = layer.self_attention.core_attention.attention_dropout
    assert isinstance(attention_dropout.dropout, OpSlot) and attention_dropout.dropout.mac_dropout == 2
    rc.unwrap(layer.self_attention)   # the layer's wrapper still needs the attention dropout's slot
    assert isinstance(attention_dropout.dropout, OpSlot) and attention_dropout.dropout.mac_dropout == 1
    rc.unwrap(layer)
    assert layer.mlp_dropout.dropout is prim
    assert not isinstance(attention_dropout.dropout, OpSlot)


def test_signature_change_checks_the_path_again(light_calls):
    """A new input shape is a new signature: its first call takes the full path again."""
    net = _Net(_NNDropoutLayer)
    net.set_train(True)
    rc.checkpoint_wrapper(net.layers[0])
    grad_fn = ms.value_and_grad(net, None, net.trainable_params())
    for rows in (4, 4, 6, 6, 6):
        grad_fn(Tensor(np.ones((rows, 16), np.float32)))
    assert len(light_calls) == 3
    assert len(_wrap_info(net.layers[0]).path_checks) == 2


# -- in a subprocess: an exception inside grad can break the executor ------------------------

def _run(body):
    return run_isolated(textwrap.dedent("""
        import json
        import numpy as np
        from mindspore import ops
        from mindspore.graph.api import _pynative_executor
        from mindspore._c_expression import _DispatchGuardStack
        from mindformers_ac import recompute as rc
        from mindformers_ac.recompute import light
        from mindformers_ac.recompute.state import ENGINE
        from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_nn_dropout
        LIGHT = []
        _orig = light.LightRegion.run_forward
        def _counting(self, a, k):
            LIGHT.append(1)
            return _orig(self, a, k)
        light.LightRegion.run_forward = _counting
        def make_model(nn_dropout=False):
            m = build_gpt(num_layers=2, hidden_size=32, num_heads=2, seq_length=8, vocab_size=32, dropout=0.1)
            m.set_train(True)
            return use_nn_dropout(m) if nn_dropout else m
        batch = synthetic_batch(2, 8, 32)
    """) + textwrap.dedent(body))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["extra_op", "shape"])
def test_diverging_light_recompute_raises_clear_error(kind):
    # extra ops that save tensors; or the same output from halves: other shapes saved
    extra = ("ops.exp(y) - ops.exp(y) + y" if kind == "extra_op"
             else "ops.concat((inner(x[:, :4]), inner(x[:, 4:])), 1)")
    res = _run(f"""
        model = make_model()
        layer = model.decoder.layers[0]
        inner = layer.mlp.construct
        calls = [0]
        def construct(x):
            y = inner(x)
            if rc.is_in_recompute():
                calls[0] += 1
                if calls[0] >= 2:   # the checking call's recompute is fine, the light one diverges
                    return {extra}
            return y
        layer.mlp.construct = construct
        rc.checkpoint_wrapper(layer)
        grad_fn = ms.value_and_grad(model, None, model.trainable_params())
        grad_fn(*batch)
        assert not LIGHT
        grad_fn(*batch)
    """)
    assert res.returncode != 0
    assert "recompute diverged from forward" in res.stderr, res.stderr[-3000:]
    assert "RecomputeError: mindformers_ac: recompute diverged from forward" in res.stderr
    assert "recompute/light.py" in res.stderr   # raised on the light path
    if kind == "extra_op":
        assert "tensor(s) for backward, the forward" in res.stderr
    else:
        assert "in forward but (2, 4, 32) Float32 in the recompute" in res.stderr


@pytest.mark.slow
def test_failures_in_a_light_region_leave_nothing_behind():
    res = _run("""
        def run(where, exc, nn_dropout):
            model = make_model(nn_dropout)
            armed = [False]
            def act(x):
                if armed[0] and where == "forward" and not rc.is_in_recompute():
                    armed[0] = False
                    raise exc("injected")
                if armed[0] and where == "recompute" and rc.is_in_recompute():
                    armed[0] = False
                    raise exc("injected")
                out = ops.gelu(x)
                if armed[0] and where == "backward" and not rc.is_in_recompute():
                    def hook(_):
                        armed[0] = False
                        raise exc("injected")
                    out.register_hook(hook)
                return out
            for layer in model.decoder.layers:
                layer.mlp.activation_func = act
                rc.checkpoint_wrapper(layer)
            grad_fn = ms.value_and_grad(model, None, model.trainable_params())
            raised, before = None, len(LIGHT)
            for step in range(3):
                armed[0] = step == 1
                try:
                    loss, grads = grad_fn(*batch)
                except BaseException as e:
                    raised = type(e).__name__
                    _pynative_executor.clear_res()
            return dict(where=where, exc=exc.__name__, raised=raised, light=len(LIGHT) - before,
                        hook_active=bool(_pynative_executor.is_saved_tensor_hook_active()),
                        dispatch_depth=int(_DispatchGuardStack.depth()),
                        engine_clean=ENGINE.top() is None and not ENGINE.in_recompute(),
                        loss=float(loss.asnumpy()))
        results = []
        for nn_dropout in (False, True):
            for exc in (RuntimeError, KeyboardInterrupt, SystemExit):
                for where in ("forward", "backward", "recompute"):
                    results.append(run(where, exc, nn_dropout))
        print(json.dumps(results))
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(results) == 18
    for r in results:
        assert r["raised"] == r["exc"], r
        assert r["light"] >= 2, r   # step 1 (the failing one) and step 2 were light
        assert not r["hook_active"] and r["dispatch_depth"] == 0 and r["engine_clean"], r
        assert np.isfinite(r["loss"]), r


# -- the light path is chosen by one mark -------------------------------------------------------------------

class _TanhLayer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(8, 8)

    def construct(self, x):
        return ops.tanh(self.fc(x)) * x


def _tanh_steps(wrap):
    from model_patterns import init_weights
    from steps import run_steps
    model = init_weights(nn.SequentialCell([_TanhLayer() for _ in range(2)]))
    stats = mac.RecomputeStats()
    if wrap:
        for layer in model:
            mac.checkpoint_wrapper(layer, stats=stats)

    def loss_model(x, y):
        return ((model(x) - y) ** 2).mean()

    cell = nn.Cell()
    cell.construct = loss_model
    cell.model = model
    rng = np.random.RandomState(0)
    batch = [(Tensor(rng.randn(2, 8).astype(np.float32)), Tensor(rng.randn(2, 8).astype(np.float32)))
             for _ in range(3)]
    return run_steps(cell, lambda step: batch[step]), stats


@pytest.mark.parametrize("kind", ["decision", "mark"])
def test_a_new_kind_of_per_op_decision_keeps_its_region_intercepted(monkeypatch, kind):
    """A scratch feature added in a subclass: a new per-op decision (keep Tanh's output) made through
    ``decide``, or state of its own declared with ``keep_intercepted``. Neither is known to ``PathCheck``;
    the region still never takes the light path, and trains bitwise."""
    from mindformers_ac.recompute import region as region_module
    from mindformers_ac.recompute.dispatch import SAVE

    from steps import first_difference

    base, _ = _tanh_steps(wrap=False)
    history, stats = _tanh_steps(wrap=True)
    assert first_difference(base, history) is None and stats.light_calls == 4   # control: light from call 2

    class ScratchRegion(region_module.Region):
        def decide(self, run, idx, name, func, args, kwargs):
            if kind == "decision" and name == "Tanh":
                self.scratch_kept = getattr(self, "scratch_kept", 0) + 1   # the feature's own field
                return SAVE
            return super().decide(run, idx, name, func, args, kwargs)

        def run_forward(self, args, kwargs):
            if kind == "mark":
                self.keep_intercepted("scratch", "a scratch feature keeps per-call state of its own")
            return super().run_forward(args, kwargs)

    monkeypatch.setattr(region_module, "Region", ScratchRegion)
    history, stats = _tanh_steps(wrap=True)
    assert first_difference(base, history) is None
    assert stats.light_calls == 0 and stats.intercepted_calls == 6 and stats.recompute_calls == 6
    if kind == "decision":
        assert stats.ops_reused == 6   # the kept Tanh outputs replaced their re-runs
