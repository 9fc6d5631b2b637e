import logging

import pytest
from mindspore import nn
from test_config import STRUCTURAL_ERRORS

import mindformers_ac as mac
from mindformers_ac import AcConfig, ConfigError
from mindformers_ac.harness.models import GPTConfig, TransformerLayer, build_gpt

from conftest import model_fingerprint


def full(layers, **extra):
    return {"recompute": {"mode": "full", "full_recompute_layer": layers, **extra}}


def select(modules, **extra):
    return {"recompute": {"mode": "select", "select_module": modules, **extra}}


def swap(**fields):
    return {"swap": {"enable": True, **fields}}


def merge(*parts):
    out = {}
    for part in parts:
        out.update(part)
    return out


# Rejections that need the model (layer count, matches, overlaps); the model has 8 layers.
MODEL_ERRORS = [
    (full(["0-8"]), 1, "recompute.full_recompute_layer[0]", "out of range"),
    (select({".*mlp": [9]}), 1, "recompute.select_module['.*mlp'][0]", "out of range"),
    (select({".*mlp": [0]}, full_recompute_layer=[3, 8]), 1, "recompute.full_recompute_layer[1]", "out of range"),
    (full([0], exclude_op={".*mlp": [12]}), 1, "recompute.exclude_op['.*mlp'][0]", "out of range"),
    ({"recompute_comm": {"enable": True, "select_module": {"x": [8]}}}, 1,
     "recompute_comm.select_module['x'][0]", "out of range"),
    (swap(default_prefetch=8, layer_swap=[{"layers": [0]}]), 1, "swap.default_prefetch", "[1, 7]"),
    (swap(layer_swap=[{"layers": [7]}]), 1, "swap.layer_swap[0].layers", "last layer that can be swapped is 6"),
    (swap(default_prefetch=2, layer_swap=[{"layers": ["5-6"]}]), 1, "swap.layer_swap[0].layers", "must be < num_layers"),
    (swap(op_swap=[{"op_name": ".*mlp", "layers": [7]}]), 1, "swap.op_swap[0].layers", "must be < num_layers"),
    (swap(op_swap=[{"op_name": ".*mlp", "layers": [9]}]), 1, "swap.op_swap[0].layers[0]", "out of range"),
    (swap(layer_swap=[{"layers": [1]}, {"layers": [12]}]), 1, "swap.layer_swap[1].layers[0]", "out of range"),
    (merge(full(["0-3"]), swap(layer_swap=[{"layers": ["3-4"]}])), 1, "swap.layer_swap[0].layers",
     "layer 3 overlaps full recompute of layer 3: recompute and swap can't share"),
    (merge(select({".*mlp": ["0-3"]}), swap(layer_swap=[{"layers": [2]}])), 1, "swap.layer_swap[0].layers",
     "layer 2 overlaps select recompute of 'mlp' in layer 2"),
    (merge(select({r"mlp\.activation_func": [5]}), swap(layer_swap=[{"layers": [5]}])), 1,
     "swap.layer_swap[0].layers", "overlaps output recompute of op 'mlp.activation_func'"),
    (merge(select({".*mlp": [2]}), swap(op_swap=[{"op_name": "mlp", "layers": [2]}])), 1, "swap.op_swap[0]",
     "mlp in layer 2 overlaps select recompute of 'mlp' in layer 2 (same module"),
    (merge(select({".*mlp": [2]}), swap(op_swap=[{"op_name": r"mlp\.linear_fc1", "layers": [2]}])), 1,
     "swap.op_swap[0]", "parent or child"),
    (merge(select({r"mlp\.activation_func": [2]}), swap(op_swap=[{"op_name": "mlp", "layers": [2]}])), 1,
     "swap.op_swap[0]", "mlp in layer 2 overlaps output recompute of op 'mlp.activation_func'"),
    (merge(full([4]), swap(op_swap=[{"op_name": ".*attention", "layers": [4]}])), 1, "swap.op_swap[0]",
     "attention in layer 4 overlaps full recompute of layer 4"),
    (swap(layer_swap=[{"layers": [0]}]), 2, "layer_offset", "the global id of this stage's first layer is not known"),
    (full([0]), 0, "pp", "integer >= 1"),
    (full([0]), "2", "pp", "integer >= 1"),
]


