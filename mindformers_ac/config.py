"""The ``recompute``, ``recompute_comm`` and ``swap`` sections of a trainer YAML.

Each section is a dataclass whose fields and defaults are MindFormers'. The
structure of every value is checked when the dataclass is built, so a bad
value fails before any model is looked at; checks that need the model (layer
counts, pattern matches, overlaps between sections) are done by ``plan_ac``.

Every rejection is a ``ConfigError`` whose message starts with the field path,
e.g. ``swap.op_swap[1].layers[0]: ...``. Fields changed after a section was
built are checked again by ``validate()``, which ``plan_ac`` / ``apply_ac`` call
on whatever they are given. Input is untrusted: see ``limits`` for the bounds.
"""
import collections.abc
import dataclasses
import enum
import logging
import os
from dataclasses import dataclass, field
from typing import Optional, Union

import yaml

from .budget.sizes import parse_budget
from .errors import ConfigError, child_field, item_field, quote, type_name
from .layer_specs import RangeSet, format_layer_specs, spec_ranges
from .limits import MAX_CONFIG_BYTE_COUNT, MAX_LAYERS
from .matching import check_pattern
from .yaml_loading import config_path, load_yaml_file

logger = logging.getLogger("mindformers_ac")

SECTIONS = ("recompute", "recompute_comm", "swap")
BUDGET_SECTION = "memory_budget"   # written only when set: a config without it reads as MindFormers' three
# memory_budget.profile_steps: a warm-up and a baseline step, then at least one option; at most as many
# steps as anyone profiles for (each is one of the user's training steps under a candidate plan)
PROFILE_STEPS = (3, 32)
MAX_BUDGET_TEXT = 40       # characters: "1.5GiB", "0.25x"; a longer one is not a size
MAX_BUDGET_FRACTION = 64   # memory_budget.activations: "64x" of the kept bytes without AC already asks for nothing

# The smallest saved tensor swap moves to host by default: smaller ones cost more in copy calls than
# they free.
DEFAULT_MIN_BYTES = 1024
SWAP_BACKENDS = ("auto", "host", "device")
DEVICE_BACKEND_TARGETS = ("Ascend", "GPU")   # device targets with copy streams and pinned memory


class RecomputeMode(str, enum.Enum):
    """``recompute.mode``; a ``str``, so ``mode == "full"`` and YAML's spelling keep working."""

    NONE = "None"
    FULL = "full"
    SELECT = "select"

    def __str__(self):
        return self.value

    __format__ = str.__format__


def check_bool(value, field_path):
    if not isinstance(value, bool):
        raise ConfigError(field_path, f"expected true or false, got {type_name(value)} {quote(value)}")
    return value


def is_int_in(value, low, high=None):
    """``value`` is an int (not a bool) in ``[low, high]`` (no upper bound when ``high`` is None)."""
    return not isinstance(value, bool) and isinstance(value, int) and low <= value and (high is None or value <= high)


def check_int(value, field_path, low, high=None, meaning=""):
    """An int in ``[low, high]``; ``meaning`` says what it counts, in the message (``(layers per group)``)."""
    if not is_int_in(value, low, high):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ConfigError(field_path, f"expected an integer {bound}{meaning}, got {type_name(value)} {quote(value)}")
    return value


def check_byte_count(value, field_path, allow_none=False):
    """A number of bytes: an int in ``[0, MAX_CONFIG_BYTE_COUNT]`` (or None when ``allow_none``)."""
    if value is None and allow_none:
        return value
    if not is_int_in(value, 0, MAX_CONFIG_BYTE_COUNT):
        what = " or null (no bound)" if allow_none else ""
        raise ConfigError(field_path, f"expected a number of bytes (an integer from 0 to "
                                      f"{MAX_CONFIG_BYTE_COUNT}){what}, got {type_name(value)} {quote(value)}")
    return value


