"""Hostile and careless configs: every input is accepted or a ConfigError / exit 2 that names the field,
in bounded time, memory and message size, and a rejected config leaves the model untouched.

The in-process tests use inputs that the unbounded code accepted or answered
slowly but harmlessly; the inputs that ate gigabytes run in a subprocess under
``RLIMIT_AS`` (the ``slow`` tests at the end).
"""
import contextlib
import io
import json
import os
import pathlib
import resource
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mindspore import nn

import mindformers_ac as mac
from mindformers_ac import AcConfig, ConfigError, RecomputeConfig, parse_layer_specs
from mindformers_ac.errors import quote
from mindformers_ac.harness.cli import main
from mindformers_ac.harness.models import build_gpt
from mindformers_ac.layer_specs import format_layer_specs
from mindformers_ac.limits import (
    MATCH_BUDGET_S,
    MAX_CONFIG_BYTES,
    MAX_LAYERS,
    MAX_MESSAGE_CHARS,
    MAX_NUMBER_CHARS,
    MAX_PATTERN_CHARS,
    MAX_REPEAT_PRODUCT,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
)

from conftest import model_fingerprint

REPO = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = ("recompute", "recompute_comm", "swap")
# A message, field path included, is clipped near MAX_MESSAGE_CHARS; the CLI adds "error: ".
MESSAGE_BOUND = MAX_MESSAGE_CHARS + 100
# Wall-clock bound per in-process case: generous for a loaded 2-core machine,
# far below what the unbounded code took (tens of seconds).
WALL_BOUND_S = 15


@pytest.fixture(scope="module")
def tiny():
    return build_gpt(num_layers=4, hidden_size=16, num_heads=2, seq_length=8, vocab_size=32)


def write(directory, data, name="cfg.yaml"):
    path = pathlib.Path(directory) / name
    path.write_bytes(data if isinstance(data, bytes) else textwrap.dedent(data).encode("utf-8"))
    return path


def rejects(call, field=None, *words):
    """Run ``call``; it must raise a bounded ConfigError on ``field`` whose message has ``words``."""
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        call()
    assert time.monotonic() - start < WALL_BOUND_S
    exc, message = info.value, str(info.value)
    assert len(message) <= MESSAGE_BOUND, message[:300]
    assert exc.field == field, message
    if field is not None:
        assert message.startswith(field + ": "), message
    for word in words:
        assert word in message, message
    return message


