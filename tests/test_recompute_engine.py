"""Recompute engine: bitwise-exact gradients, kept bytes, re-run counts, lifetime, failure paths.

Note on comparing against a baseline with dropout: MindSpore 2.10's CPU
``Dropout`` kernel is reproducible (same seed -> same masks) only for the first
5 calls of a primitive instance; from the 6th call on, two identical models
draw different masks even without any recompute. Bitwise comparisons below
therefore stay within 5 calls per Dropout (3 steps, or 2 when a layer runs
twice per step).
"""
import gc
import logging
import os
import textwrap
import types

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac import recompute as rc
from mindformers_ac.checkpoint_policy import CheckpointPolicy
from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_dropout
from mindformers_ac.meter import SavedTensorMeter, peak_saved_bytes
from mindformers_ac.recompute.rerun import RegionBase, Token
from mindformers_ac.recompute.state import ENGINE
from mindformers_ac.tensors import storage_nbytes

from isolated import run_isolated

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)
BATCH = 2


def _sgd(params, grads, lr=0.1):
    for p, g in zip(params, grads):
        p.set_data(Tensor(p.asnumpy() - lr * g.asnumpy()))


def train(setup=None, steps=3, dropout=0.1, seed=0, model_kw=None, dropout_kind="seeded"):
    """Losses and gradients of ``steps`` SGD steps; RNG re-seeded so every run draws the same masks.
    ``dropout_kind``: the reference model's host-drawn masks, ``kernel`` (a fresh seeded primitive per call,
    marked replayable) or ``nn`` (``nn.Dropout``, kernel state: its masks are kept)."""
    kw = dict(SMALL, **(model_kw or {}))
    model = use_dropout(build_gpt(dropout=dropout, seed=seed, **kw), dropout_kind)
    model.set_train(True)
    extra = setup(model) if setup is not None else None
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, params)
    ms.set_seed(1234)
    history = []
    for step in range(steps):
        tokens, labels = synthetic_batch(BATCH, kw["seq_length"], kw["vocab_size"], seed=step)
        loss, grads = grad_fn(tokens, labels)
        history.append((loss.asnumpy().copy(), [g.asnumpy().copy() for g in grads]))
        _sgd(params, grads)
    return history, extra, model


def assert_bitwise_equal(base, other):
    for step, ((lb, gb), (lo, go)) in enumerate(zip(base, other)):
        assert np.array_equal(lb, lo), f"loss differs at step {step}: {lb} vs {lo}"
        assert len(gb) == len(go)
        for i, (a, b) in enumerate(zip(gb, go)):
            assert np.array_equal(a, b), f"grad {i} differs at step {step}: max {np.abs(a - b).max()}"


@pytest.fixture(scope="module")
def baseline():
    return train()[0]


@pytest.fixture(scope="module")
def baselines(baseline):
    """The run without AC for each dropout kind (``baseline`` is the reference model's own)."""
    return {"seeded": baseline, **{kind: train(dropout_kind=kind)[0] for kind in ("kernel", "nn")}}


# -- setups ---------------------------------------------------------------------------------

def wrap_layers(sub=lambda layer: layer, **kw):
    def setup(model):
        stats = [rc.RecomputeStats() for _ in model.decoder.layers]
        for layer, s in zip(model.decoder.layers, stats):
            rc.checkpoint_wrapper(sub(layer), stats=s, **kw)
        return stats
    return setup


def output_recompute(model):
    stats = rc.RecomputeStats()
    handles = [rc.wrap_op_output(layer.mlp, "activation_func", stats=stats, scope=layer)
               for layer in model.decoder.layers]
    return stats, handles


