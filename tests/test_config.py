import dataclasses
import os
import textwrap
import typing

import pytest
import yaml

import mindformers_ac as mac
from mindformers_ac import AcConfig, ConfigError, RecomputeCommConfig, RecomputeConfig, SwapConfig
from mindformers_ac.config import LAYER_LIST_FIELDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_match_mindformers():
    cfg = AcConfig()
    assert (cfg.recompute.mode, cfg.recompute.full_recompute_layer, cfg.recompute.select_module,
            cfg.recompute.exclude_op) == ("None", None, None, None)
    assert (cfg.recompute_comm.enable, cfg.recompute_comm.select_module) == (False, None)
    assert (cfg.swap.enable, cfg.swap.default_prefetch, cfg.swap.layer_swap, cfg.swap.op_swap) == \
        (False, 1, None, None)


def test_whole_trainer_yaml_other_keys_ignored_and_missing_sections_default(tmp_path):
    path = write(tmp_path, """
        seed: 42
        model: {num_layers: 8}
        runner_config: {epochs: 1}
        recompute:
          mode: full
          full_recompute_layer: [0-3, 6]
    """)
    cfg = AcConfig.from_yaml(path)
    assert cfg.recompute.mode == "full"
    assert cfg.recompute.full_recompute_layer == ["0-3", 6]
    assert cfg.swap == SwapConfig() and cfg.recompute_comm == RecomputeCommConfig()


@pytest.mark.parametrize("mode_text", ["None", "null", "~"])
def test_none_and_null_both_mean_off(tmp_path, mode_text):
    cfg = AcConfig.from_yaml(write(tmp_path, f"recompute:\n  mode: {mode_text}\n"))
    assert cfg.recompute.mode == "None" and not cfg.recompute.enabled


def test_null_sections_mean_defaults():
    cfg = AcConfig.from_dict({"recompute": None, "swap": None})
    assert cfg == AcConfig()


def test_empty_yaml_file_is_all_defaults(tmp_path):
    assert AcConfig.from_yaml(write(tmp_path, "")) == AcConfig()


def test_dataclass_construction_validates():
    with pytest.raises(ConfigError, match=r"^recompute\.mode: expected one of None, full, select"):
        RecomputeConfig(mode="partial")


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        AcConfig.from_yaml(missing)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "recompute:\n  mode: full\n  full_recompute_layer: [0-3\nswap: {}\n")
    with pytest.raises(ConfigError) as info:
        AcConfig.from_yaml(path)
    msg = str(info.value)
    assert "cfg.yaml" in msg and "line" in msg and "YAML syntax error" in msg


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path, "recompute: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="YAML"):
        AcConfig.from_yaml(path)


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping"):
        AcConfig.from_yaml(write(tmp_path, "- 1\n- 2\n"))


def test_errors_from_yaml_name_the_file(tmp_path):
    path = write(tmp_path, "swap:\n  enable: 'yes'\n")
    with pytest.raises(ConfigError, match=r"^swap\.enable: .*cfg\.yaml"):
        AcConfig.from_yaml(path)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_round_trip_through_yaml(tmp_path):
    cfg = AcConfig.from_dict({
        "recompute": {"mode": "select", "select_module": {".*mlp": ["0-3"]}, "exclude_op": ["AllGather"]},
        "recompute_comm": {"enable": True, "select_module": {r".*\.all_gather": [0]}},
        "swap": {"enable": True, "default_prefetch": 2, "layer_swap": [{"layers": ["4-5"]}]},
    })
    path = write(tmp_path, cfg.to_yaml(), "out.yaml")
    assert AcConfig.from_yaml(path) == cfg


def test_exclude_op_with_mode_none_warns(caplog):
    plan_input = {"recompute": {"mode": "None", "exclude_op": ["MatMul"]}}
    from mindformers_ac.plan import check_layer_ids
    with caplog.at_level("WARNING", logger="mindformers_ac"):
        plans = check_layer_ids(plan_input, 4)
    assert "recompute.exclude_op has no effect" in caplog.text
    assert all(not lp.exclude for lp in plans.values())