def _fresh_model():
    return build_gpt(num_layers=8, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.0)


ALL_ERRORS = [(data, 1, field, "") for data, field in STRUCTURAL_ERRORS] + MODEL_ERRORS


@pytest.mark.parametrize("data, pp, field, words", ALL_ERRORS, ids=[f"{e[2]}-{i}" for i, e in enumerate(ALL_ERRORS)])
@pytest.mark.parametrize("entry", [mac.plan_ac, mac.apply_ac], ids=["plan_ac", "apply_ac"])
def test_invalid_config_names_field_and_leaves_model_untouched(gpt8, data, pp, field, words, entry):
    before = model_fingerprint(gpt8)
    with pytest.raises(ConfigError) as info:
        entry(gpt8, config=data, pp=pp)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(field + ": ")
    assert words in str(info.value)
    assert model_fingerprint(gpt8) == before
    assert mac.ac_state(gpt8) is None


def test_at_least_thirty_distinct_invalid_configs():
    assert len({repr(e[:3]) for e in ALL_ERRORS}) >= 30


def test_valid_plan_mutates_nothing(gpt8):
    before = model_fingerprint(gpt8)
    mac.plan_ac(gpt8, config=merge(full(["0-3"], exclude_op=["MatMul"]), swap(layer_swap=[{"layers": ["4-6"]}])))
    assert model_fingerprint(gpt8) == before


def test_plan_fields_per_layer(gpt8):
    plan = mac.plan_ac(gpt8, config=merge(
        select({".*mlp": ["2-3"], r".*core_attention": [3]}, full_recompute_layer=[0, 1], exclude_op=["AllGather"]),
        swap(default_prefetch=2, layer_swap=[{"layers": [4]}], op_swap=[{"op_name": ".*attention", "layers": [5]}])))
    lp = plan.layers
    assert lp[0].full_recompute and lp[0].recompute == () and lp[0].exclude == ("AllGather",)
    assert lp[2].recompute == ("mlp",) and not lp[2].full_recompute
    assert lp[3].recompute == ("self_attention.core_attention", "mlp")
    assert lp[4].layer_swap and lp[4].prefetch_layer == 6
    # '.*attention' matches self_attention and its child core_attention: the parent covers it
    assert lp[5].op_swap == ("self_attention",) and lp[5].prefetch_layer == 7 and not lp[5].layer_swap
    assert lp[6].is_empty and lp[7].is_empty and lp[6].prefetch_layer is None
    assert plan.num_layers == 8 and plan.layer_path == "decoder.layers"


def test_select_targets_inside_full_layers_are_covered(gpt8):
    plan = mac.plan_ac(gpt8, config=select({".*mlp": ["0-3"]}, full_recompute_layer=["0-1"]))
    assert [plan.layers[i].recompute for i in range(4)] == [(), (), ("mlp",), ("mlp",)]
    assert plan.layers[0].full_recompute and plan.layers[1].full_recompute


def test_op_targets_are_marked_as_ops(gpt8):
    plan = mac.plan_ac(gpt8, config=select({r"mlp(\.activation_func)?": [0], r".*core_attention\.softmax": [1]}))
    assert plan.layers[0].recompute == ("mlp",)  # the op lies inside mlp
    assert plan.layers[1].recompute == ("self_attention.core_attention.softmax",)
    assert plan.layers[1].op_paths == {"self_attention.core_attention.softmax"}
    assert plan.layers[0].op_paths == frozenset()


def test_unmatched_pattern_warns_and_planning_goes_on(gpt8, caplog):
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(gpt8, config=select({".*mlp": [0], ".*moe": ["0-7"]}))
    assert "select_module pattern '.*moe' did not match any module" in caplog.text
    assert plan.layers[0].recompute == ("mlp",)
    assert any(m.pattern == ".*moe" and not m.matched for m in plan.matches)