def save_softmax_layernorm(ctx, op, *args, **kwargs):
    if ctx.op_name in ("Softmax", "LayerNorm"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def nested(model):
    stats = rc.RecomputeStats()
    for layer in model.decoder.layers:
        rc.checkpoint_wrapper(layer.mlp, stats=stats)
        rc.checkpoint_wrapper(layer, stats=stats)
    return [stats]


CASES = {
    "full": wrap_layers(),
    "select_mlp": wrap_layers(lambda layer: layer.mlp),
    "select_core_attention": wrap_layers(lambda layer: layer.self_attention.core_attention),
    "full_exclude_matmul": wrap_layers(policy_fn=rc.exclude_policy(["matmul"])),
    "full_policy_must_save": wrap_layers(policy_fn=save_softmax_layernorm),
    "output_recompute_activation": output_recompute,
    "nested_layer_and_mlp": nested,
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dropout_kind", ["seeded", "kernel", "nn"],
                         ids=["host_mask_dropout", "replayable_dropout", "nn_dropout"])
def test_gradients_bitwise_equal_with_dropout(baselines, case, dropout_kind):
    history, extra, _ = train(CASES[case], dropout_kind=dropout_kind)
    assert_bitwise_equal(baselines[dropout_kind], history)
    stats = extra[0] if isinstance(extra, tuple) else extra
    stats = stats if isinstance(stats, list) else [stats]
    assert sum(s.recompute_calls for s in stats) > 0
    assert sum(s.ops_rerun for s in stats) > 0


def _call_twice_decoder(model, wrap):
    """Decoder that runs layer 0 twice (same cell, two regions per step)."""
    def construct(self, x, mask):
        layer0 = self.layers[0]
        if wrap:
            x = rc.checkpoint(layer0, x, mask)
            x = rc.checkpoint(layer0, x, mask)
        else:
            x = layer0(layer0(x, mask), mask)
        return self.final_layernorm(self.layers[1](x, mask))
    model.decoder.construct = types.MethodType(construct, model.decoder)


def test_same_cell_called_twice_functional_checkpoint():
    # 2 steps: layer 0's Dropout primitives run twice per step, and MindSpore's CPU Dropout
    # draws irreproducible masks from the 6th call of a primitive on (see module note).
    base, _, _ = train(lambda m: _call_twice_decoder(m, wrap=False), steps=2)
    other, _, _ = train(lambda m: _call_twice_decoder(m, wrap=True), steps=2)
    assert_bitwise_equal(base, other)


class HostSwap:
    """Swap executor stand-in: host copies, counted."""

    def __init__(self):
        self.offloaded = self.loaded = 0

    def offload(self, tensor):
        self.offloaded += 1
        return tensor.asnumpy().copy()

    def load(self, handle):
        self.loaded += 1
        return Tensor(handle)


def test_must_swap_and_swap_inputs_route_to_executor(baseline):
    executor = HostSwap()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SWAP if ctx.op_name == "Softmax" else CheckpointPolicy.PREFER_RECOMPUTE

    history, stats, _ = train(wrap_layers(policy_fn=policy, swap_inputs=True, swap_executor=executor))
    assert_bitwise_equal(baseline, history)
    assert executor.offloaded > 0 and executor.loaded > 0
    assert stats[0].swapped_bytes > 0


def test_must_swap_without_executor_swaps_through_the_swap_manager(baseline, caplog, fresh_swap_manager):
    policy = lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SWAP if ctx.op_name == "Softmax"  # noqa: E731
                                       else CheckpointPolicy.MUST_RECOMPUTE)
    ENGINE.warnings.reset()   # logged once per process: forget what earlier tests logged
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        history, stats, _ = train(wrap_layers(policy_fn=policy))
    assert_bitwise_equal(baseline, history)
    assert stats[0].ops_reused > 0
    assert "got no swap_executor" not in caplog.text
    # HyperParallel's recipe names no executor: SwapManager's took them
    assert mac.SwapManager().report.as_dict()["layers"]["checkpoint"]["offloaded_bytes"] > 0


# -- comm op output recompute -------------------------------------------------------------

class FakeAllGather(nn.Cell):
    """Stands in for a collective with a custom bprop: 'gathers' two copies along the last axis."""

    def construct(self, x):
        return ops.concat((x, x * 2.0), axis=-1)

    def bprop(self, x, out, dout):
        h = x.shape[-1]
        return (dout[..., :h] + dout[..., h:] * 2.0,)


class CommBlock(nn.Cell):
    """The fake collective sits in a ``_comm_ops`` registry and, as a second copy, in a sub-cell attribute."""

    def __init__(self):
        super().__init__()
        self.linear_fc1 = mint.nn.Linear(16, 16)
        self.linear_fc1._comm_ops = {"all_gather": FakeAllGather()}
        self.gather2 = FakeAllGather()
        self.out = mint.nn.Linear(16, 4)

    def construct(self, x):
        h = self.linear_fc1(self.linear_fc1._comm_ops["all_gather"](x))   # Dense saves the gathered input
        return self.out(ops.gelu(self.gather2(h[:, :8])))