def check_choice(value, choices, field_path):
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(field_path, f"expected one of {', '.join(choices)}, got {type_name(value)} {quote(value)}")
    return value


def check_pattern_map(value, field_path):
    """``{regex: layer specs}`` as used by select_module and the dict form of exclude_op."""
    if not isinstance(value, dict):
        raise ConfigError(field_path, f"expected a mapping of path regex to layer specs such as "
                                      f"{{'.*mlp': [0-3]}}, got {type_name(value)} {quote(value)}")
    if not value:
        raise ConfigError(field_path, "expected at least one 'regex: layers' entry, got an empty mapping")
    for pattern, specs in value.items():
        check_pattern(pattern, item_field(field_path, pattern))
        spec_ranges(specs, item_field(field_path, pattern))
    return value


def check_keys(section, allowed, field_path):
    if not isinstance(section, dict):
        raise ConfigError(field_path, f"expected a mapping with keys {', '.join(allowed)}, got "
                                      f"{type_name(section)} {quote(section)}")
    unknown = [k for k in section if k not in allowed]
    if unknown:
        raise ConfigError(child_field(field_path, unknown[0]), f"unknown key; allowed keys are: "
                                                               f"{', '.join(allowed)}")


def _field_names(cls):
    return tuple(f.name for f in dataclasses.fields(cls))


def _plain(value):
    """A field value as YAML writes it: entries as mappings, modes as their spelling, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Section:
    """What every section and swap entry shares: one ``to_dict`` that every writer uses, and its inverse."""

    def to_dict(self):
        """The mapping a trainer YAML would hold; ``type(self).from_dict(self.to_dict()) == self``.

        Optional fields left at ``None`` are not written (reading them back gives ``None`` again).
        """
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if not (getattr(self, f.name) is None and f.default is None)}

    @classmethod
    def from_dict(cls, data, field_path=None):
        """Built from a mapping with this section's keys (missing keys take their defaults)."""
        check_keys(data, _field_names(cls), field_path or cls.FIELD)
        return cls(**data)


class _Entry(_Section, collections.abc.Mapping):
    """A typed swap entry that still reads as the YAML mapping it came from (``entry["layers"]``,
    equal to ``{"layers": [...]}``), so code written against the mapping form keeps working."""

    def __getitem__(self, key):
        if key not in _field_names(type(self)):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(_field_names(type(self)))

    def __len__(self):
        return len(_field_names(type(self)))


# eq=False: Mapping's equality (by items) also holds against plain dicts
@dataclass(frozen=True, eq=False)
class LayerSwapEntry(_Entry):
    """One ``swap.layer_swap`` entry: whole layers whose activations go to host memory."""

    FIELD = "swap.layer_swap[]"
    layers: Union[list, tuple]


@dataclass(frozen=True, eq=False)
class OpSwapEntry(_Entry):
    """One ``swap.op_swap`` entry: the modules/ops matching ``op_name`` inside ``layers``."""

    FIELD = "swap.op_swap[]"
    op_name: str
    layers: Union[list, tuple]


def swap_entry(cls, entry, field_path):
    """``entry`` (a mapping or a ``cls``) checked and built into a ``cls``; errors name ``field_path``."""
    if isinstance(entry, cls):
        entry = entry.to_dict()
    keys = _field_names(cls)
    check_keys(entry, keys, field_path)
    for key in keys:
        if key not in entry:
            raise ConfigError(f"{field_path}.{key}", "required key is missing")
    if "op_name" in keys:
        check_pattern(entry["op_name"], f"{field_path}.op_name")
    spec_ranges(entry["layers"], f"{field_path}.layers")
    return cls(**entry)