def test_comm_match_on_a_cell_warns_and_is_skipped(gpt8, caplog):
    cfg = {"recompute_comm": {"enable": True, "select_module": {".*linear_fc1": [0], r".*\.bmm_qk": [1]}}}
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(gpt8, config=cfg)
    assert "mlp.linear_fc1 in layer 0 is expected to be operation but got cell, this configuration " \
           "will not be effective" in caplog.text
    assert plan.layers[0].recompute_comm == ()
    assert plan.layers[1].recompute_comm == ("self_attention.core_attention.bmm_qk",)


def test_comm_targets_under_recomputed_regions_are_covered(gpt8):
    cfg = merge(select({".*core_attention": [1]}, full_recompute_layer=[0]),
                {"recompute_comm": {"enable": True, "select_module": {r".*\.bmm_qk": ["0-2"]}}})
    plan = mac.plan_ac(gpt8, config=cfg)
    assert [plan.layers[i].recompute_comm for i in range(3)] == \
        [(), (), ("self_attention.core_attention.bmm_qk",)]


def test_exclude_dict_form_resolves_paths(gpt8, caplog):
    cfg = full([0, 1], exclude_op={r".*core_attention\.bmm_.*": [0], ".*linear_fc2": [5]})
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(gpt8, config=cfg)
    assert plan.layers[0].exclude == ("self_attention.core_attention.bmm_qk",
                                      "self_attention.core_attention.bmm_pv")
    assert plan.layers[0].exclude_by_path and plan.layers[1].exclude == ()
    assert "layer 5 is not recomputed" in caplog.text


def test_op_swap_inside_layer_swap_is_covered(gpt8, caplog):
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(gpt8, config=swap(layer_swap=[{"layers": [1]}],
                                            op_swap=[{"op_name": "mlp", "layers": [1, 2]}]))
    assert plan.layers[1].layer_swap and plan.layers[1].op_swap == ()
    assert plan.layers[2].op_swap == ("mlp",)
    assert "mlp in layer 1 is covered by layer swap of layer 1" in caplog.text


def test_an_op_swap_under_another_op_swap_module_is_covered(gpt8, caplog):
    """One rule for every pair of swaps (``actions.base.OVERLAPS``): a module inside one already swapped is
    left out with a warning, whichever entry named it; the same module named twice is swapped once."""
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(gpt8, config=swap(op_swap=[{"op_name": "mlp", "layers": [1]},
                                                      {"op_name": r"mlp\.linear_fc1", "layers": [1, 2]},
                                                      {"op_name": "mlp", "layers": [1]}]))
    assert plan.layers[1].op_swap == ("mlp",) and plan.layers[2].op_swap == ("mlp.linear_fc1",)
    assert caplog.text.count("covered by") == 1
    assert "swap.op_swap[1]: mlp.linear_fc1 in layer 1 is covered by op swap of 'mlp' in layer 1" in caplog.text


def test_every_layer_swap_entry_is_applied(gpt8):
    plan = mac.plan_ac(gpt8, config=swap(layer_swap=[{"layers": [0]}, {"layers": ["2-3"]}]))
    assert [i for i, lp in plan.layers.items() if lp.layer_swap] == [0, 2, 3]


def test_sections_or_config_give_the_same_plan(gpt8):
    sections = dict(recompute=mac.RecomputeConfig(mode="full", full_recompute_layer=[1]),
                    recompute_comm=None, swap={"enable": True, "layer_swap": [{"layers": [3]}]})
    a = mac.plan_ac(gpt8, sections["recompute"], sections["recompute_comm"], sections["swap"])
    b = mac.plan_ac(gpt8, config=AcConfig(**sections))
    assert a.layers == b.layers
    with pytest.raises(ConfigError, match="^config: pass either"):
        mac.plan_ac(gpt8, sections["recompute"], config=AcConfig())