def _comm_grads(wrap):
    ms.set_seed(3)
    np.random.seed(3)
    block = CommBlock()
    stats, handles = rc.RecomputeStats(), []
    if wrap:
        handles = [rc.wrap_op_output(block.linear_fc1, "all_gather", registry="_comm_ops", stats=stats,
                                     scope=block),
                   rc.wrap_op_output(block, "gather2", stats=stats)]
    x = Tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    fn = ms.value_and_grad(lambda v: (block(v) ** 2).sum(), 0, block.trainable_params())
    loss, (gx, gw) = fn(x)
    return loss.asnumpy(), gx.asnumpy(), [g.asnumpy() for g in gw], stats, handles, block


def test_comm_op_output_recompute_exact_and_undone():
    base = _comm_grads(False)
    loss, gx, gw, stats, handles, block = _comm_grads(True)
    assert np.array_equal(base[0], loss) and np.array_equal(base[1], gx)
    assert all(np.array_equal(a, b) for a, b in zip(base[2], gw))
    assert stats.ops_rerun == 2 and stats.recompute_calls == 2 and stats.dropped_bytes > 0
    gather = handles[0].original   # a Cell keeps its registry slot; its construct is patched
    assert block.linear_fc1._comm_ops["all_gather"] is gather and "construct" in gather.__dict__
    for h in handles:
        h.remove()
    assert block.linear_fc1._comm_ops["all_gather"] is gather and isinstance(gather, FakeAllGather)
    assert "construct" not in gather.__dict__ and "construct" not in block.gather2.__dict__


def test_output_recompute_handle_restores_function_and_refuses_double_wrap():
    model = build_gpt(dropout=0.0, **SMALL)
    mlp = model.decoder.layers[0].mlp
    original = mlp.activation_func
    handle = rc.wrap_op_output(mlp, "activation_func", scope=model.decoder.layers[0])
    assert mlp.activation_func is not original
    with pytest.raises(ValueError, match="already output-recomputed"):
        rc.wrap_op_output(mlp, "activation_func")
    handle.remove()
    assert mlp.activation_func is original


@pytest.mark.parametrize("order", ["region_first", "output_first"])
def test_output_recompute_inside_checkpointed_layer_exact_and_undone_in_any_order(baseline, order):
    handles = []

    def setup(model):
        for layer in model.decoder.layers:
            if order == "output_first":
                handles.append(rc.wrap_op_output(layer.mlp, "activation_func", scope=layer))
            rc.checkpoint_wrapper(layer)
            if order == "region_first":
                handles.append(rc.wrap_op_output(layer.mlp, "activation_func", scope=layer))

    history, _, model = train(setup)
    assert_bitwise_equal(baseline, history)
    for layer, handle in zip(model.decoder.layers, handles):
        if order == "region_first":
            rc.unwrap(layer)
            handle.remove()
        else:
            handle.remove()
            rc.unwrap(layer)
        assert layer.mlp.activation_func is ops.gelu and "construct" not in layer.__dict__


# -- memory -------------------------------------------------------------------------------

def _layer_input_bytes(model, seq):
    hidden = model.config.hidden_size
    return BATCH * seq * hidden * 4 + seq * seq * 4   # x and the additive attention mask


def test_full_recompute_with_replayable_dropout_keeps_exactly_inputs():
    kw = dict(num_layers=2, hidden_size=64, num_heads=2, seq_length=16, vocab_size=64)
    _, stats, model = train(wrap_layers(), steps=1, model_kw=kw, dropout_kind="kernel")
    for s in stats:
        assert s.peak_kept_bytes == _layer_input_bytes(model, 16)
        assert s.rerun_by_op["Dropout"] == 3   # drawn again from the same seeds, not kept


def test_full_recompute_with_host_drawn_dropout_masks_keeps_exactly_inputs():
    """The reference model's own dropout: a mask made on the host inside the layer is the layer's own
    tensor, dropped with the rest and made again by the re-run (one Mul per dropout, run twice)."""
    kw = dict(num_layers=2, hidden_size=64, num_heads=2, seq_length=16, vocab_size=64)
    base, _, _ = train(steps=2, model_kw=kw)
    history, stats, model = train(wrap_layers(), steps=2, model_kw=kw)
    assert_bitwise_equal(base, history)
    for s in stats:
        assert s.peak_kept_bytes == _layer_input_bytes(model, 16)
        assert "Dropout" not in s.rerun_by_op and s.rerun_by_op["Mul"] >= 3