@dataclass
class RecomputeConfig(_Section):
    """``recompute`` section: drop activations in forward, rebuild them in backward.

    mode: ``"None"`` (or ``None``) off, ``"full"`` whole layers, ``"select"``
        modules/ops matched by ``select_module`` (plus whole layers in
        ``full_recompute_layer`` if given).
    full_recompute_layer: layer specs, required for ``full``.
    select_module: ``{path regex: layer specs}``, required for ``select``.
    exclude_op: ops whose outputs are kept inside recomputed regions: a list of
        names (case-insensitive substrings of the op name) or ``{path regex:
        layer specs}``.
    group_layers: N >= 1 (MindSpeed's ``--recompute-method uniform
        --recompute-num-layers N``): the fully recomputed layers, in order, in
        runs of N consecutive ids, each run one region that keeps only its
        first layer's inputs. 1: every layer its own region.
    early_stop: True (PyTorch's default): a region's re-run on the intercepting
        path stops after the last op that left a dropped tensor; False: it always
        runs the whole layer (``checkpoint_wrapper(early_stop=...)``).
    """

    FIELD = "recompute"
    mode: Optional[Union[str, RecomputeMode]] = RecomputeMode.NONE
    full_recompute_layer: Optional[Union[list, tuple]] = None
    select_module: Optional[dict] = None
    exclude_op: Optional[Union[list, tuple, dict]] = None
    group_layers: int = 1
    early_stop: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Check every field (again, after changes); ``mode`` becomes a ``RecomputeMode`` (``None``: NONE)."""
        if self.mode is None:
            self.mode = RecomputeMode.NONE
        if not isinstance(self.mode, str) or self.mode not in {m.value for m in RecomputeMode}:
            raise ConfigError("recompute.mode", f"expected one of None, full, select, got "
                                                f"{type_name(self.mode)} {quote(self.mode)}")
        self.mode = RecomputeMode(self.mode)
        if self.full_recompute_layer is not None:
            spec_ranges(self.full_recompute_layer, "recompute.full_recompute_layer")
        if self.select_module is not None:
            check_pattern_map(self.select_module, "recompute.select_module")
        if self.exclude_op is not None:
            self._check_exclude_op()
        check_int(self.group_layers, "recompute.group_layers", 1, MAX_LAYERS, " (layers per recompute group)")
        check_bool(self.early_stop, "recompute.early_stop")
        if self.mode == RecomputeMode.FULL and self.full_recompute_layer is None:
            raise ConfigError("recompute.full_recompute_layer",
                              "required when mode is full: list the layers to recompute, e.g. [0-3]")
        if self.mode == RecomputeMode.SELECT and self.select_module is None:
            raise ConfigError("recompute.select_module",
                              "required when mode is select: map module path regexes to layers, "
                              "e.g. {'.*mlp': [0-3]}")

    def _check_exclude_op(self):
        path = "recompute.exclude_op"
        if isinstance(self.exclude_op, dict):
            check_pattern_map(self.exclude_op, path)
            return
        if not isinstance(self.exclude_op, (list, tuple)):
            raise ConfigError(path, f"expected a list of op names such as ['AllGather'] or a mapping "
                                    f"of op path regex to layer specs, got "
                                    f"{type_name(self.exclude_op)} {quote(self.exclude_op)}")
        for i, name in enumerate(self.exclude_op):
            if not isinstance(name, str) or not name.strip():
                raise ConfigError(f"{path}[{i}]", f"expected a non-empty op name string, got "
                                                  f"{type_name(name)} {quote(name)}")

    @property
    def enabled(self):
        return self.mode != RecomputeMode.NONE


@dataclass
class RecomputeCommConfig(_Section):
    """``recompute_comm`` section: re-run matched communication ops in backward.

    Independent of ``recompute.mode``. ``select_module`` (``{op path regex:
    layer specs}``) is required when ``enable`` is true; its matches must be ops.
    """

    FIELD = "recompute_comm"
    enable: bool = False
    select_module: Optional[dict] = None

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Check every field (again, after changes)."""
        check_bool(self.enable, "recompute_comm.enable")
        if self.select_module is not None:
            check_pattern_map(self.select_module, "recompute_comm.select_module")
        if self.enable and self.select_module is None:
            raise ConfigError("recompute_comm.select_module",
                              "required when enable is true: map comm op path regexes to layers, "
                              "e.g. {'.*\\.all_gather': [0-3]}")

    @property
    def enabled(self):
        return self.enable