def test_plan_prints_a_table_and_round_trips_as_yaml(gpt8, tmp_path):
    cfg = merge(select({".*mlp": ["2-3"], ".*core_attention": [4]}, full_recompute_layer=[0, 1],
                       exclude_op=["MatMul"]),
                {"recompute_comm": {"enable": True, "select_module": {r".*\.bmm_qk": [5]}}},
                swap(layer_swap=[{"layers": [6]}]))
    plan = mac.plan_ac(gpt8, config=cfg)
    text = str(plan)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:]}
    assert text.splitlines()[1].split()[:2] == ["layer", "recompute"]
    assert rows["0"] == ["0", "full", "-", "MatMul", "-", "-"]
    assert rows["2"] == ["2", "mlp", "-", "MatMul", "-", "-"]
    assert rows["4"][1] == "self_attention.core_attention"
    assert rows["5"][1:3] == ["-", "self_attention.core_attention.bmm_qk"]
    assert rows["6"] == ["6", "-", "-", "-", "layer", "7"]
    assert rows["7"] == ["7", "-", "-", "-", "-", "-"]
    path = tmp_path / "plan.yaml"
    path.write_text(plan.to_yaml())
    again = mac.plan_ac(gpt8, config=AcConfig.from_yaml(path))
    assert again.layers == plan.layers


def test_explain_lists_matches_and_misses(gpt8):
    plan = mac.plan_ac(gpt8, config=select({".*mlp": [0], "nothing": [1]}))
    text = plan.explain()
    assert "recompute.select_module['.*mlp'] -> layers [0]" in text
    assert "layer 0: mlp" in text and "matched nothing" in text


def test_debug_log_per_planned_layer(gpt8, caplog):
    # per-layer detail is debug level: apply_ac reports the whole plan once at INFO (test_apply_summary)
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        mac.plan_ac(gpt8, config=full(["0-1"]))
    assert "plan: layer" not in caplog.text
    with caplog.at_level(logging.DEBUG, logger="mindformers_ac"):
        mac.plan_ac(gpt8, config=full(["0-1"]))
    assert "plan: layer 0: full recompute" in caplog.text and "plan: layer 1: full recompute" in caplog.text


def test_two_models_are_planned_independently(gpt8):
    other = build_gpt(num_layers=3, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.0)
    other.decoder.layers[1].mlp.extra_op = lambda x: x
    cfg = select({r"mlp\.extra_op": ["0-2"]})
    a = mac.plan_ac(other, config=cfg)
    b = mac.plan_ac(gpt8, config=select({r"mlp\.extra_op": ["0-2"]}))
    assert [a.layers[i].recompute for i in range(3)] == [(), ("mlp.extra_op",), ()]
    assert all(lp.recompute == () for lp in b.layers.values())
    assert "mlp.extra_op" not in mac.get_single_layer_whitelist(gpt8.decoder.layers[1])
    del other.decoder.layers[1].mlp.extra_op


class _Stage(nn.Cell):
    """Pipeline stage holding layers 4..7 of an 8-layer model, as MindFormers' TransformerBlock."""

    def __init__(self):
        super().__init__()
        self.config = GPTConfig(num_layers=8, hidden_size=32, num_heads=2, seq_length=16, dropout=0.0)
        self.layer_start, self.layer_end = 4, 8
        self.layers = nn.CellList([TransformerLayer(self.config, i) for i in range(4, 8)])


def test_pipeline_stage_plans_only_its_layers(caplog):
    stage = _Stage()
    cfg = select({".*mlp": ["0-2"], ".*core_attention": ["3-5"]}, full_recompute_layer=[7])
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(stage, config=cfg, pp=2)
    assert sorted(plan.layers) == [4, 5, 6, 7]
    assert plan.layers[4].recompute == ("self_attention.core_attention",)
    assert plan.layers[7].full_recompute and plan.layers[6].is_empty
    assert "did not match" not in caplog.text  # '.*mlp' lives on another stage
    with pytest.raises(ConfigError, match=r"recompute\.full_recompute_layer\[0\]: layer 8 is out of range"):
        mac.plan_ac(stage, config=full([8]), pp=2)


