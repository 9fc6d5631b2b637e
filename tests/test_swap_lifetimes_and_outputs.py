"""Swap on what users' layers return (dicts, nested lists) and on models that come and go.

* prefetch fires whatever tuples, lists and dicts the trigger layer's output
  nests; an output the engine can't hook (any other object: its attributes are
  not searched, issue 49) is reported once in the log, and stays exact;
* ``SwapManager().set_forward_prefetch_layer`` holds layers weakly: a model
  dropped without ``reset()`` is freed, and its weights leave the scheduler;
* nothing of a step stays reachable or reusable after it (issue 41): a graph
  something keeps alive (a logging window of attached aux losses) keeps no
  host buffer, group, scheduler or executor, and a loaded tensor that outlives its step
  (a class-level scaler keeps what its backward saved) keeps its host buffer,
  which the pool never hands to a later offload. Over 103 steps and with a
  plain model after it: ``test_three_runs.py``.
"""
import gc
import logging
import weakref

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.swap.backends import HostBufferPool, HostCopyBackend
from mindformers_ac.swap.executor import SwapExecutor

from model_patterns import AUX_LOG, PATTERNS, KeepingAuxScaler
from steps import first_difference, run_steps

H, B, S, N = 32, 2, 8, 3


class Holder:
    """An output object the engine does not search: its attributes are slots, no instance ``__dict__`` (its
    tensor can't be hooked)."""

    __slots__ = ("hidden",)

    def __init__(self, hidden):
        self.hidden = hidden


class Box:
    """A custom output object with an instance ``__dict__``: not searched either (issue 49: no object walk)."""

    def __init__(self, hidden):
        self.hidden = hidden


def pack(kind, h):
    if kind == "dict":
        return {"hidden": h, "aux": h * 0.5}
    if kind == "nested":
        return [{"stack": (h * 0.5, [h])}]
    if kind == "box":
        return Box(h)
    return Holder(h)


def unpack(kind, out):
    if kind == "dict":
        return out["hidden"] + out["aux"]
    if kind == "nested":
        inner = out[0]["stack"]
        return inner[0] + inner[1][0]
    return out.hidden


class StructLayer(nn.Cell):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc1 = mint.nn.Linear(H, 4 * H)
        self.fc2 = mint.nn.Linear(4 * H, H)

    def construct(self, x):
        return pack(self.kind, x + self.fc2(ops.tanh(self.fc1(x))))


class StructModel(nn.Cell):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.layers = nn.CellList([StructLayer(kind) for _ in range(N)])
        for name, p in self.parameters_and_names():
            p.set_data(Tensor(np.random.RandomState(len(name)).uniform(-0.2, 0.2, p.shape).astype(np.float32)))

    def construct(self, x, y):
        for layer in self.layers:
            x = unpack(self.kind, layer(x))
        return ((x.sum(-1) - y) ** 2).mean()


def batch(step):
    rng = np.random.RandomState(step)
    return Tensor(rng.randn(B, S, H).astype(np.float32)), Tensor(rng.randn(B, S).astype(np.float32))


SWAP = {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}}


@pytest.mark.parametrize("kind", ["dict", "nested"])
def test_prefetch_fires_on_dict_and_nested_outputs(caplog, kind):
    base = run_steps(StructModel(kind), batch, steps=1)
    model = StructModel(kind)
    mac.apply_ac(model, config=SWAP)
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        assert first_difference(base, run_steps(model, batch, steps=1)) is None
    report = mac.ac_state(model).swap_report.as_dict()
    assert report["num_offloaded"] > 0
    assert report["prefetched_bytes"] + report["late_bytes"] == report["offloaded_bytes"]
    assert report["on_demand_bytes"] == 0
    assert {e[1] for e in report["events"] if e[0] == "prefetch"} == {0, 1}
    assert "can't be triggered" not in caplog.text
    mac.remove_ac(model)


@pytest.mark.parametrize("kind, cls", [("object", "Holder"), ("box", "Box")])
def test_output_the_engine_cannot_hook_is_reported_once_and_stays_exact(caplog, kind, cls):
    base = run_steps(StructModel(kind), batch)
    model = StructModel(kind)
    mac.apply_ac(model, config=SWAP)
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        assert first_difference(base, run_steps(model, batch)) is None
    messages = [r.getMessage() for r in caplog.records if "can't be triggered" in r.getMessage()]
    # one per trigger (layers 1 and 2), not one per step
    assert len(messages) == 2 and all(cls in m for m in messages), messages
    report = mac.ac_state(model).swap_report.as_dict()
    assert report["num_offloaded"] > 0 and report["on_demand_bytes"] == report["offloaded_bytes"]
    mac.remove_ac(model)