def test_full_recompute_keeps_only_layer_inputs_and_mask_bits():
    kw = dict(num_layers=2, hidden_size=64, num_heads=2, seq_length=16, vocab_size=64)
    _, stats, model = train(wrap_layers(), steps=1, model_kw=kw, dropout_kind="nn")
    inputs = _layer_input_bytes(model, 16)
    bits = (BATCH * 2 * 16 * 16 + 2 * BATCH * 16 * 64) // 8   # attention, hidden, mlp dropout masks
    for s in stats:
        assert s.peak_kept_bytes == inputs + bits
        assert s.peak_kept_bytes <= 1.1 * inputs
        assert s.dropped_bytes > 5 * s.kept_bytes


def test_full_recompute_without_dropout_keeps_exactly_inputs():
    _, stats, model = train(wrap_layers(), steps=1, dropout=0.0)
    for s in stats:
        assert s.kept_bytes == _layer_input_bytes(model, SMALL["seq_length"])


def _kept_total(setup):
    model = build_gpt(dropout=0.1, **SMALL)
    model.set_train(True)
    stats = setup(model) if setup else []
    tokens, labels = synthetic_batch(BATCH, SMALL["seq_length"], SMALL["vocab_size"])
    params = model.trainable_params()
    outside = peak_saved_bytes(model, tokens, labels, params=params)
    return outside + sum(s.peak_kept_bytes for s in stats), stats


def test_kept_bytes_baseline_vs_select_vs_full():
    base, _ = _kept_total(None)
    mlp, _ = _kept_total(wrap_layers(lambda layer: layer.mlp))
    full, stats = _kept_total(wrap_layers())
    assert full * 3 < base
    assert full < mlp < base


def test_meter_dedups_views_and_skips_params():
    model = build_gpt(dropout=0.0, **SMALL)
    model.set_train(True)
    params = model.trainable_params()
    meter = SavedTensorMeter(params)
    tokens, labels = synthetic_batch(BATCH, SMALL["seq_length"], SMALL["vocab_size"])
    peak = peak_saved_bytes(model, tokens, labels, params=params, meter=meter)
    assert peak > 0 and meter.current == 0 and not meter.counts
    param_bytes = sum(storage_nbytes(p) for p in params)
    assert peak < param_bytes * 10


# -- counts and context -------------------------------------------------------------------

def test_exclude_matmul_reduces_reruns_by_the_matmul_count():
    _, full, _ = train(wrap_layers(), steps=1)
    _, excl, _ = train(wrap_layers(policy_fn=rc.exclude_policy(["matmul"])), steps=1)
    for f, e in zip(full, excl):
        n_matmul = sum(n for name, n in f.rerun_by_op.items() if "matmul" in name.lower())
        assert n_matmul == 2   # bmm_qk and bmm_pv
        assert f.ops_rerun - e.ops_rerun == n_matmul
        assert e.ops_reused - f.ops_reused == n_matmul


