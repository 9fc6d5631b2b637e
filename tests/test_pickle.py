"""``pickle`` of a model with AC: refused, in every AC mode, with an error that names ``remove_ac``; the model
is left as it was (it trains on, bitwise), and once ``remove_ac`` (or ``unwrap`` / ``remove_swap_wrapper``)
has run it pickles as the model without AC does, and the unpickled model trains bitwise like the original.

MindSpore 2.10's primitive ops don't pickle (``cannot pickle 'LayerNorm' object``), so a model holding one
(every model of the catalogue, the reference GPT) does not pickle without AC either; the catalogue's LLaMA
shows that the refusal comes first, with its message, in every mode of ``apply_ac`` (the wrappers, on
layers, are refused where pickling reaches them: on the functional model). The round trip after ``remove_ac`` runs
on a model of parameters and functional ops only, which pickles.
"""
import copy
import pickle

import numpy as np
import pytest
from mindspore import Parameter, Tensor, mint, nn

import mindformers_ac as mac

from model_patterns import API_MODES, MODES, PATTERNS, mode_config
from steps import first_difference, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")

BUDGET = {"memory_budget": {"activations": "0.5x", "profile_steps": 3}}
WRAPPERS = ("checkpoint_wrapper", "swap_wrapper")


def _layers(model):
    return model.model.layers if hasattr(model, "model") else model.layers


def _apply(mode, model, config):
    if mode == "checkpoint_wrapper":
        for layer in _layers(model):
            mac.checkpoint_wrapper(layer)
    elif mode == "swap_wrapper":
        for layer in _layers(model)[:-1]:
            mac.swap_wrapper(layer)
    else:
        mac.apply_ac(model, config=config, layers="model.layers" if hasattr(model, "model") else "layers")


def _remove(mode, model):
    if mode == "checkpoint_wrapper":
        for layer in _layers(model):
            mac.unwrap(layer)
    elif mode == "swap_wrapper":
        for layer in _layers(model)[:-1]:
            mac.remove_swap_wrapper(layer)
    else:
        mac.remove_ac(model)


def _assert_refused(model):
    with pytest.raises(pickle.PicklingError, match=r"call mindformers_ac\.remove_ac\(model\)") as err:
        pickle.dumps(model)
    assert "can't pickle" in str(err.value) and "apply_ac again after loading" in str(err.value)
    changed = [layer for layer in _layers(model) if "__reduce_ex__" in layer.__dict__]
    for layer in changed:   # a layer alone is refused just the same where AC changed it
        with pytest.raises(pickle.PicklingError, match="remove_ac"):
            pickle.dumps(layer)


LLAMA = PATTERNS["llama"]
LLAMA_MODES = tuple(m for m in MODES if m not in API_MODES and (LLAMA.modes is None or m in LLAMA.modes))


@pytest.mark.parametrize("mode", LLAMA_MODES + ("memory_budget",))
def test_every_mode_refuses_pickle_naming_remove_ac_and_trains_on(mode):
    plain, model = LLAMA.build(), LLAMA.build()
    _apply(mode, model, BUDGET if mode == "memory_budget" else mode_config(mode, LLAMA))
    assert first_difference(run_steps(plain, LLAMA.batch, steps=1), run_steps(model, LLAMA.batch, steps=1)) is None
    _assert_refused(model)
    for _, cell in model.cells_and_names():   # a shallow copy asks the same method: it is not refused
        if "__reduce_ex__" in cell.__dict__:
            dup = copy.copy(cell)
            assert type(dup) is type(cell) and dup is not cell and dup.__dict__.get("construct") is \
                cell.__dict__.get("construct")
    # the refusal changed nothing: training goes on with AC, bitwise
    assert first_difference(run_steps(plain, LLAMA.batch, steps=1), run_steps(model, LLAMA.batch, steps=1)) is None
    _remove(mode, model)
    assert all("__reduce_ex__" not in cell.__dict__ for _, cell in model.cells_and_names())


# -- a model that pickles: parameters and functional ops only ------------------------------------------

H, S, B = 16, 6, 2


class _Mix(nn.Cell):
    def __init__(self, seed):
        super().__init__()
        rng = np.random.RandomState(seed)
        self.w = Parameter(Tensor(rng.uniform(-0.3, 0.3, (H, H)).astype(np.float32)), name="w")

    def construct(self, x):
        return mint.tanh(mint.matmul(x, self.w))


class _Block(nn.Cell):
    def __init__(self, seed):
        super().__init__()
        self.attn, self.mlp = _Mix(seed), _Mix(seed + 1)

    def construct(self, x):
        h = x + mint.softmax(self.attn(x), dim=-1)
        return h + self.mlp(h)


class _Functional(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([_Block(10 * i) for i in range(3)])

    def construct(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x.sum(-1) - y) ** 2).mean()


def _batch(step):
    rng = np.random.RandomState(40 + step)
    return Tensor(rng.randn(B, S, H).astype(np.float32)), Tensor(rng.randn(B, S).astype(np.float32))


FUNCTIONAL_MODES = {
    "full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"]}},
    "group": {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"], "group_layers": 3}},
    "select_cell": {"recompute": {"mode": "select", "select_module": {"attn": ["0-2"]}}},
    "layer_swap": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}},
    "mixed": {"recompute": {"mode": "select", "full_recompute_layer": [0], "select_module": {"mlp": [2]}},
              "swap": {"enable": True, "layer_swap": [{"layers": [1]}]}},
    "memory_budget": BUDGET,
    "checkpoint_wrapper": None, "swap_wrapper": None,
}


@pytest.mark.parametrize("mode", FUNCTIONAL_MODES)
def test_after_remove_ac_the_model_pickles_and_the_copy_trains_bitwise(mode):
    plain, model = _Functional(), _Functional()
    pickle.dumps(plain)   # the model without AC pickles
    _apply(mode, model, FUNCTIONAL_MODES[mode])
    assert first_difference(run_steps(plain, _batch, steps=3), run_steps(model, _batch, steps=3)) is None
    _assert_refused(model)
    _remove(mode, model)
    loaded = pickle.loads(pickle.dumps(model))
    assert mac.ac_state(loaded) is None
    expected = run_steps(plain, _batch, steps=2)
    assert first_difference(expected, run_steps(model, _batch, steps=2)) is None
    assert first_difference(expected, run_steps(loaded, _batch, steps=2)) is None
