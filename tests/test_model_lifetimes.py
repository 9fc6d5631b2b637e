"""Nothing of a model's AC outlives ``remove_ac`` or the model (issue 39).

Weak references to the model, each of its cells and Parameters, its ``AcState``, every recompute region a step
created (``RegionBase`` is the base of both ways into a region), the recompute groups and counters, the swap
executor and engine, and the budget's controller and meter: after ``remove_ac`` every engine object is gone
while the model lives on; after the model is dropped everything is. The steps update the parameters with
``ops.assign``, not ``nn.SGD``, whose ``@jit`` construct keeps its optimizer cell (and every parameter it
steps) for the life of the process, with or without AC (docs/benchmarks.md, "What a model leaves behind").
RSS per model is measured by ``scripts/bench_model_lifetimes.py``.
"""
import enum
import gc
import weakref

import mindspore as ms
import pytest
from mindspore import ops

import mindformers_ac as mac
from mindformers_ac.mindspore_compat import pynative_executor
from mindformers_ac.recompute.rerun import RegionBase

from model_patterns import PATTERNS, mode_config
from steps import assert_acted

STEPS = 3
# full, layer swap and the budget in the quick set; the other modes in the slow one (the suite's time)
MODES = [mode if mode in ("full", "layer_swap", "budget") else pytest.param(mode, marks=pytest.mark.slow)
         for mode in ("full", "group", "select_op", "exclude_op", "recompute_comm", "layer_swap", "op_swap",
                      "mixed", "budget")]


def _config(mode, pattern):
    if mode == "budget":   # steps: none, none, full, then layer swap (the swap engine exists)
        return {"memory_budget": {"activations": "0.5x", "profile_steps": 4}}
    return mode_config(mode, pattern)


def _train(model, batch, steps):
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, params)
    for step in range(steps):
        _, grads = grad_fn(*batch(step))
        for p, g in zip(params, grads):
            ops.assign(p, p - 0.05 * g)


@pytest.fixture(name="regions")
def _regions(monkeypatch):
    """Weak references to every recompute region created while the test runs."""
    made = []
    init = RegionBase.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))
    monkeypatch.setattr(RegionBase, "__init__", recording_init)
    return made


def _engine_refs(model, regions):
    """Weak references to what AC made for ``model``, by name (each region, group and counter on its own)."""
    state = mac.ac_state(model)
    refs = {"state": weakref.ref(state)}
    refs.update({f"region {k}": ref for k, ref in enumerate(regions)})
    refs.update({f"recompute stats of layer {i}": weakref.ref(s) for i, s in state.recompute_stats.items()})
    for i, chain in state.chains.items():   # a LayerChain has slots and no weak reference: its own id and type
        refs[f"recompute group from layer {i}"] = _SlotsRef(chain)
    for name in ("swap_executor", "swap_engine", "budget"):
        if getattr(state, name) is not None:
            refs[name] = weakref.ref(getattr(state, name))
    if state.budget is not None:
        refs["budget meter"] = weakref.ref(state.budget.meter)
    return refs


class _SlotsRef:
    """A weak reference to an object that takes none (``__slots__`` without ``__weakref__``): called, it
    finds the object among those the collector tracks, by identity and type."""

    def __init__(self, obj):
        self._id, self._type = id(obj), type(obj)

    def __call__(self):
        return next((o for o in gc.get_objects() if id(o) == self._id and type(o) is self._type), None)


def _model_refs(model):
    refs = {f"cell {name or 'model'}": weakref.ref(cell) for name, cell in model.cells_and_names()}
    refs.update({f"parameter {p.name}": weakref.ref(p) for p in model.get_parameters()})
    return refs


def _alive(refs):
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)


def _package_objects():
    """id -> class name of every object of a mindformers_ac class the collector tracks (enum members aside:
    they live as long as their module). Slotted per-call records that take no weak reference count too."""
    found = {}
    for obj in gc.get_objects():
        kind = type(obj)   # type(), not isinstance: a dead weakref.proxy raises on isinstance
        if str(getattr(kind, "__module__", "")).startswith("mindformers_ac") and not issubclass(kind, enum.Enum):
            found[id(obj)] = kind.__qualname__
    return found


@pytest.fixture(name="package_objects_before")
def _package_objects_before():
    gc.collect()
    return _package_objects()