@dataclass
class SwapConfig(_Section):
    """``swap`` section: keep activations in host memory, prefetch them before backward.

    default_prefetch: p >= 1; layer i is fetched back when layer i+p starts its backward.
    layer_swap: ``[{layers: specs}, ...]`` whole layers (every entry is applied;
        entries must not overlap); mappings become ``LayerSwapEntry``.
    op_swap: ``[{op_name: path regex, layers: specs}, ...]`` modules/ops inside
        layers; mappings become ``OpSwapEntry``.
    min_bytes: saved tensors smaller than this stay on the device.
    max_host_bytes: bound of the host buffer pool in bytes; a tensor that would
        exceed it stays on the device (counted as over budget). None: no bound on
        bytes in use (idle buffers are always bounded by the peak in use).
    backend: ``auto`` (host copies on CPU, copy streams on Ascend/GPU),
        ``host``, or ``device`` (Ascend/GPU only).
    """

    FIELD = "swap"
    enable: bool = False
    default_prefetch: int = 1
    layer_swap: Optional[Union[list, tuple]] = None
    op_swap: Optional[Union[list, tuple]] = None
    min_bytes: int = DEFAULT_MIN_BYTES
    max_host_bytes: Optional[int] = None
    backend: str = field(default="auto", metadata={"choices": SWAP_BACKENDS})

    def __post_init__(self):
        self.validate()
        # warned once, when built: validate() runs again in plan_ac and stays quiet
        if not self.enable and (self.layer_swap or self.op_swap):
            logger.warning("swap.enable is false: layer_swap and op_swap are ignored")
        if self.enable and not (self.layer_swap or self.op_swap):
            logger.warning("swap.enable is true but neither layer_swap nor op_swap is set: "
                           "nothing will be swapped")

    def validate(self):
        """Check every field (again, after changes)."""
        check_bool(self.enable, "swap.enable")
        check_int(self.default_prefetch, "swap.default_prefetch", 1)
        self.layer_swap = self._entries("layer_swap", LayerSwapEntry)
        self.op_swap = self._entries("op_swap", OpSwapEntry)
        self._check_layer_swap_disjoint()
        check_byte_count(self.min_bytes, "swap.min_bytes")
        check_byte_count(self.max_host_bytes, "swap.max_host_bytes", allow_none=True)
        check_choice(self.backend, SWAP_BACKENDS, "swap.backend")

    def _entries(self, name, cls):
        entries, path = getattr(self, name), f"swap.{name}"
        if entries is None:
            return None
        if not isinstance(entries, (list, tuple)):
            example = "{" + ", ".join(f"{k}: ..." for k in _field_names(cls)) + "}"
            raise ConfigError(path, f"expected a list of {example} entries, got "
                                    f"{type_name(entries)} {quote(entries)}")
        return [swap_entry(cls, entry, f"{path}[{i}]") for i, entry in enumerate(entries)]

    def _check_layer_swap_disjoint(self):
        taken = RangeSet()
        for i, entry in enumerate(self.layer_swap or ()):
            ranges = spec_ranges(entry.layers, f"swap.layer_swap[{i}].layers")
            overlap = taken.first_overlap(ranges)
            if overlap is not None:
                raise ConfigError(f"swap.layer_swap[{i}].layers",
                                  f"layer {overlap[0]} is already listed in "
                                  f"swap.layer_swap[{overlap[1]}]; entries must not overlap")
            taken.add(ranges, i)

    @property
    def enabled(self):
        return self.enable