class _Blocks(nn.Cell):
    def __init__(self, name):
        super().__init__()
        cfg = GPTConfig(num_layers=2, hidden_size=32, num_heads=2, seq_length=16, dropout=0.0)
        setattr(self, name, nn.CellList([TransformerLayer(cfg, i) for i in range(2)]))


@pytest.mark.parametrize("name", ["blocks", "h", "layers"])
def test_layer_list_found_under_common_names(name):
    plan = mac.plan_ac(_Blocks(name), config=full([1]))
    assert plan.layer_path == name and plan.layers[1].full_recompute


def test_layer_list_named_by_caller_and_error_when_missing():
    holder = nn.Cell()
    holder.stack = nn.CellList([TransformerLayer(GPTConfig(hidden_size=32, num_heads=2, dropout=0.0), 0)])
    assert mac.plan_ac(holder, config=full([0]), layers="stack").layer_path == "stack"
    with pytest.raises(ConfigError) as info:
        mac.plan_ac(holder, config=full([0]))
    assert info.value.field == "model" and "decoder.layers" in str(info.value) and "layers=" in str(info.value)
    with pytest.raises(ConfigError, match="^layers: 'missing.path' is not"):
        mac.plan_ac(holder, config=full([0]), layers="missing.path")


def test_op_swap_on_an_operation_warns_and_is_skipped(gpt8, caplog):
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(gpt8, config=swap(op_swap=[{"op_name": r"mlp(\.activation_func)?|.*bmm_qk", "layers": [1]}]))
    assert plan.layers[1].op_swap == ("mlp",)
    assert "self_attention.core_attention.bmm_qk in layer 1 is an operation" in caplog.text


# -- shared cells: the installers patch cells, which can't tell layers apart --------------------

def _gpt_with(layers_of):
    model = build_gpt(num_layers=3, hidden_size=16, num_heads=2, seq_length=8, vocab_size=32)
    cells = list(model.decoder.layers)
    model.decoder.layers = nn.CellList(layers_of(cells))
    return model


@pytest.mark.parametrize("config, acting", [(full([0]), "0"), (full([2]), "2"), (select({"mlp": ["0-2"]}), "0, 2"),
                                            (swap(layer_swap=[{"layers": [0]}]), "0"),
                                            (swap(op_swap=[{"op_name": "mlp", "layers": [0]}]), "0")])
def test_a_layer_cell_listed_twice_is_refused_naming_the_ids(config, acting):
    model = _gpt_with(lambda c: [c[0], c[1], c[0]])
    before = model_fingerprint(model)
    with pytest.raises(ConfigError, match=rf"layers 0, 2 of 'decoder.layers' are one TransformerLayer cell "
                                          rf".* recomputes or swaps layer {acting};"):
        mac.apply_ac(model, config=config)
    assert model_fingerprint(model) == before
    plan = mac.plan_ac(model, config=full([1]))   # the shared ids left alone: fine
    assert plan.layers[1].full_recompute


@pytest.mark.parametrize("config, words", [
    (select({"mlp": ["1-2"]}), "module mlp of layer 1 is also part of layer 2"),
    (select({"mlp": [2]}), "module mlp of layer 2 is also part of layer 1"),   # layer 1 would be recomputed too
    (select({r"mlp\.activation_func": [1]}), "the module holding mlp.activation_func of layer 1"),
    (swap(op_swap=[{"op_name": "mlp", "layers": [1]}]), "module mlp of layer 1 is also part of layer 2"),
])
def test_a_module_shared_by_two_layers_is_refused_as_a_target(config, words):
    model = _gpt_with(lambda c: c)
    layers = model.decoder.layers
    layers[2].mlp = layers[1].mlp
    with pytest.raises(ConfigError, match=words):
        mac.plan_ac(model, config=config)
    mac.plan_ac(model, config=full(["0-2"]))   # whole layers are distinct cells: fine
    mac.plan_ac(model, config=select({"mlp": [0]}))   # a module of its own: fine