def _new_package_objects(before):
    gc.collect()
    return sorted(name for key, name in _package_objects().items() if key not in before)


def _trained(mode, regions):
    pattern = PATTERNS["int_bool_inputs" if mode == "budget" else "nested_lists"]
    model = pattern.build()
    mac.apply_ac(model, config=_config(mode, pattern))
    _train(model, pattern.batch, steps=4 if mode == "budget" else STEPS)
    refs = _engine_refs(model, regions)
    if mode == "budget":
        assert "swap_executor" in refs and "swap_engine" in refs
    else:
        assert_acted(mode, model, None)
    return model, pattern, refs


@pytest.mark.parametrize("mode", MODES)
def test_nothing_of_ac_outlives_remove_ac(mode, regions, package_objects_before):
    model, pattern, refs = _trained(mode, regions)
    mac.remove_ac(model)
    assert _alive(refs) == []
    _train(model, pattern.batch, steps=1)   # the model lives on, without AC: nothing is made again
    assert mac.ac_state(model) is None and _alive(refs) == []
    assert _new_package_objects(package_objects_before) == []
    refs = _model_refs(model)
    del model
    assert _alive(refs) == []


@pytest.mark.parametrize("mode", MODES)
def test_nothing_of_the_model_or_its_ac_outlives_the_model(mode, regions, package_objects_before):
    model, _, refs = _trained(mode, regions)
    refs.update(_model_refs(model))
    del model
    assert _alive(refs) == []
    assert _new_package_objects(package_objects_before) == []


@pytest.mark.parametrize("steps_before", [0, 3])   # 0: the signature's checking call; 3: the light path
@pytest.mark.parametrize("mode", ["full", "select_cell", "exclude_op", "mixed"])
def test_a_model_dropped_between_forward_and_backward_leaves_nothing(mode, steps_before, regions,
                                                                     package_objects_before):
    """A forward whose backward never runs (the loop stopped, an exception), then the executor cleared (the failure
    path of docs/exactness.md, as without AC): the model and its AC are freed. ``exclude_op`` and ``mixed`` keep
    a Softmax: a region's pack hook that handed MindSpore the op's own output back closed a loop inside
    MindSpore (the op's node -> its saved output -> the node) that only backward breaks, and kept the model for
    good; it hands an alias cut from autograd now."""
    pattern = PATTERNS["nested_lists"]
    model = pattern.build()
    mac.apply_ac(model, config=mode_config(mode, pattern))
    _train(model, pattern.batch, steps=steps_before)
    params = model.trainable_params()
    loss, vjp_fn = ms.vjp(model, *pattern.batch(steps_before), weights=params)
    refs = _engine_refs(model, regions)
    refs.update(_model_refs(model))
    del model, params, loss, vjp_fn
    pynative_executor.clear_res()
    assert _alive(refs) == []
    assert _new_package_objects(package_objects_before) == []


def _alive_with_a_kept_loss(config, regions):
    """Names of the model's cells and Parameters alive after the model is dropped while the losses of its
    later steps are kept (a logging list)."""
    pattern = PATTERNS["nested_lists"]
    model = pattern.build()
    if config is not None:
        mac.apply_ac(model, config=config)
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, params)
    losses = []
    for step in range(3):   # the first call checks the signature; the later ones take the light path
        loss, grads = grad_fn(*pattern.batch(step))
        for p, g in zip(params, grads):
            ops.assign(p, p - 0.05 * g)
        if step > 0:
            losses.append(loss)
    if config is not None:
        assert regions and regions[-1]() is not None   # the last loss still refers to its regions
    refs = _model_refs(model)
    del model, params, grad_fn, loss, grads
    return _alive(refs)


def test_a_loss_kept_past_its_step_does_not_keep_the_model(regions, package_objects_before):
    """The loss of a step still refers to its graph, and so to the regions that packed tensors there: a light
    region lets go of its function, Parameters and signature check after its recompute, so a dropped model
    whose losses are kept keeps no more of itself alive than without AC (MindSpore's graph keeps a Parameter
    it read); the losses keep only small records until they go."""
    without_ac = _alive_with_a_kept_loss(None, regions)
    assert not any(name.startswith("cell") for name in without_ac)
    assert _alive_with_a_kept_loss(mode_config("full", PATTERNS["nested_lists"]), regions) == without_ac
    assert _new_package_objects(package_objects_before) == []