@dataclass
class MemoryBudgetConfig(_Section):
    """``memory_budget`` section: a budget instead of per-layer lists (``budget.controller``).

    activations: the budget for activation memory: a fraction of the same
        model's kept bytes without AC (``0.5x``) or a size (``96MiB``, ``2GiB``,
        a byte count); None (the default): no budget, the layer lists apply.
    profile_steps: the user's own training steps used to measure the options:
        a warm-up and a baseline step without AC, then one step per option
        (the most useful first), after which the chosen plan is installed.
        Steps beyond those time the baseline and the options again (each
        costs the median of its steps; their spread widens the timing noise).
    include_swap: whether the plan may swap layers.
    """

    FIELD = BUDGET_SECTION
    activations: Optional[Union[str, int]] = None
    profile_steps: int = 8
    include_swap: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Check every field (again, after changes); the budget's text needs no model."""
        if self.activations is not None:
            if isinstance(self.activations, bool) or not isinstance(self.activations, (str, int)):
                raise ConfigError("memory_budget.activations", f"expected a size (96MiB, 2GiB, a byte count) or a "
                                                               f"fraction of the kept bytes without AC (0.5x), got "
                                                               f"{type_name(self.activations)} "
                                                               f"{quote(self.activations)}")
            if isinstance(self.activations, str) and len(self.activations) > MAX_BUDGET_TEXT:
                raise ConfigError("memory_budget.activations", f"expected a size such as 96MiB or 0.5x, got a "
                                                               f"string of {len(self.activations)} characters")
            size = self.budget_bytes(2 ** 20)   # a fraction of 1 MiB: its bound below is in the same unit
            if size > (MAX_BUDGET_FRACTION * 2 ** 20 if self.is_fraction else MAX_CONFIG_BYTE_COUNT):
                bound = f"{MAX_BUDGET_FRACTION}x" if self.is_fraction else f"{MAX_CONFIG_BYTE_COUNT} bytes"
                raise ConfigError("memory_budget.activations", f"at most {bound}, got {quote(self.activations)}")
        check_int(self.profile_steps, "memory_budget.profile_steps", *PROFILE_STEPS)
        check_bool(self.include_swap, "memory_budget.include_swap")

    @property
    def is_fraction(self):
        return isinstance(self.activations, str) and self.activations.strip().lower().endswith("x")

    def budget_bytes(self, baseline_bytes):
        """The budget in bytes, given the kept bytes of the model without AC."""
        return parse_budget(str(self.activations), baseline_bytes, "memory_budget.activations")

    @property
    def enabled(self):
        return self.activations is not None


_SECTION_TYPES = {"recompute": RecomputeConfig, "recompute_comm": RecomputeCommConfig,
                  "swap": SwapConfig, BUDGET_SECTION: MemoryBudgetConfig}


def section_from_value(name, value):
    """Section ``name`` from a dataclass instance (checked again), a mapping or ``None`` (defaults)."""
    cls = _SECTION_TYPES[name]
    if value is None:
        return cls()
    if isinstance(value, cls):
        value.validate()
        return value
    return cls.from_dict(value, name)