def test_swap_disabled_with_entries_warns(caplog):
    with caplog.at_level("WARNING", logger="mindformers_ac"):
        SwapConfig(enable=False, layer_swap=[{"layers": [0]}])
    assert "swap.enable is false" in caplog.text


STRUCTURAL_ERRORS = [
    ({"recompute": {"mode": "partial"}}, "recompute.mode"),
    ({"recompute": {"mode": 1}}, "recompute.mode"),
    ({"recompute": {"mode": "full"}}, "recompute.full_recompute_layer"),
    ({"recompute": {"mode": "select"}}, "recompute.select_module"),
    ({"recompute": {"mode": "full", "full_recompute_layer": "0-3"}}, "recompute.full_recompute_layer"),
    ({"recompute": {"mode": "full", "full_recompute_layer": [True]}}, "recompute.full_recompute_layer[0]"),
    ({"recompute": {"mode": "full", "full_recompute_layer": [0, "2-1"]}}, "recompute.full_recompute_layer[1]"),
    ({"recompute": {"mode": "select", "select_module": [".*mlp"]}}, "recompute.select_module"),
    ({"recompute": {"mode": "select", "select_module": {}}}, "recompute.select_module"),
    ({"recompute": {"mode": "select", "select_module": {".*mlp(": [0]}}}, "recompute.select_module['.*mlp(']"),
    ({"recompute": {"mode": "select", "select_module": {".*mlp": "0-3"}}}, "recompute.select_module['.*mlp']"),
    ({"recompute": {"mode": "select", "select_module": {".*mlp": [0, 0]}}}, "recompute.select_module['.*mlp'][1]"),
    ({"recompute": {"mode": "full", "full_recompute_layer": [0], "exclude_op": "AllGather"}}, "recompute.exclude_op"),
    ({"recompute": {"mode": "full", "full_recompute_layer": [0], "exclude_op": ["AllGather", 3]}}, "recompute.exclude_op[1]"),
    ({"recompute": {"mode": "full", "full_recompute_layer": [0], "extra": 1}}, "recompute.extra"),
    ({"recompute": ["full"]}, "recompute"),
    ({"recompute_comm": {"enable": "yes"}}, "recompute_comm.enable"),
    ({"recompute_comm": {"enable": True}}, "recompute_comm.select_module"),
    ({"recompute_comm": {"enable": True, "select_module": {"x": ["1-"]}}}, "recompute_comm.select_module['x'][0]"),
    ({"recompute_comm": {"enable": False, "modules": {}}}, "recompute_comm.modules"),
    ({"swap": {"enable": 1}}, "swap.enable"),
    ({"swap": {"enable": True, "default_prefetch": 0}}, "swap.default_prefetch"),
    ({"swap": {"enable": True, "default_prefetch": True}}, "swap.default_prefetch"),
    ({"swap": {"enable": True, "default_prefetch": 1.5}}, "swap.default_prefetch"),
    ({"swap": {"enable": True, "layer_swap": {"layers": [0]}}}, "swap.layer_swap"),
    ({"swap": {"enable": True, "layer_swap": [[0, 1]]}}, "swap.layer_swap[0]"),
    ({"swap": {"enable": True, "layer_swap": [{"layer": [0]}]}}, "swap.layer_swap[0].layer"),
    ({"swap": {"enable": True, "layer_swap": [{}]}}, "swap.layer_swap[0].layers"),
    ({"swap": {"enable": True, "layer_swap": [{"layers": [0, 1]}, {"layers": [1]}]}}, "swap.layer_swap[1].layers"),
    ({"swap": {"enable": True, "op_swap": [{"op_name": ".*mlp", "layers": [0]}, {"op_name": ".*mlp"}]}}, "swap.op_swap[1].layers"),
    ({"swap": {"enable": True, "op_swap": [{"op_name": ".*mlp", "layers": [0, -2]}]}}, "swap.op_swap[0].layers[1]"),
    ({"swap": {"enable": True, "op_swap": [{"op_name": 5, "layers": [0]}]}}, "swap.op_swap[0].op_name"),
    ({"swap": {"enable": True, "op_swap": [{"op_name": "[", "layers": [0]}]}}, "swap.op_swap[0].op_name"),
    ({"swap": {"enable": True, "prefetch": 2}}, "swap.prefetch"),
]