def test_exclude_by_path_patterns():
    # the kernel dropout: its op is Dropout, so the layer's Muls are gelu's own (a host mask is applied by a Mul)
    attr = rc.exclude_policy(path_patterns=[r"self_attention\.core_attention\.(softmax|bmm_qk)"])
    gelu = rc.exclude_policy(path_patterns=[r"mlp\.activation_func"])
    op_path = rc.exclude_policy(path_patterns=[r".*core_attention\.BatchMatMul"])
    _, full, _ = train(wrap_layers(), steps=1, dropout_kind="kernel")
    _, by_attr, _ = train(wrap_layers(policy_fn=attr), steps=1, dropout_kind="kernel")
    _, by_gelu, _ = train(wrap_layers(policy_fn=gelu), steps=1, dropout_kind="kernel")
    _, by_op, _ = train(wrap_layers(policy_fn=op_path), steps=1, dropout_kind="kernel")
    assert full[0].ops_rerun - by_attr[0].ops_rerun == 2   # bmm_qk, not bmm_pv (same op name)
    assert by_attr[0].rerun_by_op.get("Softmax", 0) == 0 and by_attr[0].rerun_by_op["BatchMatMul"] == 1
    gelu_ops = sum(full[0].rerun_by_op[n] for n in ("Sqrt", "Div", "Erf", "Mul"))
    assert full[0].ops_rerun - by_gelu[0].ops_rerun == gelu_ops + 1   # + the AddExt inside gelu
    assert full[0].ops_rerun - by_op[0].ops_rerun == 2
    mlp = lambda layer: layer.mlp  # noqa: E731
    layer_relative = rc.exclude_policy(path_patterns=[r"mlp\.linear_fc1\.Dense"], path_prefix="mlp")
    _, sel, _ = train(wrap_layers(mlp), steps=1, dropout_kind="kernel")
    _, sel_excl, _ = train(wrap_layers(mlp, policy_fn=layer_relative), steps=1, dropout_kind="kernel")
    assert sel[0].ops_rerun - sel_excl[0].ops_rerun == 1
    with pytest.raises(TypeError):
        rc.exclude_policy("matmul")


def test_policy_sees_cell_path_and_recompute_flag():
    seen, seen_attrs = [], []

    def spy(ctx, op, *args, **kwargs):
        seen.append((ctx.is_recompute, rc.is_in_recompute(), ctx.cell_path, ctx.op_name))
        seen_attrs.append(ctx.attr_path)
        return CheckpointPolicy.PREFER_RECOMPUTE

    # early_stop=False: the re-run asks about every op of the forward (with early stop it ends after the
    # last op that left a dropped tensor, before the layer's last residual add)
    train(wrap_layers(policy_fn=spy, early_stop=False), steps=1, model_kw=dict(num_layers=1))
    forward = [s for s in seen if not s[0]]
    rerun = [s for s in seen if s[0]]
    assert forward and rerun
    assert all(not s[1] for s in forward) and all(s[1] for s in rerun)
    attrs = {a for a in seen_attrs if a}
    assert {"self_attention.core_attention.bmm_qk", "self_attention.core_attention.bmm_pv",
            "self_attention.core_attention.softmax", "mlp.activation_func"} <= attrs
    for phase in (forward, rerun):
        paths = {(p, n) for _, _, p, n in phase}
        assert ("self_attention.core_attention", "Softmax") in paths
        assert ("self_attention.linear_qkv", "Dense") in paths
        assert ("input_layernorm", "LayerNorm") in paths
        assert ("", "AddExt") in paths
    assert [s[2:] for s in forward if s[3] != "Dropout"] == [s[2:] for s in rerun if s[3] != "Dropout"]
    assert not rc.is_in_recompute()


def test_context_fn_enters_forward_and_recompute_contexts():
    entered = []

    class Ctx:
        def __init__(self, tag):
            self.tag = tag

        def __enter__(self):
            entered.append((self.tag, rc.is_in_recompute()))

        def __exit__(self, *exc):
            return False

    train(wrap_layers(context_fn=lambda: (Ctx("fwd"), Ctx("rc"))), steps=1)
    assert entered.count(("fwd", False)) == 2 and entered.count(("rc", True)) == 2


def test_wrapper_keeps_names_and_unwrap_restores():
    model = build_gpt(dropout=0.0, **SMALL)
    names = [n for n, _ in model.parameters_and_names()]
    layer = model.decoder.layers[0]
    core_bmm = layer.self_attention.core_attention.bmm_qk
    assert rc.checkpoint_wrapper(layer) is layer
    assert rc.is_checkpoint_wrapped(layer) and isinstance(rc.get_checkpoint_stats(layer), rc.RecomputeStats)
    assert [n for n, _ in model.parameters_and_names()] == names
    with pytest.raises(ValueError, match="already wrapped"):
        rc.checkpoint_wrapper(layer)
    rc.unwrap(layer)
    assert "construct" not in layer.__dict__ and not rc.is_checkpoint_wrapped(layer)
    assert not layer.mlp._forward_pre_hook and not layer.mlp._forward_hook
    assert layer.self_attention.core_attention.bmm_qk is core_bmm and layer.mlp.activation_func is ops.gelu
    with pytest.raises(ValueError, match="not wrapped"):
        rc.unwrap(layer)
    fn = rc.checkpoint_wrapper(lambda x: x * 2)
    assert rc.is_checkpoint_wrapped(fn)
    assert float(fn(Tensor(np.float32(3.0)))) == 6.0   # no grad recorded: runs plainly


