"""Activation swap engine: exact gradients, report, prefetch order, pool bounds, device scheduling, failures."""
import contextlib
import gc
import threading

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from mindformers_ac import swap  # the swap engine package, callable as HyperParallel's swap(fn, *args)
from mindformers_ac.checkpoint_policy import CheckpointPolicy
from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.meter import SavedTensorMeter
from mindformers_ac.swap import (
    SwapExecutor,
    SwapManager,
    SwapReport,
    async_save_on_cpu,
    install_layer_swap,
    install_op_swap,
    remove_swap_wrapper,
    swap_tensor_wrapper,
    swap_wrapper,
)
from mindformers_ac.swap.backends import DeviceCopyBackend, HostBufferPool, HostCopyBackend

from isolated import run_isolated

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, BATCH = 3, 32, 4, 32, 128, 2


def make_model(layers=LAYERS, dropout=0.1):
    return build_gpt(num_layers=layers, hidden_size=HIDDEN, num_heads=HEADS, seq_length=SEQ, vocab_size=VOCAB,
                     dropout=dropout, seed=0)


def train(model, steps=3, report=None, on_step=None):
    """`steps` training steps (SGD update between them); loss and every gradient per step."""
    ms.set_seed(123)
    tokens, labels = synthetic_batch(BATCH, SEQ, VOCAB, seed=1)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    opt = nn.SGD(model.trainable_params(), learning_rate=0.1)
    out, snaps = [], []
    for _ in range(steps):
        loss, grads = grad_fn(tokens, labels)
        out.append((loss.asnumpy().copy(), [g.asnumpy().copy() for g in grads]))
        opt(grads)
        if report is not None:
            snaps.append(report.end_step())
        if on_step is not None:
            on_step()
    return out, snaps


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for (la, ga), (lb, gb) in zip(a, b):
        assert np.array_equal(la, lb), (la, lb)
        assert len(ga) == len(gb)
        for x, y in zip(ga, gb):
            assert np.array_equal(x, y), float(np.abs(x - y).max())


def hook_counts(model):
    return [(path, len(c._forward_pre_hook), len(c._forward_hook), len(c._backward_pre_hook),
             "construct" in c.__dict__) for path, c in model.cells_and_names()]


@pytest.fixture(scope="module")
def baseline():
    """Losses/gradients without swap, and per-layer saved bytes measured by an independent meter."""
    model = make_model()
    meters, ctx = {}, {}
    handles = []
    for i, layer in enumerate(model.decoder.layers):
        meters[i] = SavedTensorMeter(model.get_parameters())

        def pre(cell, args, i=i):
            ctx[i] = meters[i].hooks()
            ctx[i].__enter__()

        def post(cell, args, out, i=i):
            ctx.pop(i).__exit__(None, None, None)
        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    out, _ = train(model)
    for h in handles:
        h.remove()
    return out, {i: m.peak for i, m in meters.items()}


@pytest.fixture(autouse=True)
def fresh_manager():
    SwapManager().reset()
    yield
    SwapManager().reset()


# --- exact gradients + report -------------------------------------------------------------

def test_layer_swap_exact_and_report(baseline):
    ref, layer_bytes = baseline
    model = make_model()
    before = hook_counts(model)
    threads = threading.active_count()
    inst = install_layer_swap(model.decoder.layers, [0, 1], prefetch=1, model=model)
    out, snaps = train(model, report=inst.report)
    assert_bitwise(ref, out)
    for snap in snaps:
        for i in (0, 1):
            st = snap["layers"][i]
            assert st["offloaded_bytes"] > 0 and st["num_offloaded"] >= 10
            assert st["prefetched_bytes"] + st["late_bytes"] == st["offloaded_bytes"]
            assert st["on_demand_bytes"] == 0
            # device-resident activations of a swapped layer drop by >= 95% vs the independent meter
            assert st["resident_bytes"] <= 0.05 * layer_bytes[i], (st, layer_bytes[i])
            assert st["kept_reasons"].get("input", 0) >= 1      # the layer input stays on the device
        assert 2 not in snap["layers"]                           # layer 2 is not swapped
        assert snap["live_resident_bytes"] == 0
    assert snaps[-1]["pool_allocations"] == snaps[0]["pool_allocations"]   # warm pool: no new buffers
    inst.remove()
    assert hook_counts(model) == before
    assert threading.active_count() == threads


