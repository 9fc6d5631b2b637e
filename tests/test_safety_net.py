"""The safety net (issue 49, point 1): a re-run that computes other values than its forward raises on the
first backward that meets it, naming the region's cell path and the op it checked, before any gradient
reaches the optimizer, on the intercepting path (whole re-run and early stop) and on the light path.

The planted op is one no rule knows: a cell that multiplies by a Python counter it advances on every call,
so its re-run computes another value. Each case runs in a subprocess (it fails inside backward). The whole
re-run on both paths, in every recompute mode, is the catalogue's (model_patterns' ``python_counter`` and
``python_counter_light``); here are the kept op's input on the light path and the early stop.
"""
import textwrap

import pytest

from isolated import run_isolated

_SCRIPT = """
import numpy as np
from mindspore import Tensor, nn, ops
import mindspore as ms
import mindformers_ac as mac
from mindformers_ac.recompute import RecomputeError
from model_patterns import init_weights

class Counter(nn.Cell):
    '''An op whose output depends on Python state: x times the number of calls from FROM_CALL on.'''
    def __init__(self):
        super().__init__()
        self.calls = 0

    def construct(self, x):
        self.calls += 1
        return x * float(self.calls) if self.calls >= FROM_CALL else x

class Layer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.counter = nn.Dense(8, 8), nn.Dense(8, 8), Counter()

    def construct(self, x):
        h = ops.tanh(self.counter(self.fc1(x)))
        return self.fc2(h) + TAIL * ops.sin(x)

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([Layer() for _ in range(2)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x ** 2).mean()

model = init_weights(Net())
STATS = mac.recompute.RecomputeStats()
if CONFIG is None:   # a region without a signature check: its re-run may stop early
    for layer in model.layers:
        mac.recompute.checkpoint_wrapper(layer, light_path=False, stats=STATS)
else:
    mac.apply_ac(model, config=CONFIG)
opt = nn.SGD(model.trainable_params(), learning_rate=0.1)
grad_fn = ms.value_and_grad(model, None, opt.parameters)
x = Tensor(np.random.RandomState(0).randn(2, 8).astype(np.float32))
for step in range(3):
    before = [p.asnumpy().copy() for p in model.trainable_params()]
    try:
        loss, grads = grad_fn(x)
    except RecomputeError as exc:
        same = all(np.array_equal(b, p.asnumpy()) for b, p in zip(before, model.trainable_params()))
        print("STEP", step, "UNCHANGED", same)
        print("ERROR", exc)
        break
    opt(grads)
else:
    print("NO ERROR")
stats = mac.ac_state(model).recompute_stats.values() if CONFIG is not None else [STATS]
print("PATHS", *(sum(getattr(s, name) for s in stats) for name in ("intercepted_calls", "light_calls", "early_stops")))
"""

@pytest.mark.parametrize("case, from_call, tail, config, step, path", [
    # the whole re-run on the intercepting path and on the light one (full, and every other recompute mode):
    # model_patterns' python_counter and python_counter_light patterns
    # exclude_op keeps Sin at the end: an intercepting re-run stops after tanh, its last dropped tensor
    # exclude_op keeps the matmuls at their slots (light from the second call): fc2's kept output hides the
    # counter from the region's output, the light re-run compares the kept call's input
    ("light kept", 3, 0.0, {"recompute": {"mode": "full", "full_recompute_layer": ["0-1"],
                                          "exclude_op": ["MatMul"]}}, 1, "the input of kept call #"),
    # checkpoint_wrapper(light_path=False): no signature check, the re-run stops after fc2's MatMul, which
    # saved the last dropped tensor (Sin's saved input is the layer's input, kept)
    ("early stop", 1, 1.0, None, 0, "its saved tensor #"),
])
def test_a_rerun_that_computes_other_values_raises_before_the_optimizer_step(case, from_call, tail, config,
                                                                              step, path):
    res = run_isolated(f"FROM_CALL, TAIL, CONFIG = {from_call}, {tail}, {config!r}\n" + textwrap.dedent(_SCRIPT))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"STEP {step} UNCHANGED True" in res.stdout, (case, res.stdout, res.stderr[-2000:])
    assert "computed another output than the forward" in res.stdout
    assert "in 'layers.1'" in res.stdout, res.stdout   # the region's cell path (backward meets layer 1 first)
    assert path in res.stdout.split("ERROR", 1)[1]
    paths = res.stdout.split("PATHS", 1)[1].split()
    if case in ("light", "light kept"):   # step 0 intercepted (checked), step 1 light
        assert paths[:2] == ["2", "2"], res.stdout



@pytest.mark.parametrize("on_host", [True, False], ids=["host read", "device GatherNd"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(2, 32, 64), (5,), ()])
def test_a_sample_holds_its_elements_on_the_host_and_on_a_device(on_host, dtype, shape):
    """``Sample`` reads the tensor's memory in place on the host, or gathers on a device: the same tensor
    matches, one changed sampled element or another dtype or shape does not, and the sample is a copy (a
    write into the tensor after it was taken is seen)."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, ops

    from mindformers_ac.recompute.rules.safety_net import PROBE_SIZE, Sample, SampleIndex, probed

    if dtype == "bfloat16" and not on_host:
        pytest.skip("the CPU build has no bfloat16 GatherNd (a device build has)")
    ms_dtype = getattr(ms, dtype)
    values = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1
    t = ops.cast(Tensor(values), ms_dtype)
    assert probed(t)
    index = SampleIndex(on_host=on_host)
    sample = Sample(t, index)
    assert isinstance(sample.index, int) == on_host
    assert sample.matches(ops.cast(Tensor(values.copy()), ms_dtype))
    assert not sample.matches(ops.cast(Tensor(values), ms.float64))
    assert not sample.matches(None) and Sample(None, index).matches(None)
    if shape:
        assert not sample.matches(ops.cast(Tensor(values.reshape(-1)[None]), ms_dtype))
    changed = values.copy().reshape(-1)
    changed[(changed.size // PROBE_SIZE or 1) * (min(PROBE_SIZE, changed.size) - 1)] *= 2   # the last sampled
    assert not sample.matches(ops.cast(Tensor(changed.reshape(shape)), ms_dtype))
    t.copy_(ops.cast(Tensor(changed.reshape(shape)), ms_dtype))
    assert not sample.matches(t)
