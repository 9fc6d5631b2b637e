"""Pipeline stages: global layer ids, swap allowed, and microbatches in flight in GPipe order.

A stage plans only its own layers (ids of other stages are ignored with one warning), its swap bounds
are its own (a swapped layer's prefetch trigger runs on the stage), and a stage whose offset can't be
known is refused. Then the reference GPT in two stages runs 4 microbatches' forwards before their
backwards: every AC mode is bitwise equal to the same schedule without AC, swap brings each
microbatch's tensors back for its own backward (counted), and nothing of a finished microbatch stays.
"""
import gc
import logging
import weakref

import pytest
from mindspore import nn

import mindformers_ac as mac

from conftest import model_fingerprint
from pipeline_stages import build_stages, first_difference, gpipe_steps

MODES = {
    "full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-7"]}},
    "group": {"recompute": {"mode": "full", "full_recompute_layer": ["0-7"], "group_layers": 2}},
    "select_mlp": {"recompute": {"mode": "select", "select_module": {r".*mlp": ["0-7"]}}},
    "output": {"recompute": {"mode": "select", "select_module": {r"mlp\.activation_func": ["0-7"]}}},
    "exclude_op": {"recompute": {"mode": "full", "full_recompute_layer": ["0-7"], "exclude_op": ["MatMul"]}},
    "layer_swap": {"swap": {"enable": True, "default_prefetch": 1,
                            "layer_swap": [{"layers": ["0-2"]}, {"layers": ["4-6"]}]}},
    "every_layer_swap": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-7"]}]}},
    "op_swap": {"swap": {"enable": True, "op_swap": [{"op_name": r".*mlp", "layers": ["0-2", "4-6"]}]}},
    "mixed": {"recompute": {"mode": "select", "full_recompute_layer": [0, 5], "select_module": {r".*mlp": [1, 6]}},
              "swap": {"enable": True, "layer_swap": [{"layers": [2, 4]}]}},
}
SWAPPED = {"layer_swap": {0, 1, 2, 4, 5, 6}, "every_layer_swap": set(range(8)), "op_swap": {0, 1, 2, 4, 5, 6},
           "mixed": {2, 4}}
NEXT_MICROBATCH = {"every_layer_swap": {3, 7}}   # each stage's last layer: fetched back by its first


def test_a_stage_plans_its_own_layers_and_names_the_others_once(caplog):
    first, last = build_stages()
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(last, config=MODES["layer_swap"], pp=2)
    assert sorted(plan.layers) == [4, 5, 6, 7]
    assert [plan.layers[i].layer_swap for i in (4, 5, 6, 7)] == [True, True, True, False]
    assert plan.layers[6].prefetch_layer == 7
    assert plan.warnings == ["layers 0-2 (swap.layer_swap[0].layers) are not on this pipeline stage, which holds "
                             "global layers 4-7: ignored here (each stage acts on its own layers; the same config "
                             "goes to every stage)"]
    assert "AcPlan: 4 layers at 'layers' (global ids 4-7 of 8), pp=2" in str(plan)
    assert sorted(mac.plan_ac(first, config=MODES["layer_swap"], pp=2).layers) == [0, 1, 2, 3]


def test_a_swapped_layer_is_fetched_back_by_a_layer_of_its_own_stage():
    """Layer i comes back when layer i + p starts its backward; a stage's last p layers, when an earlier layer
    of the stage starts its backward of the next microbatch (GPipe order)."""
    first, last = build_stages()
    plan = mac.plan_ac(last, config={"swap": {"enable": True, "layer_swap": [{"layers": ["4-7"]}]}}, pp=2)
    assert [plan.layers[i].prefetch_layer for i in (4, 5, 6, 7)] == [5, 6, 7, 4]
    assert plan.layers[7].describe() == ["layer swap", "prefetch at layer 4 backward of the next microbatch"]
    assert "\n7      -          -               -                  layer  4 (next microbatch)" in str(plan)
    with pytest.raises(mac.ConfigError, match=r"^swap\.layer_swap\[0\]\.layers: layer 4 \+ default_prefetch 4 "
                                              r"must be < 8, the end of this pipeline stage \(global layers 4-7 "
                                              r"of 8\), or default_prefetch below the stage's 4 layers"):
        mac.apply_ac(last, config={"swap": {"enable": True, "default_prefetch": 4,
                                            "layer_swap": [{"layers": [4]}]}}, pp=2)
    assert mac.ac_state(last) is None
    # a stage that swaps nothing has no bound of its own (the other stage's swap is that stage's)
    assert mac.plan_ac(first, config={"swap": {"enable": True, "default_prefetch": 4,
                                               "layer_swap": [{"layers": [5]}]}}, pp=2).active_layers() == []