def _ours(obj, stats):
    """A region (either way in) or token of this model's layers: what earlier tests left is theirs."""
    region = obj.region if type(obj) is Token else obj
    return issubclass(type(region), RegionBase) and any(region.stats is s for s in stats)   # type(): no proxy


@pytest.mark.slow
def test_fifty_steps_do_not_grow():
    model = build_gpt(dropout=0.1, **SMALL)
    model.set_train(True)
    stats = wrap_layers()(model)
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, params)
    tokens, labels = synthetic_batch(BATCH, SMALL["seq_length"], SMALL["vocab_size"])
    kept, live = [], []
    for step in range(50):
        _, grads = grad_fn(tokens, labels)
        del grads
        if step % 10 == 9:
            gc.collect()
            kept.append(stats[0].kept_bytes)
            live.append(sum(_ours(o, stats) for o in gc.get_objects()))
    assert len(set(kept)) == 1, kept
    assert max(live) <= 2 and len(set(live)) == 1, live
    assert stats[0].live_regions == 0 and stats[0].live_bytes == 0


# -- failure paths (subprocess: an exception inside grad can break the executor) ------------

def _run_script(body):
    return run_isolated(textwrap.dedent("""
        from mindformers_ac import recompute as rc
        from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_nn_dropout
        model = build_gpt(num_layers=1, hidden_size=32, num_heads=2, seq_length=8, vocab_size=32, dropout=0.1)
        model.set_train(True)
        tokens, labels = synthetic_batch(2, 8, 32)
        grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    """) + textwrap.dedent(body), timeout=120)


@pytest.mark.slow
def test_diverging_recompute_raises_clear_error():
    res = _run_script("""
        from mindspore import ops
        layer = model.decoder.layers[0]
        inner = layer.mlp.construct
        def construct(x):
            y = inner(x)
            return ops.exp(y) - ops.exp(y) + y if rc.is_in_recompute() else y
        layer.mlp.construct = construct
        rc.checkpoint_wrapper(layer)
        grad_fn(tokens, labels)
    """)
    assert res.returncode != 0
    assert "recompute diverged from forward" in res.stderr


@pytest.mark.slow
def test_policy_returning_non_policy_raises_type_error():
    res = _run_script("""
        rc.checkpoint_wrapper(model.decoder.layers[0], policy_fn=lambda ctx, op, *a, **k: "save")
        grad_fn(tokens, labels)
    """)
    assert res.returncode != 0
    assert "policy_fn must return a CheckpointPolicy" in res.stderr


class _NormBlock(nn.Cell):
    """A pre-LN block on MindSpore's nn.LayerNorm, whose backward kernel has no PyBoost CPU version."""

    def __init__(self, h=16):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm((h,)), mint.nn.Linear(h, h)

    def construct(self, x):
        return x + self.fc(self.norm(x))


@pytest.mark.parametrize("policy", [None, "exclude_matmul"], ids=["light_path", "intercepting_path"])
def test_engine_detaches_without_recording_stop_gradient(monkeypatch, policy):
    """``ops.stop_gradient`` recorded on a graph input makes later ``LayerNormGrad`` calls key their
    kernel by the tensor's printed values (about 10x slower, docs/benchmarks.md); the engine's own
    detaches (saved inputs in forward, re-tracked inputs in the recompute) record nothing."""
    from mindformers_ac.mindspore_compat import pynative_executor

    recording, real = [], ops.stop_gradient

    def spy(x):
        recording.append(pynative_executor.enable_grad())
        return real(x)

    monkeypatch.setattr(ops, "stop_gradient", spy)
    ms.set_seed(0)
    blocks = nn.SequentialCell([_NormBlock(), _NormBlock()])
    x = Tensor(np.random.RandomState(0).randn(2, 4, 16).astype(np.float32))
    grad_fn = ms.value_and_grad(lambda t: blocks(t).sum(), None, blocks.trainable_params())
    base = [g.asnumpy() for g in grad_fn(x)[1]]
    assert not recording   # the model itself calls no stop_gradient
    # a policy asked per op call (not marked decides_by_site) keeps every call intercepted
    policy_fn = (lambda ctx, op, *a, **k: rc.CheckpointPolicy.PREFER_RECOMPUTE) if policy else None
    stats = [rc.RecomputeStats() for _ in blocks]
    for block, s in zip(blocks, stats):
        rc.checkpoint_wrapper(block, policy_fn=policy_fn, stats=s)
    for _ in range(2):   # the second call takes the light path when no policy keeps it intercepting
        got = [g.asnumpy() for g in grad_fn(x)[1]]
        assert all(np.array_equal(a, b) for a, b in zip(base, got))
    assert sum(s.recompute_calls for s in stats) == 4
    assert sum(s.light_calls for s in stats) == (0 if policy else 2)
    assert recording and not any(recording), recording   # inputs saved and re-tracked, never recorded