@pytest.mark.parametrize("data, field", STRUCTURAL_ERRORS, ids=[f for _, f in STRUCTURAL_ERRORS])
def test_structural_errors_name_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        AcConfig.from_dict(data)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(field + ": ")


def test_unknown_key_error_lists_allowed_keys():
    with pytest.raises(ConfigError) as info:
        AcConfig.from_dict({"swap": {"enable": True, "prefetch": 2}})
    assert "enable, default_prefetch, layer_swap, op_swap" in str(info.value)


def test_public_names_exist():
    for name in ("RecomputeConfig", "RecomputeCommConfig", "SwapConfig", "AcConfig", "ConfigError",
                 "parse_layer_specs", "get_single_layer_whitelist", "plan_ac", "CheckpointPolicy"):
        assert hasattr(mac, name), name


# -- typed entries and one to_dict per section ----------------------------------------------------

SECTION_SAMPLES = [
    mac.RecomputeConfig(),
    mac.RecomputeConfig(mode="full", full_recompute_layer=["0-3", 5], exclude_op=["AllGather"]),
    mac.RecomputeConfig(mode="select", full_recompute_layer=[0], select_module={r".*mlp": ["1-2"]},
                        exclude_op={r".*softmax": [0]}),
    mac.RecomputeCommConfig(),
    mac.RecomputeCommConfig(enable=True, select_module={r".*\.all_gather": ["0-3"]}),
    mac.SwapConfig(),
    mac.SwapConfig(enable=True, default_prefetch=2, layer_swap=[{"layers": ["0-1"]}, {"layers": [3]}],
                   op_swap=[{"op_name": r".*attention", "layers": [4]}]),
]


@pytest.mark.parametrize("section", SECTION_SAMPLES, ids=lambda s: f"{type(s).__name__}")
def test_every_section_round_trips_through_its_dict(section):
    data = section.to_dict()
    assert type(section).from_dict(data) == section
    assert yaml.safe_load(yaml.safe_dump(data)) == data   # plain YAML data: no enum or entry objects


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(REPO, "configs"))))
def test_shipped_configs_round_trip(name):
    config = mac.AcConfig.from_yaml(os.path.join(REPO, "configs", name))
    assert mac.AcConfig.from_dict(config.to_dict()) == config
    assert mac.AcConfig.from_dict(yaml.safe_load(config.to_yaml())) == config


def test_modes_and_swap_entries_are_typed():
    from mindformers_ac.config import LayerSwapEntry, OpSwapEntry, RecomputeMode
    config = mac.AcConfig.from_dict({"recompute": {"mode": "full", "full_recompute_layer": [0]},
                                     "swap": {"enable": True, "op_swap": [{"op_name": "mlp", "layers": [1]}],
                                              "layer_swap": [{"layers": [2]}]}})
    assert config.recompute.mode is RecomputeMode.FULL and config.recompute.mode == "full"
    assert f"{config.recompute.mode}" == "full" and mac.RecomputeConfig(mode=None).mode is RecomputeMode.NONE
    entry, = config.swap.op_swap
    assert isinstance(entry, OpSwapEntry) and (entry.op_name, entry.layers) == ("mlp", [1])
    assert entry == {"op_name": "mlp", "layers": [1]} and entry["layers"] == [1]   # still reads as the mapping
    assert isinstance(config.swap.layer_swap[0], LayerSwapEntry)


