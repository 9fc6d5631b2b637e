import pytest

from mindformers_ac import ConfigError, parse_layer_specs
from mindformers_ac.layer_specs import format_layer_specs


@pytest.mark.parametrize("specs, expected", [
    (["0-3", 8], [0, 1, 2, 3, 8]),
    ([0, 1, 2], [0, 1, 2]),
    ([" 2 - 4 ", "6"], [2, 3, 4, 6]),
    (("5-5",), [5]),
    ([9], [9]),
])
def test_valid_specs_expand_in_order(specs, expected):
    assert parse_layer_specs(specs, 10) == expected


@pytest.mark.parametrize("specs, field, words", [
    ([True], "layers[0]", "bool"),
    ([-1], "layers[0]", ">= 0"),
    ([1.5], "layers[0]", "float"),
    (["3-"], "layers[0]", "'3-'"),
    (["a-b"], "layers[0]", "'a-b'"),
    (["5-2"], "layers[0]", "start must be <= end"),
    ([0, "3-"], "layers[1]", "'3-'"),
    ([3, 1], "layers[1]", "strictly ascending"),
    (["0-3", 2], "layers[1]", "overlap"),
    (["0-3", "3-5"], "layers[1]", "overlap"),
    ([1, 1], "layers[1]", "strictly ascending"),
    ([10], "layers[0]", "out of range"),
    (["8-12"], "layers[0]", "valid ids are 0-9"),
    ([], "layers", "empty"),
    ("0-3", "layers", "list"),
    (3, "layers", "list"),
    ([None], "layers[0]", "NoneType"),
])
def test_invalid_specs_name_the_entry(specs, field, words):
    with pytest.raises(ConfigError) as info:
        parse_layer_specs(specs, 10)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")
    assert words in str(info.value)


def test_field_prefix_is_used_in_messages():
    with pytest.raises(ConfigError, match=r"^swap\.layer_swap\[0\]\.layers\[1\]:"):
        parse_layer_specs([0, 99], 4, field="swap.layer_swap[0].layers")


def test_format_is_the_inverse_of_parse():
    specs = format_layer_specs([8, 0, 1, 2, 3, 5])
    assert specs == ["0-3", 5, 8]
    assert parse_layer_specs(specs, 9) == [0, 1, 2, 3, 5, 8]