class _Offsetless(nn.Cell):
    """A stage as Megatron or MindSpeed hold one: no layer_start, no config."""

    def __init__(self, stage):
        super().__init__()
        self.layers = nn.CellList(list(stage.layers))


def test_a_stage_without_layer_start_needs_its_offset():
    _, last = build_stages()
    stage = _Offsetless(last)
    before = model_fingerprint(stage)
    with pytest.raises(mac.ConfigError, match=r"^layer_offset: pp=2, and the global id of this stage's first layer "
                                              r"is not known: 'layers' has no layer_start"):
        mac.apply_ac(stage, config=MODES["full"], pp=2)
    assert model_fingerprint(stage) == before and mac.ac_state(stage) is None
    plan = mac.plan_ac(stage, config=MODES["layer_swap"], pp=2, layer_offset=4, num_layers=8)
    assert sorted(plan.layers) == [4, 5, 6, 7] and plan.layers[4].layer_swap
    with pytest.raises(mac.ConfigError, match=r"^layer_offset: layers says layer_start=4, and apply_ac got "
                                              r"layer_offset=2"):
        mac.plan_ac(last, config=MODES["full"], pp=2, layer_offset=2)
    with pytest.raises(mac.ConfigError, match=r"^num_layers: config\.num_layers is 8, and apply_ac got num_layers=6"):
        mac.plan_ac(last, config=MODES["full"], pp=2, num_layers=6)
    with pytest.raises(mac.ConfigError, match=r"^layer_offset: expected an integer from 0 to"):
        mac.plan_ac(stage, config=MODES["full"], pp=2, layer_offset=-1)


@pytest.fixture(scope="module")
def plain_history():
    return gpipe_steps(build_stages())


@pytest.mark.parametrize("mode", sorted(MODES))
def test_four_microbatches_in_flight_are_bitwise_in_every_mode(plain_history, mode):
    stages = build_stages()
    for stage in stages:
        mac.apply_ac(stage, config=MODES[mode], pp=2)
    history = gpipe_steps(stages)
    assert first_difference(plain_history, history) is None, mode
    states = [mac.ac_state(s) for s in stages]
    if "recompute" in MODES[mode]:
        assert sum(st.ops_rerun for state in states for st in state.recompute_stats.values()) > 0
    if mode in SWAPPED:
        # every microbatch's swapped tensors came back for its own backward, prefetched, none on demand
        loads = [e for state in states for e in state.swap_report.events if e[0] == "load"]
        assert loads and {e[1] for e in loads} == SWAPPED[mode]
        late = NEXT_MICROBATCH.get(mode, set())
        assert {e[2] for e in loads if e[1] not in late} == {"in_time"}
        for layer in late:   # on demand for the first microbatch in backward order only: 1 in 4
            hows = [e[2] for e in loads if e[1] == layer]
            assert hows.count("on_demand") * 4 == len(hows) and hows.count("in_time") * 4 == 3 * len(hows), hows
        prefetches = [e for state in states for e in state.swap_report.events if e[0] == "prefetch"]
        # one per swapped layer, microbatch and step (the first microbatch's last layers: none)
        assert len(prefetches) == (len(SWAPPED[mode]) * 4 - len(late)) * 2
    for stage in stages:
        mac.remove_ac(stage)


def test_nothing_of_a_finished_microbatch_stays_alive():
    """Fifty steps of two microbatches with recompute and swap on both stages: after each step no region is
    alive and no swapped byte is held, and every microbatch's loss is gone (weak references)."""
    stages = build_stages(num_layers=4, hidden_size=16, cut=2)
    config = {"recompute": {"mode": "full", "full_recompute_layer": [1, 3]},
              "swap": {"enable": True, "layer_swap": [{"layers": [0]}, {"layers": [2]}]}}
    for stage in stages:
        mac.apply_ac(stage, config=config, pp=2)

    def check(step):
        for stage in stages:
            state = mac.ac_state(stage)
            assert all(s.live_regions == 0 and s.live_bytes == 0 for s in state.recompute_stats.values()), step
            assert state.swap_report.live_resident_bytes == 0, step
    refs = []
    original = nn.SoftmaxCrossEntropyWithLogits.construct

    def keep_ref(self, *args):
        out = original(self, *args)
        refs.append(weakref.ref(out))
        return out
    nn.SoftmaxCrossEntropyWithLogits.construct = keep_ref
    try:
        gpipe_steps(stages, steps=50, microbatches=2, on_step=check)
    finally:
        nn.SoftmaxCrossEntropyWithLogits.construct = original
    gc.collect()
    assert len(refs) == 100 and all(r() is None for r in refs)
    for stage in stages:
        mac.remove_ac(stage)