def test_plan_writers_share_the_section_dicts(gpt8):
    """plan_ac's YAML and the planner's both come from AcConfig.to_dict: every swap field is written."""
    from mindformers_ac.budget.solver import Option, OptionKind, option_sections
    config = mac.AcConfig.from_dict({"swap": {"enable": True, "default_prefetch": 2,
                                              "layer_swap": [{"layers": ["0-1"]}],
                                              "op_swap": [{"op_name": r"self_attention", "layers": [4]}]}})
    written = mac.plan_ac(gpt8, config=config).to_dict()
    assert mac.AcConfig.from_dict(written).to_dict() == written
    assert written["swap"] == {"enable": True, "default_prefetch": 2, "layer_swap": [{"layers": ["0-1"]}],
                               "op_swap": [{"op_name": "self_attention", "layers": [4]}], "min_bytes": 1024,
                               "backend": "auto"}
    sections = option_sections({0: Option("layer swap", OptionKind.SWAP), 1: Option("full", OptionKind.FULL)}, prefetch=2)
    assert sections["swap"] == {"enable": True, "default_prefetch": 2, "layer_swap": [{"layers": [0]}],
                                "min_bytes": 1024, "backend": "auto"}
    assert sections["recompute"] == {"mode": "full", "full_recompute_layer": [1], "group_layers": 1,
                                     "early_stop": True}


# -- every setting round-trips through the plan's YAML, found from the dataclasses ------------------------

def _non_default(section, f):
    """A valid value of field ``f`` other than its default, made from its type (or its ``choices``)."""
    hint = typing.get_type_hints(section)[f.name]
    args = typing.get_args(hint)
    kind = next((a for a in args if a is not type(None)), hint) if args else hint
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != default)
    if kind is bool:
        return not default
    if kind is int:
        return 12345 if default is None else 2 * default + 1
    raise AssertionError(f"{section.__name__}.{f.name}: say how to make a non-default value of {hint} here")


SETTINGS = [(name, f.name) for name, cls in (("recompute", RecomputeConfig), ("recompute_comm", RecomputeCommConfig),
                                           ("swap", SwapConfig))
            for f in dataclasses.fields(cls) if f.name not in LAYER_LIST_FIELDS[name]]


def test_every_setting_is_found_and_has_a_non_default_value():
    assert ("swap", "min_bytes") in SETTINGS and ("swap", "default_prefetch") in SETTINGS
    assert ("swap", "backend") in SETTINGS and ("swap", "max_host_bytes") in SETTINGS
    for name, field_name in SETTINGS:
        cls = type(getattr(AcConfig(), name))
        f = next(f for f in dataclasses.fields(cls) if f.name == field_name)
        assert _non_default(cls, f) != getattr(cls(), field_name)


def test_every_setting_of_every_section_round_trips_through_the_plan(gpt8, tmp_path):
    """Each setting (a field the plan does not rewrite) set to a non-default value comes back with that
    value from plan_ac(...).to_dict(), from the YAML plan.to_yaml() writes, and from AcConfig.from_yaml
    of it; the layer lists come back as the same plan. A field added later is in SETTINGS by itself."""
    layer_lists = {"recompute": {"mode": "select", "full_recompute_layer": [0], "select_module": {"mlp": [1]},
                                 "exclude_op": ["Softmax"]},
                   "swap": {"enable": True, "layer_swap": [{"layers": [3]}],
                            "op_swap": [{"op_name": "self_attention", "layers": [4]}]}}
    settings = {}
    for name, field_name in SETTINGS:
        cls = type(getattr(AcConfig(), name))
        f = next(f for f in dataclasses.fields(cls) if f.name == field_name)
        settings.setdefault(name, {})[field_name] = _non_default(cls, f)
    data = {name: {**layer_lists.get(name, {}), **settings.get(name, {})} for name in ("recompute", "swap")}
    if "recompute_comm" in settings:
        data["recompute_comm"] = settings["recompute_comm"]
    config = AcConfig.from_dict(data)
    plan = mac.plan_ac(gpt8, config=config)
    path = tmp_path / "plan.yaml"
    path.write_text(plan.to_yaml())
    for label, written in (("plan.to_dict()", AcConfig.from_dict(plan.to_dict())),
                           ("plan.to_yaml()", AcConfig.from_dict(yaml.safe_load(path.read_text()))),
                           ("AcConfig.from_yaml", AcConfig.from_yaml(str(path)))):
        for name, field_name in SETTINGS:
            assert getattr(getattr(written, name), field_name) == settings[name][field_name], \
                f"{label}: {name}.{field_name}"
        again = mac.plan_ac(gpt8, config=written)
        assert str(again) == str(plan) and again.to_dict() == plan.to_dict(), label