def test_the_region_dispatches_to_rule_objects(monkeypatch):
    """Issue 49 point 4: ``region.py`` is at most 250 lines, ``recompute/`` under the 4,427 it had before issue 49,
    and a live ``Region`` sets at most 15 attributes of its own (those ``RegionBase`` sets aside): each rule's
    per-region state lives in its object of ``recompute/rules/``, which names every rule module in its docstring."""
    import inspect

    from mindformers_ac.recompute import region as region_module
    from mindformers_ac.recompute import rules

    assert len(inspect.getsource(region_module).splitlines()) <= 250
    package = os.path.dirname(os.path.dirname(rules.__file__))
    sources = [os.path.join(d, f) for d, _, names in os.walk(package) for f in names if f.endswith(".py")]
    assert sum(len(open(f, encoding="utf-8").read().splitlines()) for f in sources) < 4427
    seen = []
    real = region_module.Region.finish_forward

    def finish(self, *args):
        real(self, *args)
        seen.append(self)
    monkeypatch.setattr(region_module.Region, "finish_forward", finish)
    x = Tensor(np.ones((2, 3), np.float32))
    ms.grad(lambda v: rc.checkpoint(lambda u: ops.tanh(ops.sin(u)), v, use_reentrant=False).sum())(x)
    base = set(vars(RegionBase(lambda u: u, rc.RecomputeStats(), None, set())))
    own = set(vars(seen[0])) - base
    assert len(own) <= 15, sorted(own)
    files = [f[:-3] for f in os.listdir(os.path.dirname(rules.__file__)) if f.endswith(".py") and f != "__init__.py"]
    assert len(files) >= 7 and all(f"``{name}``" in rules.__doc__ for name in files)


def test_parameter_rebinding_is_watched_from_the_wrap_not_per_forward():
    """Issue 49 point 4: a wrapper puts its ``RebindSlot`` on each root Parameter once (a forward adds none), a
    ``set_data`` in forward is still undone for the re-run (bitwise gradients), a deep copy of the Parameter
    carries no slot, and ``unwrap`` takes every slot off."""
    import copy

    from mindformers_ac.recompute.side_effects import RebindSlot

    class Rebinds(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = ms.Parameter(Tensor(np.full((3,), 0.5, np.float32)), name="w")
            self.g = ms.Parameter(Tensor(np.zeros((3,), np.float32)), name="g", requires_grad=False)

        def construct(self, v):
            out = ops.sin(v * self.w + self.g)
            self.g.set_data(self.g + 1)   # rebound in forward: the re-run must read the old value
            return out

    def grads(wrap):
        cell = Rebinds()
        if wrap:
            rc.checkpoint_wrapper(cell)
        slots = {m: cell.g.__dict__.get(m) for m in ("set_data", "assign_value")}
        got = ms.grad(lambda v: cell(v).sum(), grad_position=None, weights=[cell.w])(Tensor(np.ones((3,), np.float32)))
        return cell, slots, got

    _, _, expected = grads(False)
    cell, slots, got = grads(True)
    assert all(isinstance(s, RebindSlot) for s in slots.values())
    assert {m: cell.g.__dict__.get(m) for m in slots} == slots   # the forward installed nothing new
    assert np.array_equal(got[0].asnumpy(), expected[0].asnumpy())
    assert "set_data" not in vars(copy.deepcopy(cell.g))
    rc.unwrap(cell)
    assert not any(m in vars(p) for p in cell.get_parameters() for m in ("set_data", "assign_value"))