@pytest.mark.parametrize("p", [1, 2])
def test_prefetch_issued_at_expected_backward(p):
    model = make_model(layers=4)
    layers = model.decoder.layers
    report = SwapReport()
    # the test's backward pre-hooks mark where each layer's backward starts; the engine's prefetch
    # fires on the gradient of layer i+p's output inside the cell, right after that mark
    marks = [layers[i].register_backward_pre_hook(
        lambda c, g, i=i: report.events.append(("backward", i, None))) for i in range(4)]
    swapped = [i for i in range(4) if i + p < 4]
    inst = install_layer_swap(layers, swapped, prefetch=p, report=report, model=model)
    train(model, steps=1)
    ev = list(report.events)
    for i in swapped:
        k = ev.index(("prefetch", i, i + p))
        assert ev[k - 1] == ("backward", i + p, None)
        loads = [n for n, e in enumerate(ev) if e[0] == "load" and e[1] == i]
        assert loads and min(loads) > k
        assert all(ev[n][2] in ("in_time", "late") for n in loads)
        # layer i's loads come before layer i-1's backward starts: it waits only for its own data
        if i > 0:
            assert max(loads) < ev.index(("backward", i - 1, None))
    order = [e[1] for e in ev if e[0] == "prefetch"]
    assert order == sorted(swapped, reverse=True)
    inst.remove()
    for m in marks:
        m.remove()


def test_no_prefetch_loads_on_demand(baseline):
    model = make_model()
    inst = install_layer_swap(model.decoder.layers, [0, 1, 2], prefetch=0, model=model)
    out, snaps = train(model, report=inst.report)
    assert_bitwise(baseline[0], out)
    for i in (0, 1, 2):
        st = snaps[-1]["layers"][i]
        assert st["on_demand_bytes"] == st["offloaded_bytes"] > 0 and st["prefetched_bytes"] == 0
    assert not any(e[0] == "prefetch" for e in snaps[-1]["events"])
    inst.remove()


def test_op_swap_mlp_exact(baseline):
    model = make_model()
    layers = model.decoder.layers
    before = hook_counts(model)
    ex = SwapExecutor()
    insts = [install_op_swap(layers[i], ["mlp"], layer_id=i, prefetch_layer=layers[i + 1], executor=ex, model=model)
             for i in (0, 1)]
    out, snaps = train(model, report=ex.report)
    assert_bitwise(baseline[0], out)
    st = snaps[-1]["layers"][0]
    # mlp saves its input (b*s*h) and four b*s*4h float32 tensors (fc1 out, gelu in/out, fc2 in): only those move
    assert st["offloaded_bytes"] == 4 * BATCH * SEQ * (HIDDEN + 4 * 4 * HIDDEN)
    assert st["prefetched_bytes"] + st["late_bytes"] == st["offloaded_bytes"]
    for inst in insts:
        inst.remove()
    ex.close()
    assert hook_counts(model) == before


def test_swap_tensor_wrapper_exact(baseline):
    model = make_model()
    layers = model.decoder.layers

    def patched(mlp):
        def construct(x):
            h = swap_tensor_wrapper(mlp.activation_func(mlp.linear_fc1(x)), tag="gelu_out")
            return mlp.linear_fc2(h)
        return construct

    for i in (0, 1):
        layers[i].mlp.construct = patched(layers[i].mlp)
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    out, snaps = train(model, report=SwapManager().report)
    assert_bitwise(baseline[0], out)
    key0 = SwapManager().key_of(layers[0])
    st = snaps[-1]["layers"][key0]
    assert st["offloaded_bytes"] == 4 * BATCH * SEQ * 4 * HIDDEN   # exactly the marked gelu output
    assert st["prefetched_bytes"] + st["late_bytes"] == st["offloaded_bytes"]
    assert st["kept_reasons"]["unmarked"] > 0
    for i in (0, 1):
        del layers[i].mlp.construct