@dataclass
class AcConfig:
    """The three sections together, and the optional ``memory_budget``; ``from_yaml`` reads them out of a
    whole trainer YAML."""

    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    recompute_comm: RecomputeCommConfig = field(default_factory=RecomputeCommConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)
    memory_budget: MemoryBudgetConfig = field(default_factory=MemoryBudgetConfig)

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Check every section (again, after changes): a section may have been replaced by a
        mapping (built into its dataclass here) or by anything else (a ``ConfigError``)."""
        for name in SECTIONS + (BUDGET_SECTION,):
            setattr(self, name, section_from_value(name, getattr(self, name)))
        return self

    @classmethod
    def from_dict(cls, data):
        """Read the three sections of ``data``; other top-level keys are ignored."""
        if not isinstance(data, dict):
            raise ConfigError(None, f"expected a mapping with recompute / recompute_comm / swap "
                                    f"sections at the top level, got {type_name(data)}")
        return cls(**{name: data.get(name) for name in SECTIONS + (BUDGET_SECTION,)})

    @classmethod
    def from_yaml(cls, path):
        """Load a trainer YAML safely and read its sections.

        Only plain data is constructed, and the file is read within the bounds
        of ``yaml_loading`` (size, UTF-8, alias expansion, depth, duplicate
        keys). Every failure, including a ``path`` that is not a path, is a
        ``ConfigError``; errors about a value name the file too.
        """
        data = load_yaml_file(path)
        if data is None:
            data = {}
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(exc.field, f"{exc.reason} (in {config_path(path)[1]})") from None

    def to_dict(self):
        """Plain sections, as they would be written in a trainer YAML (each section's own ``to_dict``);
        ``memory_budget`` only when it is set."""
        names = SECTIONS + ((BUDGET_SECTION,) if self.memory_budget.enabled else ())
        return {name: getattr(self, name).to_dict() for name in names}

    def to_yaml(self):
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


# The fields ``with_layer_lists`` rewrites: which layers and paths get which action. Every other field
# of a section is a setting, written back as the user gave it.
LAYER_LIST_FIELDS = {
    "recompute": ("mode", "full_recompute_layer", "select_module", "exclude_op"),
    "recompute_comm": ("enable", "select_module"),
    "swap": ("enable", "layer_swap", "op_swap"),
}


def with_layer_lists(config, full=(), select_module=None, exclude_op=None, comm_select=None, layer_swap=(),
                     op_swap=None):
    """``config`` with its per-layer lists replaced: what ``plan --out`` and ``AcPlan.to_dict`` write.

    Only the lists that say which layers and paths get which action are
    replaced (and the switches that follow from them); every other field of
    every section (``swap.default_prefetch``, ``swap.min_bytes`` ...) is
    ``config``'s own, by construction (``dataclasses.replace``), so a field
    added later is written back without a change here. ``full`` and
    ``layer_swap`` are layer ids; ``select_module``, ``comm_select`` and
    ``op_swap`` map a path regex to layer specs. The recompute mode follows
    from what is there (select if any module is selected, else full if any
    layer is, else None); ``exclude_op`` is dropped when nothing is recomputed,
    where it would have no effect; each section is enabled when it has work.
    """
    recomputed = bool(select_module or full)
    mode = RecomputeMode.SELECT if select_module else RecomputeMode.FULL if full else RecomputeMode.NONE
    recompute = dataclasses.replace(
        config.recompute, mode=mode, full_recompute_layer=format_layer_specs(full) if full else None,
        select_module=select_module or None, exclude_op=(exclude_op or None) if recomputed else None)
    comm = dataclasses.replace(config.recompute_comm, enable=bool(comm_select), select_module=comm_select or None)
    swap = dataclasses.replace(
        config.swap, enable=bool(layer_swap or op_swap),
        layer_swap=[LayerSwapEntry(format_layer_specs(layer_swap))] if layer_swap else None,
        op_swap=[OpSwapEntry(name, specs) for name, specs in op_swap.items()] if op_swap else None)
    return AcConfig(recompute=recompute, recompute_comm=comm, swap=swap, memory_budget=config.memory_budget)


def resolve_config(config=None, recompute=None, recompute_comm=None, swap=None):
    """One ``AcConfig`` from either ``config=`` or the three MindFormers-style arguments."""
    if config is not None:
        if any(v is not None for v in (recompute, recompute_comm, swap)):
            raise ConfigError("config", "pass either config=AcConfig(...) or the recompute / "
                                    "recompute_comm / swap sections, not both")
        if isinstance(config, AcConfig):
            return config.validate()
        if isinstance(config, dict):
            return AcConfig.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            return AcConfig.from_yaml(config)
        raise ConfigError("config", f"expected an AcConfig, a mapping or a YAML path, got "
                                f"{type_name(config)}")
    return AcConfig(recompute=recompute, recompute_comm=recompute_comm, swap=swap)
