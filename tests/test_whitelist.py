from types import SimpleNamespace

import pytest
from mindspore import mint, nn, ops

import mindformers_ac as mac
from mindformers_ac import ConfigError
from mindformers_ac.matching import drop_covered, match_entries
from mindformers_ac.whitelist import layer_inventory


class _StandInAllGather(nn.Cell):
    def construct(self, x):
        return x


class _TPLinear(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense = mint.nn.Linear(4, 4)
        self._comm_ops = {"all_gather": _StandInAllGather()}
        self.cast = ops.Cast()

    def construct(self, x):
        return self.dense(self._comm_ops["all_gather"](x))


class _Layer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = _TPLinear()
        self.act = lambda x: ops.gelu(x)
        self.scale = 2.0

    def construct(self, x):
        return self.act(self.linear_fc1(x)) * self.scale

    def helper(self, x):
        return x


def test_reference_layer_whitelist_has_cells_and_ops(gpt8):
    wl = mac.get_single_layer_whitelist(gpt8.decoder.layers[0])
    for path in ("input_layernorm", "self_attention", "self_attention.linear_qkv",
                 "self_attention.core_attention", "self_attention.linear_proj", "pre_mlp_layernorm",
                 "mlp", "mlp.linear_fc1", "mlp.linear_fc2"):
        assert path in wl
    for op in ("mlp.activation_func", "self_attention.core_attention.softmax",
               "self_attention.core_attention.bmm_qk", "self_attention.core_attention.bmm_pv"):
        assert op in wl
    assert not any(p.endswith((".construct", ".training", ".scale", ".head_dim")) for p in wl)
    assert len(wl) == len(set(wl))


def test_whitelist_is_deterministic(gpt8):
    assert mac.get_single_layer_whitelist(gpt8.decoder.layers[0]) == \
        mac.get_single_layer_whitelist(gpt8.decoder.layers[0])
    # every layer of a homogeneous model has the same whitelist
    assert mac.get_single_layer_whitelist(gpt8.decoder.layers[0]) == \
        mac.get_single_layer_whitelist(gpt8.decoder.layers[7])


def test_comm_registry_lambdas_and_primitives_are_ops_class_methods_are_methods():
    inventory = {e.path: e for e in layer_inventory(_Layer())}
    assert inventory["linear_fc1.all_gather"].kind == "op"
    assert inventory["linear_fc1.all_gather"].registry == "_comm_ops"
    assert inventory["linear_fc1.cast"].kind == "op"
    assert inventory["act"].kind == "op"
    assert inventory["linear_fc1"].kind == "cell"
    # MindFormers' walker lists a cell's class-owned methods too, so select_module can name them
    assert inventory["helper"].kind == "method" and inventory["helper"].owner_path == ""
    assert "construct" not in inventory and "scale" not in inventory


class _Base(nn.Cell):
    def shared(self, x):
        return x

    def _private(self, x):
        return x


class _Attention(_Base):
    def __init__(self):
        super().__init__()
        self.linear_qkv = mint.nn.Linear(4, 12)
        self.overridden = lambda x: x

    def construct(self, x):
        return self.get_query_key_value_tensors(x)

    def get_query_key_value_tensors(self, x):
        return self.linear_qkv(x).chunk(3, -1)

    @staticmethod
    def static_helper(x):
        return x

    @classmethod
    def class_helper(cls, x):
        return x

    @property
    def a_property(self):
        return self.shared

    def overridden(self, x):   # the instance attribute of this name wins
        return x


class _Dense(nn.Dense):
    def mine(self, x):
        return x


def test_methods_of_the_cells_own_classes_are_listed_not_mindspores():
    layer = nn.SequentialCell()
    layer.insert_child_to_cell("self_attention", _Attention())
    layer.insert_child_to_cell("dense", _Dense(4, 4))
    inventory = {e.path: e for e in layer_inventory(layer)}
    methods = [p for p, e in inventory.items() if e.kind == "method"]
    # own class first, in definition order, then the base class; no construct, no private name, no property,
    # no name the instance overrides; nn.Cell's and nn.Dense's API is not listed
    assert methods == ["self_attention.get_query_key_value_tensors", "self_attention.static_helper",
                       "self_attention.class_helper", "self_attention.shared", "dense.mine"]
    entry = inventory["self_attention.get_query_key_value_tensors"]
    assert (entry.owner_path, entry.attr, entry.cell_path) == ("self_attention", "get_query_key_value_tensors",
                                                               "self_attention")
    assert "self_attention.overridden" not in inventory   # as an instance override of construct
    assert "self_attention.cells_and_names" not in inventory and "dense.extend_repr" not in inventory


def test_instance_override_of_a_method_is_not_an_op():
    layer = _Layer()
    layer.construct = lambda x: x
    assert "construct" not in mac.get_single_layer_whitelist(layer)


def test_fullmatch_not_search(gpt8):
    entries = layer_inventory(gpt8.decoder.layers[0])
    assert [e.path for e in match_entries("mlp", entries, "f")] == ["mlp"]
    assert [e.path for e in match_entries("ml", entries, "f")] == []
    assert {e.path for e in match_entries(".*attention", entries, "f")} == \
        {"self_attention", "self_attention.core_attention"}


def test_parent_covers_children(gpt8):
    entries = layer_inventory(gpt8.decoder.layers[0])
    matched = match_entries(r"mlp(\..*)?|self_attention\.core_attention(\..*)?", entries, "f")
    assert [e.path for e in drop_covered(matched)] == ["self_attention.core_attention", "mlp"]


def test_catastrophic_pattern_times_out_with_config_error():
    with pytest.raises(ConfigError, match=r"^recompute\.select_module\['\(a\|aa\)\+b'\]: .*catastrophic"):
        match_entries("(a|aa)+b", [SimpleNamespace(path="a" * 40)], "recompute.select_module['(a|aa)+b']")