def test_swap_wrapper_exact_and_restorable(baseline):
    model = make_model()
    names = [p.name for p in model.get_parameters()]
    layers = model.decoder.layers
    for i in (0, 1):
        assert swap_wrapper(layers[i].mlp) is layers[i].mlp
        SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
    with pytest.raises(ValueError, match="remove_swap_wrapper"):
        swap_wrapper(layers[0].mlp)
    assert [p.name for p in model.get_parameters()] == names
    out, snaps = train(model, report=SwapManager().report)
    assert_bitwise(baseline[0], out)
    st = snaps[-1]["layers"][SwapManager().key_of(layers[1])]
    assert st["offloaded_bytes"] == 4 * BATCH * SEQ * 16 * HIDDEN   # the region's input stays: 16h, not 17h
    assert st["on_demand_bytes"] == 0
    for i in (0, 1):
        assert remove_swap_wrapper(layers[i].mlp)
        assert "construct" not in layers[i].mlp.__dict__


def test_swap_functional_with_policy():
    class Net(nn.Cell):
        def __init__(self, use_swap):
            super().__init__()
            self.fc1 = nn.Dense(16, 64)
            self.fc2 = nn.Dense(64, 16)
            self.use_swap = use_swap

        def block(self, x):
            return self.fc2(ops.tanh(self.fc1(x)))

        def construct(self, x):
            y = swap(self.block, x, policy_fn=policy) if self.use_swap else self.block(x)
            return (y * y).sum()

    seen = []

    def policy(t):
        seen.append(t.shape)
        return CheckpointPolicy.MUST_SWAP if t.nbytes >= 2048 else CheckpointPolicy.MUST_SAVE

    x = Tensor(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    grads = []
    for use in (False, True):
        ms.set_seed(0)
        net = Net(use)
        grads.append(ms.value_and_grad(net, None, net.trainable_params())(x))
    assert np.array_equal(grads[0][0].asnumpy(), grads[1][0].asnumpy())
    for a, b in zip(grads[0][1], grads[1][1]):
        assert np.array_equal(a.asnumpy(), b.asnumpy())
    assert [tuple(s) for s in seen] == [(8, 64)]     # params, region inputs and duplicates never reach the policy
    st = SwapManager().report.layers["swap:block"]
    assert st.offloaded_bytes == 8 * 64 * 4 and st.on_demand_bytes == st.offloaded_bytes
    assert st.kept_reasons["input"] >= 1


def test_async_save_on_cpu_exact(baseline):
    model = make_model()
    decoder = model.decoder
    n = len(decoder.layers)

    def construct(x, attention_mask):
        for i, layer in enumerate(decoder.layers):
            with async_save_on_cpu(block_idx=i, depth=n, params=model,
                                   custom_check_fn=lambda t: t.nbytes >= 1024):
                x = layer(x, attention_mask)
        return decoder.final_layernorm(x)

    decoder.construct = construct
    out, snaps = train(model, report=SwapManager().report)
    del decoder.construct
    assert_bitwise(baseline[0], out)
    snap = snaps[-1]
    assert snap["layers"][("async_save_on_cpu", 0)]["prefetched_bytes"] > 0
    assert snap["layers"][("async_save_on_cpu", n - 1)]["offloaded_bytes"] == 0   # last block kept
    assert ("prefetch", ("async_save_on_cpu", 0), ("async_save_on_cpu", 1)) in snap["events"]


# --- pool, memory flatness, threads -------------------------------------------------------

def test_pool_bound_keeps_overflow_on_device(baseline):
    model = make_model()
    bound = 64 * 1024
    inst = install_layer_swap(model.decoder.layers, [0, 1], prefetch=1, model=model, max_pool_bytes=bound)
    out, snaps = train(model, report=inst.report)
    assert_bitwise(baseline[0], out)
    snap = snaps[-1]
    assert snap["pool_peak_bytes"] <= bound and snap["pool_refusals"] > 0
    assert snap["over_budget_bytes"] > 0 and snap["offloaded_bytes"] > 0
    inst.remove()


def test_pool_reuse_and_bound_unit():
    pool = HostBufferPool(lambda n: bytearray(n), max_bytes=100)
    a = pool.acquire(60)
    assert pool.acquire(60) is None                  # would pass the bound: refused, counted
    pool.release(a, 60)
    assert pool.acquire(60) is a                     # reused, not reallocated
    pool.release(a, 60)
    b = pool.acquire(80)                             # evicts the idle 60-byte buffer to fit
    assert b is not None and pool.total_bytes == 80
    assert pool.stats()["pool_refusals"] == 1


def test_aliased_buffers_are_reused_only_after_the_fence():
    fences = []
    pool = HostBufferPool(lambda n: bytearray(n), fence=lambda: fences.append(len(fences)))
    a = pool.acquire(64)
    pool.release_later(a, 64)           # a loaded tensor may alias it while kernels are queued
    assert pool.stats()["pool_deferred_bytes"] == 64 and pool.in_use_bytes == 0 and fences == []
    assert pool.acquire(64) is a        # reused, but only after the fence ran
    assert fences == [0] and pool.stats()["pool_deferred_bytes"] == 0
    pool.release(a, 64)
    pool.acquire(64)
    assert fences == [0]                # nothing deferred: no fence


def test_host_loads_alias_the_pool_buffer():
    ex = SwapExecutor()
    t = Tensor(np.arange(256, dtype=np.float32))
    h = ex.offload(t, key="k")
    loaded = ex.load(h)
    assert np.array_equal(loaded.asnumpy(), t.asnumpy())
    assert np.shares_memory(loaded.asnumpy(), h._ticket.host)   # no copy back on CPU
    assert ex.pool.in_use_bytes == 1024                         # the handle still owns the buffer
    del h
    gc.collect()
    assert ex.pool.stats()["pool_deferred_bytes"] == 1024       # given back, behind the fence
    ex.close()


@pytest.mark.slow
def test_hundred_steps_flat_and_no_leaks(monkeypatch):
    # Every copy through the worker thread (this model's tensors are all small enough to be copied
    # inline otherwise), so the thread checks below see the worker start and stop.
    monkeypatch.setattr(HostCopyBackend, "SYNC_BYTES", 0)
    threads = threading.active_count()
    model = build_gpt(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64, dropout=0.1)
    inst = install_layer_swap(model.decoder.layers, [0], prefetch=1, model=model)
    tokens, labels = synthetic_batch(BATCH, 16, 64, seed=1)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    snaps = []
    for _ in range(100):
        grad_fn(tokens, labels)
        snaps.append(inst.report.end_step())
    steady = snaps[2:]
    assert len({s["pool_bytes"] for s in steady}) == 1
    assert len({s["pool_allocations"] for s in steady}) == 1
    assert len({s["peak_resident_bytes"] for s in steady}) == 1
    assert all(s["live_resident_bytes"] == 0 and s["pool_in_use_bytes"] == 0 for s in steady)
    assert len(inst.report.history) <= 8
    assert threading.active_count() == threads + 1   # the copy worker
    inst.remove()
    assert threading.active_count() == threads
    # without remove(): dropping the model and the handle stops the worker too
    inst = install_layer_swap(model.decoder.layers, [0], prefetch=1)
    grad_fn(tokens, labels)
    assert threading.active_count() == threads + 1
    del inst, model, grad_fn
    gc.collect()
    assert threading.active_count() == threads


# --- executor interface and in-place detection -------------------------------------------

def test_executor_roundtrip_and_over_budget():
    ex = SwapExecutor(max_pool_bytes=4096)
    t = Tensor(np.arange(512, dtype=np.float32))
    h = ex.offload(t, key="k")
    assert not h.on_device
    assert np.array_equal(ex.load(h).asnumpy(), t.asnumpy())
    big = Tensor(np.ones(2048, np.float32))
    hb = ex.offload(big, key="k")                   # 8 KiB > bound: stays on the device
    assert hb.on_device and ex.load(hb) is big
    assert ex.report.layers["k"].over_budget_bytes == big.nbytes
    ex.close()


@pytest.mark.parametrize("n", [1024, 64 * 1024], ids=["copied_inline", "copied_on_worker"])
@pytest.mark.parametrize("dtype_known", [False, True], ids=["first_of_dtype", "raw_bytes"])
def test_inplace_modification_after_offload_raises_at_load(n, dtype_known):
    ex = SwapExecutor()
    if dtype_known:   # later tensors of a dtype are read through their address, not asnumpy()
        ex.load(ex.offload(Tensor(np.zeros(4, np.float32))))
    t = Tensor(np.ones(n, np.float32))
    h = ex.offload(t)
    t[n - 1] = 5.0
    with pytest.raises(RuntimeError, match="modified in place"):
        ex.load(h)
    ex.close()


def test_offload_of_non_contiguous_and_other_dtypes_round_trips():
    ex = SwapExecutor()
    base = Tensor(np.arange(48 * 64, dtype=np.float32).reshape(48, 64))
    for t in (base, base.transpose(1, 0), base[8:40], Tensor(np.arange(3000, dtype=np.int32)),
              Tensor(np.arange(3000, dtype=np.float16).reshape(30, 100)).transpose(1, 0)):
        for _ in range(2):   # the first of a dtype through asnumpy(), then through the address
            loaded = ex.load(ex.offload(t))
            assert loaded.shape == t.shape and loaded.dtype == t.dtype
            assert np.array_equal(loaded.asnumpy(), t.asnumpy())
    ex.close()


@pytest.mark.parametrize("n", [1024, 64 * 1024], ids=["copied_inline", "split_with_worker"])
@pytest.mark.parametrize("dtype_known", [False, True], ids=["first_of_dtype", "raw_bytes"])
def test_host_copy_is_taken_when_the_offload_finishes(n, dtype_known):
    """The host backend copies at the group's close: an in-place write inside the layer's forward is in
    the copy (as backward reads it without swap), and nothing is compared."""
    ex = SwapExecutor()
    if dtype_known:
        ex.load(ex.offload(Tensor(np.zeros(4, np.float32))))
    t = Tensor(np.ones(n, np.float32))
    h = ex.start_offload(t, key="k")
    t[n - 1] = 5.0
    t[0] = -1.0
    ex.finish_offload(h)
    loaded = ex.load(h).asnumpy()
    assert loaded[0] == -1.0 and loaded[-1] == 5.0 and np.array_equal(loaded, t.asnumpy())
    ex.close()


@pytest.mark.slow
def test_inplace_modification_in_forward_matches_no_swap_subprocess():
    """A saved tensor written in place later in the same layer's forward: with the host backend the
    gradients are bitwise those of the same model without swap (the copy is taken at the layer's end)."""
    proc = run_isolated("""
        import numpy as np
        from mindformers_ac.harness.models import build_gpt, synthetic_batch
        from mindformers_ac.swap import install_layer_swap
        def grads(swap):
            m = build_gpt(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64, dropout=0.0)
            mlp = m.decoder.layers[0].mlp
            def construct(x):
                h = mlp.linear_fc1(x)
                g = mlp.activation_func(h)     # saves h for backward ...
                h[0] = 7.0                     # ... and writes it in place afterwards
                return mlp.linear_fc2(g)
            mlp.construct = construct
            if swap:
                report = install_layer_swap(m.decoder.layers, [0], prefetch=1, model=m).report
            tokens, labels = synthetic_batch(2, 16, 64)
            out = [g.asnumpy() for g in ms.value_and_grad(m, None, m.trainable_params())(tokens, labels)[1]]
            if swap:
                print("offloaded", report.layers[0].offloaded_bytes)
            return out
        base, swapped = grads(False), grads(True)
        print("EQUAL", all(np.array_equal(a, b) for a, b in zip(base, swapped)))
    """)
    assert "EQUAL True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    offloaded = int(proc.stdout.split("offloaded ")[1].split()[0])
    assert offloaded > 0


def test_install_errors_leave_model_untouched():
    model = make_model()
    before = hook_counts(model)
    with pytest.raises(ValueError, match="lower the prefetch"):
        install_layer_swap(model.decoder.layers, [0, 2], prefetch=1)
    with pytest.raises(ValueError, match="sub-cells of this layer"):
        install_op_swap(model.decoder.layers[0], ["mlp", "no_such_cell"])
    assert hook_counts(model) == before


def test_swap_tensor_wrapper_outside_group_is_noop(caplog):
    t = Tensor(np.ones(4, np.float32))
    with caplog.at_level("WARNING", logger="mindformers_ac"):
        assert swap_tensor_wrapper(t) is t
    assert "outside a swap group" in caplog.text


# --- device backend scheduling (fake runtime) ---------------------------------------------

class _FakeRuntime:
    """Records stream/event calls in order: the CPU build has no streams, events or pinned memory."""

    def __init__(self):
        self.log = []
        self._n = 0
        self.compute = self.Stream("compute")
        self._current = [self.compute]

    def _name(self, prefix):
        self._n += 1
        return f"{prefix}{self._n}"

    def Stream(self, name=None):  # noqa: N802  (mirrors mindspore.runtime.Stream)
        rt = self

        class S:
            def __init__(self):
                self.name = name or rt._name("stream")

            def wait_event(self, ev):
                rt.log.append(("wait", self.name, ev.name))
        return S()

    def Event(self):  # noqa: N802
        rt = self

        class E:
            def __init__(self):
                self.name = rt._name("ev")

            def record(self, stream):
                rt.log.append(("record", self.name, stream.name))

            def query(self):
                return True

            def synchronize(self):
                rt.log.append(("sync", self.name))
        return E()

    @contextlib.contextmanager
    def StreamCtx(self, stream):  # noqa: N802
        self._current.append(stream)
        yield
        self._current.pop()

    def current_stream(self):
        return self._current[-1]


class _FakeOps:
    def __init__(self, rt):
        self.rt = rt

    def empty_pinned(self, nbytes):
        self.rt.log.append(("pin", nbytes))
        return np.empty(nbytes, np.uint8)

    def copy_to_host(self, src, buf, nbytes):
        self.rt.log.append(("d2h", self.rt.current_stream().name))
        dst = buf[:nbytes].view(np.float32)
        dst[:] = src.asnumpy().reshape(-1)
        return dst

    def copy_to_device(self, host):
        self.rt.log.append(("h2d", self.rt.current_stream().name))
        return Tensor(host.copy())


def test_device_backend_stream_event_order():
    rt = _FakeRuntime()
    backend = DeviceCopyBackend(runtime=rt, ops=_FakeOps(rt))
    ex = SwapExecutor(backend=backend)
    d2h, h2d = backend.d2h_stream.name, backend.h2d_stream.name
    assert d2h != h2d != "compute"
    t = Tensor(np.arange(256, dtype=np.float32))
    for step in range(2):
        rt.log.clear()
        h = ex.start_offload(t, key="L")
        ex.finish_offload(h)   # no SavedStorage (no group): the test holds ``t``, which would be served
        ex.prefetch(h)
        out = ex.load(h)
        assert np.array_equal(out.asnumpy(), t.asnumpy())
        log = rt.log
        if step == 0:
            assert log.pop(0) == ("pin", 1024)      # pinned buffer allocated once ...
        ev = [e[1] for e in log if e[0] == "record"]
        assert log == [
            ("record", ev[0], "compute"),           # producer done on the compute stream
            ("wait", d2h, ev[0]),                   # copy stream waits for it
            ("d2h", d2h),                           # non-blocking copy on the copy stream
            ("record", ev[1], d2h),
            ("wait", "compute", ev[1]),             # memory reuse on compute waits for the copy
            ("wait", h2d, ev[1]),                   # H2D reads a complete host buffer
            ("h2d", h2d),
            ("record", ev[2], h2d),
            ("wait", "compute", ev[2]),             # backward reads only after the H2D copy
            ("sync", ev[2]),                        # pinned buffer back to the pool after the copy
        ]
    assert ex.pool.stats()["pool_allocations"] == 1  # ... and reused in the next step
    ex.close()


class _Square(nn.Cell):
    """Saves the same storage twice for backward (both inputs of the Mul are x)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(64, 64)

    def construct(self, x):
        y = self.dense(x)
        return ops.mul(y, y)


def test_one_host_copy_per_storage():
    x = Tensor(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))

    def run(with_swap):
        ms.set_seed(0)
        net = nn.SequentialCell([_Square(), _Square()])
        inst = install_layer_swap(net, [0], prefetch=1) if with_swap else None
        grads = ms.value_and_grad(lambda t: net(t).sum(), None, net.trainable_params())(x)
        return grads, inst
    (base_loss, base_grads), _ = run(False)
    (loss, grads), inst = run(True)
    assert np.array_equal(base_loss.asnumpy(), loss.asnumpy())
    assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(base_grads, grads))
    st = inst.report.end_step()["layers"][0]
    assert st["dedup_hits"] >= 1                       # y was packed twice, copied once
    assert st["offloaded_bytes"] == 8 * 64 * 4         # one host copy of y; x is the layer input
    inst.remove()


# --- failure paths: what a call that raised leaves behind ------------------------------------

class _Raises(nn.Cell):
    def __init__(self):
        super().__init__()
        self.exc = None

    def construct(self, x):
        if self.exc is not None:
            raise self.exc("injected")
        return x * 2


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt, SystemExit])
def test_bracket_calls_tells_leave_the_call_failed_and_keeps_the_original_error(exc, caplog):
    from mindformers_ac.construct_patch import bracket_calls

    cell, seen = _Raises(), []

    def leave(state, failed):
        seen.append((state, failed))
        raise ValueError("cleanup broke")

    patch = bracket_calls(cell, "test_bracket", lambda args, kwargs: "state", leave)
    x = Tensor(np.ones(2, np.float32))
    cell.exc = exc
    with caplog.at_level("WARNING", logger="mindformers_ac"), pytest.raises(exc, match="injected"):
        cell(x)   # the cleanup's own error is logged, the original one propagates
    assert seen == [("state", True)] and "cleanup of test_bracket" in caplog.text
    cell.exc = None
    with pytest.raises(ValueError, match="cleanup broke"):
        cell(x)   # after a successful call the cleanup's error is the error
    assert seen[-1] == ("state", False)
    patch.remove()
    assert "construct" not in cell.__dict__


def test_failed_swap_group_closes_groups_opened_inside_and_is_not_prefetched():
    from mindspore.graph.api import _pynative_executor

    from mindformers_ac.swap.scheduler import SwapScheduler

    sched = SwapScheduler(min_bytes=0)
    for key in ("outer", "inner", "ok"):
        sched.mark_prefetchable(key)
    t = Tensor(np.arange(256, dtype=np.float32))
    ok = sched.open_group("ok")
    held = [sched._pack(t)]   # pylint: disable=protected-access  # an offload, as autograd's pack makes
    sched.close_group(ok)
    assert sched.prefetch("ok") == 1   # a group that closed normally waits for its prefetch
    outer = sched.open_group("outer")
    held.append(sched._pack(t))   # pylint: disable=protected-access
    inner = sched.open_group("inner")
    held.append(sched._pack(t + 1))   # pylint: disable=protected-access
    sched.close_group(outer, failed=True)   # inner's exit was skipped by the failure: closed here too
    assert sched.current_group() is None and not _pynative_executor.is_saved_tensor_hook_active()
    assert sched.prefetch("outer") == 0 and sched.prefetch("inner") == 0   # abandoned, nothing will unpack them
    sched.close_group(inner, failed=True)   # a late close of an abandoned group does nothing
    a = sched.open_group("a")
    b = sched.open_group("b")
    with pytest.raises(RuntimeError, match="closed out of order"):
        sched.close_group(a)   # a normal close still checks nesting
    sched.close_group(b)
    sched.close_group(a)
    sched.close()
    del held


# --- contracts: the backend Protocol and the handle's state machine ------------------------------

def _assert_satisfies(obj, protocol):
    """``obj`` is an instance of the runtime-checkable ``protocol`` and every method of it can be called as the
    Protocol's callers call it: its positional parameters by position, any extra parameter with a default."""
    import inspect

    from mindformers_ac.swap.backends import protocol_members

    assert isinstance(obj, protocol), type(obj).__name__
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for name in protocol_members(protocol):
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {name}"
        spec = getattr(protocol, name, None)
        if not callable(spec):
            continue
        want = list(inspect.signature(spec).parameters.values())[1:]          # without self
        assert all(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in want)
        have = list(inspect.signature(getattr(obj, name)).parameters.values())
        takes = [p for p in have if p.kind in positional]
        where = f"{type(obj).__name__}.{name}{inspect.signature(getattr(obj, name))}"
        assert len(takes) >= len(want) or any(p.kind is p.VAR_POSITIONAL for p in have), where
        assert all(p.default is not inspect.Parameter.empty for p in takes[len(want):]), where
        assert all(p.default is not inspect.Parameter.empty for p in have if p.kind is p.KEYWORD_ONLY), where


def test_backends_and_the_fake_runtime_satisfy_their_protocols():
    from mindformers_ac.swap.backends import DeviceOps, DeviceRuntime, PendingLoad, SwapBackend

    rt = _FakeRuntime()
    host, device = HostCopyBackend(), DeviceCopyBackend(runtime=rt, ops=_FakeOps(rt))
    for backend in (host, device):
        _assert_satisfies(backend, SwapBackend)
    _assert_satisfies(rt, DeviceRuntime)
    _assert_satisfies(_FakeOps(rt), DeviceOps)
    t = Tensor(np.arange(256, dtype=np.float32))
    for backend in (host, device):   # what start_h2d returns is a PendingLoad too
        buf = backend.alloc_host(1024)
        _assert_satisfies(backend.start_h2d(backend.start_d2h(t, buf, 1024)), PendingLoad)
    host.close()


def test_a_backend_missing_a_member_is_refused_by_name():
    from mindformers_ac.swap.backends import SwapBackend

    class Partial:
        name, loads_alias_host = "partial", False

        def alloc_host(self, nbytes):
            return bytearray(nbytes)

    with pytest.raises(TypeError, match="lacks .*start_d2h"):
        SwapExecutor(backend=Partial())
    assert not isinstance(Partial(), SwapBackend)


def test_handle_state_transitions():
    from mindformers_ac.swap.executor import HandleState

    ex = SwapExecutor()
    t = Tensor(np.arange(256, dtype=np.float32))
    h = ex.start_offload(t, key="k")
    assert h.state is HandleState.COPYING
    ex.finish_offload(h)   # no SavedStorage (no group): the test holds ``t``, which would be served (W6s)
    assert h.state is HandleState.OFFLOADED and not h.on_device and not h.prefetched
    assert ex.prefetch(h) and h.state is HandleState.LOADING and h.prefetched
    assert not ex.prefetch(h)                                   # already loading: no second load
    loaded = ex.load(h)
    assert h.state is HandleState.LOADED and ex.load(h) is loaded   # the host backend's buffer stays with it
    h.drop_loaded()
    with pytest.raises(RuntimeError, match="loaded in state released"):
        ex.load(h)                                              # unpacked more often than packed
    with pytest.raises(RuntimeError, match="cannot start an offload in state released"):
        h.start_offload(None, t, None, None)
    over = SwapExecutor(max_pool_bytes=0).offload(t, key="k")    # the pool refuses it: never leaves the device
    assert over.state is HandleState.KEPT and over.on_device
    ex.close()
