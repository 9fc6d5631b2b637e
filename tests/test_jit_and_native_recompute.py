"""What AC can't run is refused up front, naming the cell: jit-compiled cells it would patch, GRAPH_MODE,
MindSpore's own ``Cell.recompute()`` in or around a recomputed region. What it runs around without acting
on (a jit cell inside a recomputed layer) trains bitwise and is reported once, in the log and the plan.

Every refusal is checked on ``plan_ac`` and ``apply_ac`` (the same ``ConfigError``) and leaves the model
untouched; the allowed combinations train 3 steps bitwise equal to the same model without AC.
"""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac

from conftest import model_fingerprint
from model_patterns import B, H, S, init_weights
from steps import first_difference, run_steps

ALL = ["0-2"]
FULL = {"recompute": {"mode": "full", "full_recompute_layer": ALL}}


def select(pattern):
    return {"recompute": {"mode": "select", "select_module": {pattern: ALL}}}


class Block(nn.Cell):
    """Linear + GeLU; ``act`` is an op attribute (what select_op / output recompute names)."""

    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(H, H)
        self.act = ops.gelu

    def construct(self, x):
        return self.act(self.fc(x))


class JitBlock(Block):
    @ms.jit
    def construct(self, x):
        return ops.gelu(self.fc(x))


class Layer(nn.Cell):
    def __init__(self, blk=Block):
        super().__init__()
        self.norm = nn.LayerNorm((H,))
        self.attn = Block()
        self.blk = blk()
        self.mlp = Block()

    def construct(self, x):
        h = x + self.attn(self.norm(x))
        h = h + self.blk(h)
        return h + self.mlp(h)


class JitLayer(Layer):
    @ms.jit
    def construct(self, x):
        h = x + self.attn(self.norm(x))
        h = h + self.blk(h)
        return h + self.mlp(h)


class Model(nn.Cell):
    def __init__(self, layer=Layer, blk=Block):
        super().__init__()
        self.layers = nn.CellList([layer(blk) for _ in range(3)])

    def construct(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x.mean(-1) - y) ** 2).mean()


class JitModel(Model):
    @ms.jit
    def construct(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x.mean(-1) - y) ** 2).mean()


def build(model_cls=Model, **kw):
    return init_weights(model_cls(**kw))


def batch(step):
    rng = np.random.RandomState(400 + step)
    return Tensor(rng.randn(B, S, H).astype(np.float32)), Tensor(rng.randn(B, S).astype(np.float32))


def assert_refused(model, config, match):
    """plan_ac and apply_ac raise the same ConfigError (field ``model``), and nothing changes."""
    before = model_fingerprint(model)
    with pytest.raises(mac.ConfigError, match=match) as planned:
        mac.plan_ac(model, config=config)
    with pytest.raises(mac.ConfigError) as applied:
        mac.apply_ac(model, config=config)
    assert str(applied.value) == str(planned.value)
    assert planned.value.field == "model"
    assert model_fingerprint(model) == before
    assert mac.ac_state(model) is None
    return str(planned.value)


# -- jit ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_kw, config, match", [
    ({"layer": JitLayer}, FULL, r"layer 0 \(JitLayer\) has a construct compiled by ms\.jit.*full recompute of "
                                r"layer 0"),
    ({"blk": JitBlock}, select("blk"), r"layer 0 cell 'blk' \(JitBlock\) has a construct compiled by ms\.jit.*"
                                       r"select recompute of 'blk'"),
    ({"blk": JitBlock}, select(r"blk\.act"), r"layer 0 cell 'blk' \(JitBlock\).*output recompute of op "
                                             r"'blk\.act'"),
    ({"blk": JitBlock}, {"swap": {"enable": True, "op_swap": [{"op_name": "blk", "layers": ["0-1"]}]}},
     r"layer 0 cell 'blk' \(JitBlock\).*op swap of 'blk'"),
    ({"layer": JitLayer}, {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}},
     r"layer 0 \(JitLayer\) has a construct compiled by ms\.jit"),
], ids=["jit_layer_full", "jit_select_cell", "jit_owner_of_selected_op", "jit_op_swap", "jit_layer_swap"])
def test_jit_cells_that_ac_would_patch_are_refused(model_kw, config, match):
    message = assert_refused(build(**model_kw), config, match)
    assert "Remove ms.jit from that cell" in message


def test_a_jit_prefetch_layer_is_refused():
    model = build()
    model.layers[1] = JitLayer()   # layer 0's swap is prefetched from layer 1's backward
    assert_refused(model, {"swap": {"enable": True, "layer_swap": [{"layers": [0]}]}},
                   r"^model: layer 1 \(JitLayer\) has a construct compiled by ms\.jit, and the swap of layer 0 is "
                   r"prefetched")