def run_cli(*argv):
    """``mindformers-ac ARGV`` in process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:   # argparse's own errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def assert_cli_outcome(code, err):
    assert code in (0, 2), (code, err[:300])
    assert len(err) <= MESSAGE_BOUND + 1000 and "Traceback" not in err, err[:300]
    if code == 2:
        assert err.startswith("error: ") or "usage:" in err, err[:300]


# --- layer ranges ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data, field", [
    ({"swap": {"enable": True, "layer_swap": [{"layers": [f"0-{MAX_LAYERS}"]}]}}, "swap.layer_swap[0].layers[0]"),
    ({"swap": {"enable": True, "layer_swap": [{"layers": [0]}, {"layers": ["1-999999999999"]}]}},
     "swap.layer_swap[1].layers[0]"),
    ({"recompute": {"mode": "full", "full_recompute_layer": [2, 10 ** 30]}}, "recompute.full_recompute_layer[1]"),
    ({"recompute": {"mode": "select", "select_module": {".*mlp": ["0-" + "9" * 40]}}},
     "recompute.select_module['.*mlp'][0]"),
    ({"swap": {"enable": True, "op_swap": [{"op_name": "mlp", "layers": [MAX_LAYERS]}]}},
     "swap.op_swap[0].layers[0]"),
])
def test_layer_ids_beyond_the_maximum_are_rejected_structurally(data, field):
    rejects(lambda: AcConfig.from_dict(data), field, "beyond the supported maximum", str(MAX_LAYERS - 1))


def test_parse_layer_specs_checks_the_bound_before_expanding():
    rejects(lambda: parse_layer_specs([f"0-{MAX_LAYERS}"], None), "layers[0]", "beyond the supported maximum")
    rejects(lambda: parse_layer_specs(["0-99999999999"], 8), "layers[0]")
    assert len(parse_layer_specs([f"0-{MAX_LAYERS - 1}"], None)) == MAX_LAYERS


def test_layer_swap_overlap_is_found_on_ranges():
    rejects(lambda: AcConfig.from_dict({"swap": {"enable": True, "layer_swap": [
        {"layers": ["0-3", "100-9000"]}, {"layers": [5, "8990-9999"]}]}}),
        "swap.layer_swap[1].layers", "layer 8990 is already listed in swap.layer_swap[0]")
    AcConfig.from_dict({"swap": {"enable": True, "layer_swap": [
        {"layers": ["0-3", "100-9000"]}, {"layers": ["4-99", "9001-9999"]}]}})


@pytest.mark.parametrize("entry", ["٠-٣", "٣", "０-３", "1-٣", "𝟘-𝟛", "0\u2003-\u20033", "0 -\n3"])
def test_only_ascii_digits_and_blanks_make_a_layer_range(entry):
    rejects(lambda: parse_layer_specs([entry], None), "layers[0]", "ASCII digits")


# --- patterns -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, words", [
    ("(?:a{50}){50}", "multiply to more than"),
    ("a{2}b{30}c{30}", "multiply to more than"),
    (f"x{{{MAX_REPEAT_PRODUCT + 1}}}", "multiply to more than"),
    ("x{99999999999999999999}", "multiply to more than"),
    ("x{5,1001}", "multiply to more than"),
    ("(?:x" + "y" * MAX_PATTERN_CHARS + ")", f"limit of {MAX_PATTERN_CHARS}"),
    ("(" * 300 + ")" * 300, f"limit of {MAX_PATTERN_CHARS}"),
])
@pytest.mark.parametrize("section", ["recompute", "recompute_comm", "exclude_op", "op_swap"])
def test_pattern_compile_cost_is_bounded(section, pattern, words):
    data, field = {
        "recompute": ({"recompute": {"mode": "select", "select_module": {pattern: [0]}}},
                      f"recompute.select_module[{quote(pattern)}]"),
        "recompute_comm": ({"recompute_comm": {"enable": True, "select_module": {pattern: [0]}}},
                           f"recompute_comm.select_module[{quote(pattern)}]"),
        "exclude_op": ({"recompute": {"mode": "full", "full_recompute_layer": [0], "exclude_op": {pattern: [0]}}},
                       f"recompute.exclude_op[{quote(pattern)}]"),
        "op_swap": ({"swap": {"enable": True, "op_swap": [{"op_name": pattern, "layers": [0]}]}},
                    "swap.op_swap[0].op_name"),
    }[section]
    rejects(lambda: AcConfig.from_dict(data), field, words)


@pytest.mark.parametrize("pattern", [r"layers\.[0-9]{1,3}", r".*mlp(\.linear_fc[12]){0,1}", "a{10}b{10}c{10}",
                                     f"(?:a{{{MAX_REPEAT_PRODUCT}}})",
                                     "x" * MAX_PATTERN_CHARS, r"\{not a repeat\}"])
def test_patterns_within_the_limits_are_accepted(pattern):
    AcConfig.from_dict({"recompute": {"mode": "select", "select_module": {pattern: [0]}}})


class _LongNames(nn.Cell):
    """A layer whose sub-cell paths are long runs of ``a``: the worst case for ``(a|aa)+b``."""

    def __init__(self):
        super().__init__()
        for k in range(8):
            setattr(self, "a" * 40 + f"x{k}", nn.Cell())


class _LongNamesModel(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([_LongNames() for _ in range(4)])


@pytest.mark.parametrize("entry", [mac.plan_ac, mac.apply_ac], ids=["plan_ac", "apply_ac"])
def test_one_match_budget_for_the_whole_plan(entry):
    """32 paths each worth a timeout: the unbounded planner spent 0.5 s of CPU on each."""
    model = _LongNamesModel()
    before = model_fingerprint(model)
    cpu = time.process_time()
    rejects(lambda: entry(model, config={"recompute": {"mode": "select", "select_module": {"(a|aa)+b": ["0-3"]}}}),
            "recompute.select_module['(a|aa)+b']", f"{MATCH_BUDGET_S:g}s budget", "catastrophic")
    # regex's timeout counts CPU time: this bound holds however loaded the machine is
    assert time.process_time() - cpu < MATCH_BUDGET_S + 3
    assert model_fingerprint(model) == before and mac.ac_state(model) is None


# --- YAML -----------------------------------------------------------------------------------------------------

def _laughs(levels, fanout=10, target="recompute"):
    lines = ["l0: &l0 [" + ", ".join(["lol"] * fanout) + "]"]
    lines += [f"l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * fanout) + "]" for k in range(1, levels + 1)]
    return "\n".join(lines) + f"\n{target}: *l{levels}\n"


@pytest.mark.parametrize("text, field, line", [
    (_laughs(4), "l3[7]", 4),   # 111,111 nodes once expanded; its repr in a message was 50 KB
    (_laughs(3, target="swap: {enable: true, layer_swap: [{layers: *l3}]}\nx"), "l3[7]", 4),
    (_laughs(12, fanout=2), "l11[0]", 12),
    ("a: &a [1, 2]\nb: [" + ", ".join(["*a"] * 4000) + "]\n", "b[3331]", 2),
])
def test_alias_expansion_is_budgeted(tmp_path, text, field, line):
    """The field is the alias that crossed the budget; the message names the file, line and column."""
    rejects(lambda: AcConfig.from_yaml(write(tmp_path, text)), field, "alias bomb",
            f"more than {MAX_YAML_NODES} nodes", f"cfg.yaml, line {line}, column")


def test_documents_within_the_node_budget_load(tmp_path):
    text = "a: &a {layers: [0-1]}\nswap: {enable: true, layer_swap: [*a]}\nbig: [" + \
        ", ".join(["1"] * (MAX_YAML_NODES - 20)) + "]\n"
    assert AcConfig.from_yaml(write(tmp_path, text)).swap.layer_swap == [{"layers": ["0-1"]}]
    rejects(lambda: AcConfig.from_yaml(write(tmp_path, "big: [" + ", ".join(["1"] * MAX_YAML_NODES) + "]\n")),
            f"big[{MAX_YAML_NODES - 1}]", f"more than {MAX_YAML_NODES} nodes")


def test_recursive_alias_is_refused(tmp_path):
    rejects(lambda: AcConfig.from_yaml(write(tmp_path, "recompute: &r {mode: full, full_recompute_layer: [*r]}\n")),
            "recompute.full_recompute_layer[0]", "alias *r refers to the node that contains it")


def test_nesting_and_number_literals_are_bounded(tmp_path):
    deep = "x: " + "[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1) + "\n"
    rejects(lambda: AcConfig.from_yaml(write(tmp_path, deep)), "x" + "[0]" * (MAX_YAML_DEPTH - 1), "nested more")
    for literal in ("1" * (MAX_NUMBER_CHARS + 1), "1" + ":1" * 60, "0." + "1" * MAX_NUMBER_CHARS):
        rejects(lambda: AcConfig.from_yaml(write(tmp_path, f"swap:\n  default_prefetch: {literal}\n")),
                "swap.default_prefetch", "number literal")


@pytest.mark.parametrize("raw, offset, byte", [
    ("recompute:\n  mode: full  # café\n".encode("latin-1"), 30, 0xe9),
    ("recompute: {mode: full}\n".encode("utf-16"), 0, 0xff),
    ("recompute: {mode: full}\n".encode("utf-16-be"), 0, 0x00),
    (b"x: 1\n" + bytes(range(128, 256)), 5, 0x80),
])
def test_non_utf8_files_name_the_byte_offset(tmp_path, raw, offset, byte):
    if raw[0] == 0:   # UTF-16-BE starts with a NUL byte, which is valid UTF-8: PyYAML rejects it
        rejects(lambda: AcConfig.from_yaml(write(tmp_path, raw)), None, "cfg.yaml")
        return
    rejects(lambda: AcConfig.from_yaml(write(tmp_path, raw)), None, "cfg.yaml", "not UTF-8",
            f"byte 0x{byte:02x} at offset {offset}")


def test_utf8_with_bom_is_read(tmp_path):
    cfg = AcConfig.from_yaml(write(tmp_path, "\ufeffrecompute: {mode: full, full_recompute_layer: [0]}\n"
                                   .encode("utf-8")))
    assert cfg.recompute.mode == "full"


def test_files_over_the_size_limit_are_refused_unread(tmp_path):
    path = write(tmp_path, b"# " + b"x" * MAX_CONFIG_BYTES + b"\nrecompute: {mode: full}\n")
    rejects(lambda: AcConfig.from_yaml(path), None, f"is {path.stat().st_size} bytes",
            f"limit of {MAX_CONFIG_BYTES} bytes")
    path = write(tmp_path, b"# " + b"x" * (MAX_CONFIG_BYTES - 100) + b"\nrecompute: {mode: None}\n")
    assert AcConfig.from_yaml(path) == AcConfig()


@pytest.mark.parametrize("text, field, first_line", [
    ("recompute:\n  mode: full\n  full_recompute_layer: [0]\n  mode: select\n", "recompute.mode", 2),
    ("recompute: {mode: full}\nswap: {}\nrecompute: {mode: None}\n", "recompute", 1),
    ("recompute:\n  mode: select\n  select_module:\n    '.*mlp': [0]\n    .*mlp: [1]\n",
     "recompute.select_module['.*mlp']", 4),
    ("swap:\n  layer_swap:\n    - layers: [0]\n      layers: [1]\n", "swap.layer_swap[0].layers", 3),
    ("model:\n  8: a\n  0x8: b\n", "model[8]", 2),
])
def test_duplicate_keys_are_errors_naming_the_key(tmp_path, text, field, first_line):
    rejects(lambda: AcConfig.from_yaml(write(tmp_path, text)), field, "duplicate key",
            f"also set at line {first_line}", "cfg.yaml")


def test_merge_keys_may_override(tmp_path):
    text = "base: &b {enable: true, layer_swap: [{layers: [0]}]}\nswap: {<<: *b, default_prefetch: 2}\n"
    assert AcConfig.from_yaml(write(tmp_path, text)).swap.default_prefetch == 2


@pytest.mark.parametrize("path, words", [
    (None, "got NoneType None"), (123, "got int 123"), (1.5, "got float"), (["a.yaml"], "got list"),
])
def test_from_yaml_needs_a_path(path, words):
    rejects(lambda: AcConfig.from_yaml(path), "path", "expected the path of a YAML file", words)


@pytest.mark.parametrize("path", ["x" * 100_000, "bad\0name.yaml", "/proc/self/nonexistent/x.yaml"])
def test_unreadable_paths_are_config_errors(path):
    rejects(lambda: AcConfig.from_yaml(path), None)


# --- configs changed after they were built --------------------------------------------------------------------

def _mutations():
    def mode(c):
        c.recompute.mode = "bogus"

    def layer_swap(c):
        c.swap.layer_swap = "garbage"

    def bad_swap_dict(c):
        c.swap = {"enable": True, "layer_swap": [{"layers": [0, 0]}]}

    def swap_int(c):
        c.swap = 5

    def wrong_section(c):
        c.recompute = c.swap

    def in_place(c):
        c.recompute = RecomputeConfig(mode="full", full_recompute_layer=[0])
        c.recompute.full_recompute_layer.append("1-")

    def prefetch(c):
        c.swap.default_prefetch = "2"

    return [(mode, "recompute.mode"), (layer_swap, "swap.layer_swap"), (bad_swap_dict, "swap.layer_swap[0].layers[1]"),
            (swap_int, "swap"), (wrong_section, "recompute"), (in_place, "recompute.full_recompute_layer[1]"),
            (prefetch, "swap.default_prefetch")]


@pytest.mark.parametrize("mutate, field", _mutations(), ids=[f for _, f in _mutations()])
@pytest.mark.parametrize("entry", [mac.plan_ac, mac.apply_ac], ids=["plan_ac", "apply_ac"])
def test_fields_changed_after_building_are_checked_again(tiny, entry, mutate, field):
    config = AcConfig()
    mutate(config)
    before = model_fingerprint(tiny)
    rejects(lambda: entry(tiny, config=config), field)
    name = field.split(".")[0].split("[")[0]
    section = getattr(config, name)
    if not isinstance(section, (dict, int)):   # the changed section alone, as MindFormers passes it
        rejects(lambda: entry(tiny, **{name: section}), field)
    assert model_fingerprint(tiny) == before and mac.ac_state(tiny) is None


def test_a_section_replaced_by_a_valid_mapping_is_built(tiny):
    config = AcConfig()
    config.swap = {"enable": True, "layer_swap": [{"layers": [1]}]}
    assert mac.plan_ac(tiny, config=config).layers[1].layer_swap


# --- the validate command -------------------------------------------------------------------------------------

def test_validate_checks_pp_without_num_layers(tmp_path):
    path = write(tmp_path, "swap: {enable: true, layer_swap: [{layers: [0]}]}\n")
    code, out, _ = run_cli("validate", path, "--pp", 2)   # swap on pipeline stages is allowed
    assert code == 0 and "OK" in out
    assert run_cli("validate", path, "--pp", 0)[2].startswith("error: pp: ")
    assert run_cli("validate", path)[0] == 0


@pytest.mark.parametrize("num_layers, field", [
    (10 ** 20, "num_layers"), (MAX_LAYERS + 1, "num_layers"), (0, "num_layers"), (-3, "num_layers"),
    ("9" * 5000, "--num-layers"), ("x", "--num-layers"), ("٣", "--num-layers"), ("", "--num-layers"),
])
def test_validate_num_layers_is_bounded(tmp_path, num_layers, field):
    path = write(tmp_path, "recompute: {mode: full, full_recompute_layer: [0-1]}\n")
    code, out, err = run_cli("validate", path, "--num-layers", num_layers)
    assert code == 2 and len(err) < MESSAGE_BOUND + 500 and "Traceback" not in err
    assert (f"error: {field}: " in err) if field == "num_layers" else (f"argument {field}" in err)


def test_quoted_values_are_short():
    message = rejects(lambda: AcConfig.from_dict({"recompute": {"mode": "m" * 1_000_000}}), "recompute.mode")
    assert len(message) < 400 and "(1000000 characters)" in message
    nested = [0]
    for _ in range(200):
        nested = [nested, nested]
    rejects(lambda: AcConfig.from_dict({"recompute": {"mode": nested}}), "recompute.mode")
    rejects(lambda: AcConfig.from_dict({"recompute": {"mode": 10 ** 5000}}), "recompute.mode", "<int of")
    rejects(lambda: AcConfig.from_dict({"recompute": {"k" * 10_000: 1}}),
            "recompute['" + "k" * 199 + "... (10000 characters)]", "unknown key")


# --- fuzz -----------------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=int(os.environ.get("MAC_FUZZ_EXAMPLES", "300")), deadline=None, database=None,
                derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def mostly(plausible, hostile):
    """Three draws in four from ``plausible`` (so that planning is reached), one from ``hostile``."""
    return st.sampled_from([plausible, plausible, plausible, hostile]).flatmap(lambda strategy: strategy)


SCALARS = (st.none() | st.booleans() | st.integers(-5, 12) | st.integers(-10 ** 30, 10 ** 30) | st.floats()
           | st.text(max_size=8))
# layer ids of the 4-layer model, sometimes one too many
PLAUSIBLE_SPECS = st.sets(st.integers(0, 4), min_size=1, max_size=3).map(format_layer_specs)
RANGES = (st.integers(0, 12) | st.integers(0, 10 ** 15)
          | st.tuples(st.integers(0, 12), st.integers(0, 12)).map(lambda t: f"{t[0]}-{t[1]}")
          | st.sampled_from(["٠-٣", "０-３", "3-", " 1 - 2 ", "0-999999999999", "a-b", "-1", "1--2", "2-1"]))
SPECS = mostly(PLAUSIBLE_SPECS, st.lists(RANGES | SCALARS, max_size=5) | RANGES | SCALARS | st.sampled_from(
    [["0-999999999999"], [10 ** 15], ["٠-٣"], ["0-3", "2-9999"], [[0, 1]], ["0-" + "9" * 5000]]))
PLAUSIBLE_PATTERNS = st.sampled_from([".*mlp", "mlp", ".*attention", r"mlp\.activation_func", "self_attention.*",
                                      "(?i)MLP", r"self_attention\.core_attention", "nothing", r"mlp\.linear_fc[12]"])
PATTERNS = mostly(PLAUSIBLE_PATTERNS, st.text(max_size=12) | st.sampled_from([
    "[", "", ".*", "(a|aa)+b", "(?:(?:a{200}){200}){200}", "x" * 600, "a{1001}", r"layers\.[0-9]{1,3}", "\\",
    "(?P<n>mlp)", "(?V1)[[a]--[b]]", "(?:mlp){e<=1}", 7]))
PATTERN_MAP = mostly(st.dictionaries(PATTERNS, SPECS, min_size=1, max_size=2),
                     st.dictionaries(PATTERNS, SPECS, max_size=3) | SCALARS)


def _section(plausible, fields):
    """Mostly one of the ``plausible`` shapes; else any subset of ``fields`` plus an unknown key, or garbage."""
    hostile = st.fixed_dictionaries({}, optional={**fields, "extra": SCALARS}) | SCALARS | st.lists(SCALARS, max_size=2)
    return mostly(st.one_of(*plausible), hostile)


EXCLUDE_OP = st.lists(st.sampled_from(["MatMul", "AllGather", ""]) | SCALARS, max_size=3) | PATTERN_MAP
RECOMPUTE = _section([
    st.just({"mode": "None"}),
    st.fixed_dictionaries({"mode": st.just("full"), "full_recompute_layer": SPECS},
                          optional={"exclude_op": EXCLUDE_OP}),
    st.fixed_dictionaries({"mode": st.just("select"), "select_module": PATTERN_MAP},
                          optional={"full_recompute_layer": SPECS, "exclude_op": EXCLUDE_OP}),
], {
    "mode": st.sampled_from(["None", "full", "select", "bogus", "Full"]) | SCALARS,
    "full_recompute_layer": SPECS,
    "select_module": PATTERN_MAP,
    "exclude_op": EXCLUDE_OP,
})
RECOMPUTE_COMM = _section([
    st.fixed_dictionaries({"enable": st.just(True), "select_module": PATTERN_MAP}), st.just({"enable": False}),
], {"enable": st.booleans() | SCALARS, "select_module": PATTERN_MAP})
ENTRY = mostly(st.fixed_dictionaries({"layers": SPECS}),
               st.fixed_dictionaries({}, optional={"layers": SPECS, "op_name": PATTERNS, "extra": SCALARS}) | SCALARS)
OP_ENTRY = mostly(st.fixed_dictionaries({"op_name": PATTERNS, "layers": SPECS}), ENTRY)
SWAP = _section([
    st.fixed_dictionaries({"enable": st.just(True), "default_prefetch": st.integers(1, 3)},
                          optional={"layer_swap": st.lists(ENTRY, min_size=1, max_size=2),
                                    "op_swap": st.lists(OP_ENTRY, min_size=1, max_size=2)}),
], {
    "enable": st.booleans() | SCALARS,
    "default_prefetch": st.integers(-2, 5) | SCALARS,
    "layer_swap": st.lists(ENTRY, max_size=3) | SCALARS,
    "op_swap": st.lists(OP_ENTRY, max_size=3) | SCALARS,
})
CONFIGS = mostly(st.fixed_dictionaries({}, optional={"recompute": RECOMPUTE, "recompute_comm": RECOMPUTE_COMM,
                                                     "swap": SWAP, "seed": SCALARS}), SCALARS)


def _names_its_field(exc, allowed=SECTIONS):
    """A bounded message that starts with the field path, whose first part is in ``allowed`` (None: any)."""
    message = str(exc)
    assert len(message) <= MESSAGE_BOUND, message[:300]
    if exc.field is None:
        return
    assert message.startswith(exc.field + ": "), message
    assert allowed is None or exc.field.split(".")[0].split("[")[0] in allowed, message


def _peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


class _Bounded:
    """Asserts that a block stays within the wall-time bound and grows the process peak by < 256 MiB.

    The peak only rises when a new high is reached, so an example that once took
    gigabytes (a regex bomb, an expanded range) fails here instead of passing slowly.
    """

    def __enter__(self):
        self.start, self.peak = time.monotonic(), _peak_rss_mib()

    def __exit__(self, *exc_info):
        if exc_info[0] is None:
            assert time.monotonic() - self.start < WALL_BOUND_S
            assert _peak_rss_mib() - self.peak < 256


FIELDS = {"recompute": ("mode", "full_recompute_layer", "select_module", "exclude_op"),
          "recompute_comm": ("enable", "select_module"),
          "swap": ("enable", "default_prefetch", "layer_swap", "op_swap")}
# a field (or a whole section, None) of the built config changed to any value
CHANGES = st.none() | st.sampled_from([(sec, f) for sec, fs in FIELDS.items() for f in fs + (None,)]).flatmap(
    lambda where: st.tuples(st.just(where), SPECS | PATTERN_MAP | SCALARS | {"recompute": RECOMPUTE,
                            "recompute_comm": RECOMPUTE_COMM, "swap": SWAP}[where[0]]))


@FUZZ
@given(data=CONFIGS, pp=st.sampled_from([1, 1, 2, 0]), change=CHANGES,
       entry=st.sampled_from([mac.plan_ac, mac.plan_ac, mac.plan_ac, mac.apply_ac]))
def test_fuzz_sections_through_from_dict_and_plan_ac(tiny, data, pp, change, entry):
    with _Bounded():
        try:
            config = AcConfig.from_dict(data)
        except ConfigError as exc:
            _names_its_field(exc)
            assert exc.field is not None or not isinstance(data, dict)
            event("rejected by from_dict")
            return
        if change is not None:
            (section, name), value = change
            setattr(config, section, value) if name is None else setattr(getattr(config, section), name, value)
        before = model_fingerprint(tiny)
        try:
            entry(tiny, config=config, pp=pp)
            event(f"accepted by {entry.__name__}")
            if entry is mac.apply_ac:
                mac.remove_ac(tiny)
        except ConfigError as exc:
            _names_its_field(exc, SECTIONS + ("pp", "layer_offset"))
            assert exc.field is not None
            event(f"rejected by {entry.__name__}")
        assert model_fingerprint(tiny) == before and mac.ac_state(tiny) is None


@st.composite
def yaml_files(draw):
    """YAML text from random sections, then a random hostile edit and a random encoding."""
    text = yaml.safe_dump(draw(CONFIGS), sort_keys=False, allow_unicode=True)
    edit = draw(mostly(st.just("none"), st.sampled_from(["laughs", "recursive", "duplicate", "deep", "number",
                                                          "noise", "cut", "tag", "documents"])))
    if edit == "laughs":
        text = _laughs(draw(st.integers(1, 9)), draw(st.integers(2, 10)),
                       target=draw(st.sampled_from(["recompute", "swap", "x"]))) + text
    elif edit == "recursive":
        text = "a: &a [0, *a]\n" + text
    elif edit == "duplicate":
        lines = text.splitlines() or ["x: 1"]
        k = draw(st.integers(0, len(lines) - 1))
        text = "\n".join(lines[:k + 1] + lines[k:]) + "\n"
    elif edit == "deep":
        depth = draw(st.integers(1, 3 * MAX_YAML_DEPTH))
        text += "deep: " + "[" * depth + "]" * depth + "\n"
    elif edit == "number":
        text += "n: " + draw(st.sampled_from(["1", "1:2", "0x", "0b1"])) + "1" * draw(st.integers(0, 300)) + "\n"
    elif edit == "noise":
        k = draw(st.integers(0, len(text)))
        text = text[:k] + draw(st.text(max_size=20)) + text[k:]
    elif edit == "cut":
        text = text[:draw(st.integers(0, len(text)))]
    elif edit == "tag":
        text = "x: !!python/object/apply:os.system ['true']\n" + text
    elif edit == "documents":
        text += "---\n" + text
    encoding = draw(mostly(st.just("utf-8"), st.sampled_from(["utf-8-sig", "utf-16", "utf-16-be", "latin-1"])))
    raw = text.encode(encoding, errors="replace")
    if draw(mostly(st.just(False), st.just(True))):
        k = draw(st.integers(0, len(raw)))
        raw = raw[:k] + draw(st.binary(max_size=8)) + raw[k:]
    return raw


CLI_NUMBERS = (st.none() | st.integers(-10, 20) | st.integers(-10 ** 25, 10 ** 25)
               | st.sampled_from(["", "x", "1e3", "0x10", "٣", "9" * 4400, " 7 ", "2000000000"]))


@FUZZ
@given(raw=yaml_files(), num_layers=CLI_NUMBERS, pp=CLI_NUMBERS)
def test_fuzz_yaml_files_through_from_yaml_and_validate(tmp_path_factory, raw, num_layers, pp):
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_bytes(raw)
    bounded = _Bounded()
    bounded.__enter__()
    try:
        AcConfig.from_yaml(path)
        event("loaded")
    except ConfigError as exc:
        _names_its_field(exc, None)
        assert "fuzz.yaml" in str(exc), str(exc)[:300]
        event("rejected: " + ("file" if exc.field is None else "field"))
    argv = ["validate", path] + (["--num-layers", num_layers] if num_layers is not None else []) + \
        (["--pp", pp] if pp is not None else [])
    code, _, err = run_cli(*argv)
    assert_cli_outcome(code, err)
    bounded.__exit__(None, None, None)


@FUZZ
@given(num_layers=CLI_NUMBERS, pp=CLI_NUMBERS, config=st.sampled_from(["full", "swap", "select"]))
def test_fuzz_cli_numbers(tmp_path_factory, num_layers, pp, config):
    text = {"full": "recompute: {mode: full, full_recompute_layer: [0-1]}\n",
            "swap": "swap: {enable: true, default_prefetch: 2, layer_swap: [{layers: [1-2]}]}\n",
            "select": "recompute: {mode: select, select_module: {'.*mlp': [3]}}\n"}[config]
    path = tmp_path_factory.getbasetemp() / f"numbers_{config}.yaml"
    path.write_text(text)
    argv = ["validate", path] + (["--num-layers", num_layers] if num_layers is not None else []) + \
        (["--pp", pp] if pp is not None else [])
    code, out, err = run_cli(*argv)
    assert_cli_outcome(code, err)
    if code == 2 and err.startswith("error: "):
        assert err[len("error: "):].split(":")[0] in (
            "num_layers", "pp", "swap.enable", "swap.default_prefetch", "swap.layer_swap[0].layers",
            "recompute.full_recompute_layer[0]", "recompute.select_module['.*mlp'][0]"), err
    if code == 0:
        assert "OK: " in out


# --- the nastiest inputs, in a subprocess under RLIMIT_AS -----------------------------------------------------

_NASTY = r'''
import contextlib, io, json, os, resource, sys, time
import mindformers_ac as mac
from mindformers_ac.harness.cli import main
from mindspore import nn

tmp = sys.argv[1]


def write(name, data):
    path = os.path.join(tmp, name)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    return path


def laughs(levels, fanout=10):
    lines = ["l0: &l0 [" + ", ".join(["lol"] * fanout) + "]"]
    lines += [f"l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * fanout) + "]" for k in range(1, levels + 1)]
    return "\n".join(lines) + f"\nrecompute: *l{levels}\n"


def cli(*argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    if code != 2:
        return f"exit {code}"
    raise SystemExit(err.getvalue())


class Long(nn.Cell):
    def __init__(self):
        super().__init__()
        for k in range(8):
            setattr(self, "a" * 40 + f"x{k}", nn.Cell())


class Model(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([Long() for _ in range(4)])


ok = write("ok.yaml", "recompute: {mode: full, full_recompute_layer: [0-1]}\n")
bomb = write("bomb.yaml", laughs(9))
big = write("big.yaml", "x: " + "a" * 50_000_000 + "\n")
model = Model()
select = lambda p: {"recompute": {"mode": "select", "select_module": {p: ["0-3"]}}}
CASES = {
    "huge layer_swap range": lambda: mac.AcConfig.from_dict(
        {"swap": {"enable": True, "layer_swap": [{"layers": ["0-999999999999"]}]}}),
    "parse_layer_specs without a bound": lambda: mac.parse_layer_specs(["0-99999999999"], None),
    "validate --num-layers 1e20": lambda: cli("validate", ok, "--num-layers", "99999999999999999999"),
    "validate --num-layers 2e9": lambda: cli("validate", ok, "--num-layers", "2000000000"),
    "regex bomb {200}": lambda: mac.AcConfig.from_dict(select("(?:(?:a{200}){200}){200}")),
    "regex bomb {1000}": lambda: mac.AcConfig.from_dict(select("(?:(?:a{1000}){1000}){1000}")),
    "catastrophic match": lambda: mac.plan_ac(model, config=select("(a|aa)+b")),
    "billion laughs": lambda: mac.AcConfig.from_yaml(bomb),
    "billion laughs, validate": lambda: cli("validate", bomb),
    "50 MB file": lambda: mac.AcConfig.from_yaml(big),
    "50 MB file, validate": lambda: cli("validate", big, "--num-layers", "8"),
}
status = open("/proc/self/status").read()
size = int(status.split("VmSize:")[1].split()[0]) * 1024   # mindspore loaded, the 50 MB text built
resource.setrlimit(resource.RLIMIT_AS, (size + int(sys.argv[2]), resource.RLIM_INFINITY))
for name, case in CASES.items():
    wall, cpu = time.monotonic(), time.process_time()
    try:
        outcome, message = f"accepted: {case()!r:.100}", ""
    except mac.ConfigError as exc:
        outcome, message = "ConfigError", str(exc)
    except SystemExit as exc:
        outcome, message = "exit 2", str(exc.code)
    except BaseException as exc:
        outcome, message = type(exc).__name__, str(exc)[:300]
    print(json.dumps({"case": name, "outcome": outcome, "chars": len(message), "message": message[:300],
                      "wall": time.monotonic() - wall, "cpu": time.process_time() - cpu}), flush=True)
'''


@pytest.mark.slow
def test_nastiest_inputs_in_a_subprocess_under_rlimit_as(tmp_path):
    """Each case once ate gigabytes or minutes; here the process may grow by 1 GiB over its set-up size."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _NASTY, str(tmp_path), str(1 << 30)], capture_output=True,
                          text=True, timeout=120, env=env,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CPU, (100, 100)))
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 11, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in results:
        assert r["outcome"] in ("ConfigError", "exit 2"), r
        assert r["chars"] <= MESSAGE_BOUND, r
        # the budgeted match is the slowest case; CPU time, not wall time: the machine is shared
        assert r["cpu"] < MATCH_BUDGET_S + 3, r


@pytest.mark.slow
def test_console_script_on_an_alias_bomb_exits_2_with_one_screen_and_no_traceback(tmp_path):
    bomb = write(tmp_path, _laughs(9))
    proc = subprocess.run([sys.executable, "-m", "mindformers_ac.harness.cli", "validate", str(bomb)], capture_output=True,
                          text=True, timeout=120, cwd=REPO,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: l3[7]: ")
    assert len(proc.stderr) < MESSAGE_BOUND and "alias bomb" in proc.stderr