def test_prefetch_layer_links_do_not_keep_dropped_models():
    mgr = mac.SwapManager()
    mgr.reset()
    refs = []
    try:
        for seed in range(4):
            model = build_gpt(num_layers=3, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64,
                              dropout=0.0, seed=seed)
            layers = model.decoder.layers
            for i in (0, 1):
                mgr.set_forward_prefetch_layer(layers[i], layers[i + 1])
            assert mgr.key_of(layers[0]) is not None
            grad_fn = ms.value_and_grad(model, None, model.trainable_params())
            grad_fn(*synthetic_batch(2, 16, 64, seed=seed))
            refs.append(weakref.ref(model))
            weights = len(mgr.scheduler.param_ptrs)
            del model, layers, grad_fn
        gc.collect()
        assert [r() for r in refs] == [None] * 4
        assert len(mgr._links) == 0   # pylint: disable=protected-access
        mgr.scheduler.weights.refresh()
        assert len(mgr.scheduler.param_ptrs) < weights    # the dropped models' weights left the set
    finally:
        mgr.reset()


# -- issue 41: nothing of a step after it -------------------------------------------------------------

def test_the_pool_gives_up_a_buffer_a_tensor_still_aliases_instead_of_reusing_it():
    aliased = set()
    pool = HostBufferPool(lambda n: bytearray(n), aliased=lambda buf: id(buf) in aliased)
    a = pool.acquire(64)
    aliased.add(id(a))
    pool.release_later(a, 64)
    b = pool.acquire(64)
    assert b is not a                                   # still read by a tensor: never handed out again
    stats = pool.stats()
    assert (stats["pool_disowned"], stats["pool_disowned_bytes"], stats["pool_bytes"]) == (1, 64, 64)
    pool.release_later(b, 64)
    assert pool.acquire(64) is b                        # nothing aliases this one: reused
    assert pool.stats()["pool_disowned"] == 1


def test_host_backend_sees_a_loaded_tensor_alias_its_buffer():
    buf = HostCopyBackend.alloc_host(1024)
    assert not HostCopyBackend.aliased(buf)
    loaded = Tensor.from_numpy(buf[0].view(np.float32).reshape(16, 16))   # what a load returns
    assert HostCopyBackend.aliased(buf)
    del loaded
    assert not HostCopyBackend.aliased(buf)


@pytest.mark.parametrize("keep", [True, False])
def test_a_loaded_tensor_kept_past_its_step_keeps_its_values(keep):
    ex = SwapExecutor()
    t = Tensor(np.arange(256, dtype=np.float32))
    h = ex.offload(t, key="k")
    loaded = ex.load(h)
    buffer = h._buf
    h.drop_loaded()                                     # the last unpack: the buffer goes back now
    assert h._buf is None and h.ticket is None and h.owner is None
    if not keep:
        del loaded
    again = ex.start_offload(Tensor(np.full(256, -1.0, np.float32)), key="k")   # the next step's offload
    assert (again._buf is buffer) is not keep
    ex.finish_offload(again)
    if keep:
        assert np.array_equal(loaded.asnumpy(), np.arange(256, dtype=np.float32))
        assert ex.pool.stats()["pool_disowned"] == 1
    ex.close()


@pytest.mark.usefixtures("fresh_swap_manager")
def test_a_graph_kept_past_its_step_keeps_no_swap_state_and_stays_exact():
    pattern = PATTERNS["kept_graph_moe"]
    AUX_LOG.clear()
    baseline = run_steps(pattern.build(), pattern.batch, steps=3)
    model = pattern.build()
    mac.apply_ac(model, config={"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}})
    executor, report = weakref.ref(mac.ac_state(model).swap_executor), mac.ac_state(model).swap_report
    history = run_steps(model, pattern.batch, steps=3)
    assert first_difference(baseline, history) is None
    stats = report.as_dict()
    assert stats["pool_disowned"] > 0                   # the scaler kept a loaded tensor: its buffer went with it
    assert stats["pool_in_use_bytes"] == 0              # every handle gave its buffer back at its unpack
    assert len(AUX_LOG) == 18 and KeepingAuxScaler.previous is not None   # the graphs are still alive
    mac.remove_ac(model)
    del model, history
    gc.collect()
    assert executor() is None                           # the kept graphs hold no executor, scheduler or pool