def test_a_jit_model_is_refused_as_graph_execution():
    message = assert_refused(build(JitModel), FULL, r"^model: '<model>' \(JitModel\) has a construct compiled by "
                                                    r"ms\.jit")
    assert "works in PyNative only" in message


def test_graph_mode_is_refused_naming_the_mode():
    model = build()
    before = model_fingerprint(model)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        for call in (mac.plan_ac, mac.apply_ac):
            with pytest.raises(mac.ConfigError, match=r"^mode: mindformers_ac works in PyNative mode only, and "
                                                      r"MindSpore runs in GRAPH_MODE") as info:
                call(model, config=FULL)
            assert "ms.set_context(mode=ms.PYNATIVE_MODE)" in str(info.value)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert model_fingerprint(model) == before


@pytest.mark.parametrize("config, what", [(FULL, "recomputed"),
                                          ({"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}},
                                           "swapped")],
                         ids=["full", "layer_swap"])
def test_a_jit_cell_inside_a_region_trains_bitwise_and_is_noted_once(config, what, caplog):
    """The jit block runs as one op: exact, but what it saves stays in memory; said once per layer."""
    mac.SwapManager().reset()
    base = run_steps(build(blk=JitBlock), batch)
    model = build(blk=JitBlock)
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.apply_ac(model, config=config)
        history = run_steps(model, batch)
    assert first_difference(base, history) is None
    note = f"'blk' (JitBlock) runs under ms.jit: the engine sees it as one op, and what it saves for backward " \
           f"stays in memory (not {what})"
    noted = [lp.layer_id for lp in plan.layers.values() if note in lp.notes]
    assert noted == [lp.layer_id for lp in plan.active_layers()] and noted
    assert f"layer {noted[0]}: {note}" in str(plan) and note in plan.explain()
    assert caplog.text.count(note) == len(noted)   # logged once per layer at apply_ac, never per step
    state = mac.ac_state(model)
    if what == "recomputed":
        assert sum(s.recompute_calls for s in state.recompute_stats.values()) > 0
    else:
        assert sum(s.num_offloaded for s in state.swap_report.layers.values()) > 0
    mac.remove_ac(model)
    mac.SwapManager().reset()


def test_select_beside_a_jit_cell_has_no_note():
    plan = mac.plan_ac(build(blk=JitBlock), config=select("mlp"))
    assert all(not lp.notes for lp in plan.layers.values())
    assert "Notes:" not in str(plan)


# -- MindSpore's Cell.recompute() -----------------------------------------------------------------------

def _natively_recomputed(path):
    model = build()
    for layer in model.layers:
        cell = layer
        for part in path.split(".") if path else ():
            cell = getattr(cell, part)
        cell.recompute()
    return model


def test_cell_recompute_on_a_layer_the_config_recomputes_is_refused_by_plan_and_apply():
    message = assert_refused(_natively_recomputed(""), FULL, r"^model: layer 0 \(Layer\) already uses MindSpore's "
                                                             r"Cell\.recompute\(\) and the config recomputes it too")
    assert "drop its cell.recompute() call" in message


def test_cell_recompute_on_a_selected_module_is_refused():
    assert_refused(_natively_recomputed("mlp"), select("mlp"),
                   r"^model: layer 0 cell 'mlp' \(Block\) already uses MindSpore's Cell\.recompute\(\)")


def test_cell_recompute_inside_a_fully_recomputed_layer_is_refused():
    message = assert_refused(_natively_recomputed("mlp"), FULL,
                             r"^model: layer 0 cell 'mlp' \(Block\) uses MindSpore's Cell\.recompute\(\) inside a "
                             r"region the config recomputes \(full recompute of layer 0\)")
    assert "The pointer[top_cell_] is null" in message


def test_cell_recompute_around_a_selected_module_is_refused():
    assert_refused(_natively_recomputed(""), select("mlp"),
                   r"^model: layer 0 \(Layer\) uses MindSpore's Cell\.recompute\(\) around a region the config "
                   r"recomputes \(select recompute of 'mlp' in layer 0\)")


def test_cell_recompute_on_the_model_is_refused_with_any_recompute():
    model = build()
    model.recompute()
    assert_refused(model, select("mlp"), r"^model: '<model>' \(Model\) uses MindSpore's Cell\.recompute\(\)")


def test_cell_recompute_beside_a_selected_module_composes():
    """mlp under MindSpore's recompute, attn under the config's: both recompute, bitwise."""
    base = run_steps(_natively_recomputed("mlp"), batch)
    model = _natively_recomputed("mlp")
    mac.apply_ac(model, config=select("attn"))
    assert first_difference(base, run_steps(model, batch)) is None
    stats = mac.ac_state(model).recompute_stats.values()
    assert sum(s.recompute_calls for s in stats) == 9 and sum(s.ops_rerun for s in stats) > 0
    mac.remove_ac(model)
