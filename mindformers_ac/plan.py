"""Dry run: resolve a config against a model into an ``AcPlan``, checking every rule.

``plan_ac`` reads the model (layer list, whitelists) and never changes it.
``apply_ac`` executes exactly the plan this returns, so what ``explain``
prints is what training gets. One pass plans every action in turn (``actions``:
one class per action, each with its section's rules and those against the
actions planned before it), so a rejected config fails before anything is
installed:

* layer specs within ``[0, total - 1]`` (global ids; ``total`` is ``num_layers``
  plus the MTP layers, which come after the decoder's: MTP layer ``i`` is
  ``num_layers + i``);
* ``swap.default_prefetch`` in ``[1, total - 1]`` and, on a model holding every
  layer, ``layer + p < total`` for every swapped layer (the last decoder layer
  is prefetched by an MTP layer's backward; the last MTP layer can't be swapped);
* no layer both recomputed (full, or select / comm targets in it) and layer-swapped;
* no op swap on a recomputed module or on its parent or child;
* on a pipeline stage (``pp > 1``): the stage's first global id is known
  (``layer_start``, or ``layer_offset=``), ids of other stages are ignored with
  one warning naming them, and a swapped layer is fetched back by a layer of
  its stage (``i + p``; for the stage's last ``p`` layers, an earlier layer's
  backward of the next microbatch);
* what the model must allow for the installers to act on it (shared cells,
  ``ms.jit`` cells, MindSpore's own ``Cell.recompute()``, the user's own
  wrappers, copied patches): ``model_checks``, which every action's targets
  pass through.

Patterns may name methods (``self_attention.get_query_key_value_tensors``):
``select_module`` recomputes the method's work as a region; ``exclude_op``,
``recompute_comm`` and ``op_swap`` can't act on one (a warning says so).

The config is checked again first (fields may have changed since it was
built), and all pattern matching of one call shares one time budget
(``matching.MatchBudget``).
"""
import logging
from dataclasses import dataclass, field
from typing import Optional

import mindspore as ms
import yaml

from .actions import ACTIONS, TABLE_COLUMNS, check_overlaps, layer_lists
from .config import LAYER_LIST_FIELDS, AcConfig, check_int, resolve_config, with_layer_lists
from .errors import ConfigError, clip
from .layer_specs import format_layer_specs, parse_layer_specs, spec_ranges
from .layers import find_layer_stack
from .limits import MAX_LAYERS
from .matching import MatchBudget, match_entries
from .model_checks import check_engine_reach, check_shared_layers, check_shared_targets, refuse_copied_patches
from .whitelist import layer_inventory, sub_cell, unusable_registry_op

logger = logging.getLogger("mindformers_ac")


# The attributes a layer plan answers (``lp.full_recompute`` ...: the public reading of a plan, which
# tests/test_actions.py reads back from a plan with every action), each with its value when no action of
# the layer gives one; the actions give them (``Action.facts``), and ``LayerPlan.fact`` is the one query
# that reads them.
LAYER_FACTS = {
    "full_recompute": False,   # the whole layer is recomputed
    "recompute": (),           # select-recompute target paths (cells, methods or ops)
    "recompute_comm": (),      # op paths whose outputs are re-run in backward
    "exclude": (),             # op names (exclude_op's list form) or paths (its dict form) the regions keep
    "exclude_by_path": False,
    "group": (),               # the layer ids of this layer's recompute group (recompute.group_layers)
    "layer_swap": False,
    "op_swap": (),             # module paths whose saved tensors are swapped
    "prefetch_layer": None,    # the layer whose backward start brings the swapped tensors back
}


def _with_facts(cls):
    """Each key of ``LAYER_FACTS`` becomes a read-only attribute of ``cls``: ``cls.fact(key)``."""
    for name in LAYER_FACTS:
        setattr(cls, name, property(lambda lp, name=name: lp.fact(name), doc=f"``fact('{name}')``"))
    return cls


@_with_facts
@dataclass
class LayerPlan:
    """What happens to one layer (global id ``layer_id``): its ``actions`` (``actions.Action``), in plan order.

    The other fields are what every action reads: ``targets`` (path -> ``WhitelistEntry`` of each module,
    op or method an action names) and ``notes`` (what the engine runs around but can't act on, e.g. jit
    cells). The attributes of ``LAYER_FACTS`` (``full_recompute``, ``recompute``, ``op_swap`` ...) are
    ``fact(name)``: what the actions say.
    """

    layer_id: int
    actions: list = field(default_factory=list)
    targets: dict = field(default_factory=dict, repr=False)   # target path -> its WhitelistEntry
    notes: tuple = ()
    mtp_index: Optional[int] = None   # i for MTP layer i (global id num_layers + i), None for a decoder layer

    @property
    def label(self):
        """``'3'``, or ``'9 (MTP 1)'`` for an MTP layer."""
        return str(self.layer_id) if self.mtp_index is None else f"{self.layer_id} (MTP {self.mtp_index})"

    def fact(self, name):
        """What the layer's actions say about ``name`` (a key of ``LAYER_FACTS``): paths are joined in plan
        order, flags are true when one action's is, a value is the first action's that gives one."""
        default = LAYER_FACTS[name]
        given = [facts[name] for facts in (a.facts() for a in self.actions) if name in facts]
        if isinstance(default, tuple):
            return tuple(dict.fromkeys(p for value in given for p in value))
        if isinstance(default, bool):
            return any(given)
        return next((value for value in given if value is not None), default)

    @property
    def op_paths(self):
        """The target paths that are ops (attributes or ``_comm_ops`` slots), not cells."""
        return frozenset(path for path, entry in self.targets.items() if entry.is_op)

    @property
    def method_paths(self):
        """The target paths that are methods of a cell (``self_attention.get_query_key_value_tensors``)."""
        return frozenset(path for path, entry in self.targets.items() if entry.is_method)

    @property
    def recomputed(self):
        return any(a.recomputes for a in self.actions)

    @property
    def swapped(self):
        return any(a.swaps for a in self.actions)

    @property
    def is_empty(self):
        return not self.actions

    def describe(self):
        """Short human-readable actions, e.g. ``['full recompute', 'keep AllGather']``."""
        return [part for action in self.actions for part in action.describe()]


@dataclass
class PatternMatch:
    """Where one config pattern landed: ``paths[layer_id]`` lists the matched paths."""

    field: str
    pattern: str
    layer_ids: tuple
    paths: dict

    @property
    def matched(self):
        return any(self.paths.values())


@dataclass
class AcPlan:
    """The resolved, validated plan: pure data, printable, writable back as YAML."""

    config: AcConfig
    layers: dict
    num_layers: int              # decoder layers of the whole model (every pipeline stage)
    layer_path: str
    pp: int = 1
    matches: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    num_mtp_layers: int = 0      # MTP layers, global ids num_layers .. num_layers + num_mtp_layers - 1
    mtp_path: str = ""           # where the MTP layers are ('' when this plan holds none)

    @property
    def total_layers(self):
        """Every global layer id is below this: the decoder's layers, then the MTP layers."""
        return self.num_layers + self.num_mtp_layers

    def active_layers(self):
        return [lp for lp in self.layers.values() if not lp.is_empty]

    def layer_label(self, layer_id):
        """``'3'``, or ``'9 (MTP 1)'`` for an MTP layer."""
        if layer_id < self.num_layers:
            return str(layer_id)
        return f"{layer_id} (MTP {layer_id - self.num_layers})"

    def format_layers(self, layer_ids):
        """``'0-3, 8-9 (MTP 0-1)'``: decoder ids as layer specs, then the MTP ids with their MTP index."""
        ids = sorted(set(layer_ids))
        decoder = [i for i in ids if i < self.num_layers]
        mtp = [i for i in ids if i >= self.num_layers]
        parts = [str(spec) for spec in format_layer_specs(decoder)]
        if mtp:
            mtp_specs = ", ".join(str(spec) for spec in format_layer_specs([i - self.num_layers for i in mtp]))
            parts.append(f"{', '.join(str(spec) for spec in format_layer_specs(mtp))} (MTP {mtp_specs})")
        return ", ".join(parts)

    def __str__(self):
        decoder = [i for i in self.layers if i < self.num_layers]
        mtp = [i for i in self.layers if i >= self.num_layers]
        where = f"{len(decoder)} layers at '{self.layer_path}'"
        if mtp:
            where += f" + {len(mtp)} MTP layers at '{self.mtp_path}'"
        total = f"{self.total_layers}" if not self.num_mtp_layers else \
            f"{self.total_layers}: {self.num_layers} decoder + {self.num_mtp_layers} MTP"
        header = f"AcPlan: {where} (global ids {self.format_layers(self.layers)} of {total}), pp={self.pp}"
        rows = [("layer",) + TABLE_COLUMNS]
        for lp in self.layers.values():
            cells = {}
            for action in lp.actions:
                for column, text in action.table_cells(self).items():
                    cells.setdefault(column, {})[text] = None   # two actions in one cell: both, once each
            rows.append((lp.label,) + tuple(", ".join(cells.get(c, ())) or "-" for c in TABLE_COLUMNS))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = [header] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                            for row in rows]
        kinds = dict.fromkeys(type(a) for lp in self.layers.values() for a in lp.actions)
        lines += list(dict.fromkeys(line for kind in kinds for line in kind.table_notes(self)))
        notes = [f"  layer {lp.label}: {note}" for lp in self.layers.values() for note in lp.notes]
        if notes:
            lines += ["Notes:"] + notes
        return "\n".join(lines)

    def explain(self):
        """The table plus, for every pattern, the paths it matched per layer."""
        lines = [str(self), "", "Pattern matches:"]
        if not self.matches:
            lines.append("  (no patterns in this config)")
        for m in self.matches:
            decoder = [i for i in m.layer_ids if i < self.num_layers]
            mtp = [i for i in m.layer_ids if i >= self.num_layers]
            ids = " + ".join(([str(format_layer_specs(decoder))] if decoder else [])
                             + ([self.format_layers(mtp)] if mtp else []))
            lines.append(f"  {m.field} -> layers {ids}")
            if not m.matched:
                lines.append("      matched nothing")
            for layer_id, paths in m.paths.items():
                if paths:
                    lines.append(f"      layer {self.layer_label(layer_id)}: {', '.join(paths)}")
        if self.warnings:
            lines += ["", "Warnings:"] + [f"  {w}" for w in self.warnings]
        return "\n".join(lines)

    def summary(self):
        """What the plan does, in one line: each action with its layers, MTP layers marked, e.g.
        ``full recompute on layers 0-1; select recompute on layers 2-3 (mlp); layer swap on layers
        4-6 (prefetch 1)`` (what ``apply_ac`` logs once)."""
        groups = {}   # (action, detail) -> layer ids, in the order the actions are first seen
        for lp in self.layers.values():
            for action in lp.actions:
                groups.setdefault(action.summary(self), []).append(lp.layer_id)
        budget = self.config.memory_budget
        text = "; ".join(f"{action} on layer{'s' if len(ids) > 1 else ''} {self.format_layers(ids)}"
                         + (f" ({detail})" if detail else "") for (action, detail), ids in groups.items()) \
            or (f"memory budget {budget.activations}: the first {budget.profile_steps} training steps measure the "
                f"options on {self.format_layers(self.layers)}, then the cheapest plan that fits is installed"
                if budget.enabled else "nothing to install (no layer is recomputed or swapped)")
        notes = sum(len(lp.notes) for lp in self.layers.values())
        extra = [f"{n} {what}{'s' if n > 1 else ''}" for n, what in ((len(self.warnings), "warning"),
                                                                      (notes, "note")) if n]
        return text + (f" ({', '.join(extra)}: see plan.explain())" if extra else "")

    def groups(self):
        """The recompute groups (``recompute.group_layers``): a tuple of layer ids per group, in order."""
        return list(dict.fromkeys(lp.group for lp in self.layers.values() if lp.group))

    def to_config(self):
        """The ``AcConfig`` that reproduces this plan with exact paths: the plan's config with its per-layer
        lists rewritten from the actions (``actions.layer_lists``)."""
        return with_layer_lists(self.config, **layer_lists(self.layers.values()))

    def to_dict(self):
        """The three YAML sections that reproduce this plan with exact paths."""
        return self.to_config().to_dict()

    def to_yaml(self):
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


class _PlanPass:
    """One pass of ``plan_ac`` over a config; holds per-call state only (nothing survives the call).

    It is what each action's ``plan`` is given: the config, the ``LayerPlan`` per local layer
    (``plans``), and the helpers every section shares: layer ids from specs (``layer_ids``), pattern
    matches recorded for ``explain`` (``match``), the layer's inventory, and warnings (``warn``).

    ``model`` and its ``stack`` (``LayerStack``) are what the config is
    planned on; without them (``validate`` with a layer count) only the rules
    that need no cell are checked: layer-spec and prefetch bounds, full
    recompute vs layer swap. ``num_layers`` bounds every layer id: with a
    stack, its ``total_layers`` (decoder and MTP layers).
    """

    def __init__(self, config, pp, num_layers, stack=None, model=None):
        self.config, self.stack, self.pp, self.model = config, stack, pp, model
        self.match_patterns = stack is not None
        self.num_layers = num_layers
        self.num_decoder = stack.num_layers if stack is not None else num_layers
        self.inventories = {}
        self.matches, self.warnings = [], []
        self.requested = set()   # every layer id the config names, to tell about MTP ids with no MTP block here
        self.elsewhere = {}      # field -> the ids it names that this stage does not hold
        self.budget = MatchBudget()
        # a pipeline stage (or a model holding some of its layers): bounds are the stage's own
        self.is_stage = stack is not None and stack.stage_end - stack.offset < stack.total_layers
        self.stage_start = stack.offset if stack is not None else 0
        self.stage_end = stack.stage_end if stack is not None else num_layers
        ids = stack.layer_ids if stack is not None else range(num_layers)
        self.plans = {i: LayerPlan(i, mtp_index=i - self.num_decoder if i >= self.num_decoder else None)
                      for i in ids}

    def warn(self, message):
        self.warnings.append(message)
        logger.warning(message)

    def inventory(self, layer_id):
        if layer_id not in self.inventories:
            self.inventories[layer_id] = layer_inventory(self.stack.cell(layer_id))
        return self.inventories[layer_id]

    def layer_ids(self, specs, field_path):
        if self.num_layers > self.num_decoder:   # say which ids are MTP layers
            for k, (_, end) in enumerate(spec_ranges(specs, field_path)):
                if end >= self.num_layers:
                    raise ConfigError(f"{field_path}[{k}]", f"layer {end} is out of range: the model has "
                                                            f"{self.num_decoder} decoder layers (ids 0-"
                                                            f"{self.num_decoder - 1}) and "
                                                            f"{self.num_layers - self.num_decoder} MTP layers "
                                                            f"(ids {self.num_decoder}-{self.num_layers - 1})")
        ids = parse_layer_specs(specs, self.num_layers, field_path)
        self.requested.update(i for i in ids if i >= self.num_decoder)
        if self.stack is not None:
            elsewhere = [i for i in ids if i not in self.plans]
            if elsewhere:
                self.elsewhere.setdefault(field_path, set()).update(elsewhere)
        return ids

    def match(self, field_path, pattern, specs):
        """Match ``pattern`` in every local layer of ``specs``; record and warn if empty."""
        layer_ids = self.layer_ids(specs, field_path)
        if not self.match_patterns:
            return {}
        local = [i for i in layer_ids if i in self.plans]
        found = {i: match_entries(pattern, self.inventory(i), field_path, self.budget) for i in local}
        for i, entries in found.items():
            self.refuse_unusable_ops(i, entries, field_path)
        self.matches.append(PatternMatch(field_path, pattern, tuple(layer_ids),
                                         {i: [e.path for e in es] for i, es in found.items()}))
        if local and not any(found.values()):
            section = field_path.split("[")[0]
            self.warn(f"{section} pattern '{clip(pattern)}' did not match any module")
        return found

    def refuse_unusable_ops(self, layer_id, entries, field_path):
        """A registry slot matched by ``field_path`` that holds no callable op can't be acted on: refused
        now, before anything is installed."""
        for entry in entries:
            if entry.registry:
                owner = sub_cell(self.stack.cell(layer_id), entry.owner_path)
                why = unusable_registry_op(owner, entry.attr, entry.registry)
                if why is not None:
                    raise ConfigError(field_path, f"{entry.path} in layer {layer_id}: {why}")

    def is_mtp(self, layer_id):
        return layer_id >= self.num_decoder

    def plan(self):
        for action in ACTIONS:
            action.plan(self)
        for lp in self.plans.values():   # the rules between actions, for one that did not place its targets
            check_overlaps(lp)
        if self.match_patterns:   # a real model: its cells can be compared
            check_shared_layers(self.stack, self.plans)
            check_shared_targets(self.stack, self.plans)
            check_engine_reach(self.stack, self.plans, self.model)
            self.note_absent_mtp()
            self.note_other_stages()
        return self.plans

    def note_other_stages(self):
        """One warning naming the ids the config gives that are on other pipeline stages (ignored here)."""
        absent_mtp = set(self.absent_mtp_ids())   # note_absent_mtp's to tell about
        named = {f: sorted(ids - absent_mtp) for f, ids in self.elsewhere.items()}
        named = {f: ids for f, ids in named.items() if ids}
        if not named:
            return
        every = sorted(set().union(*named.values()))
        fields = ", ".join(list(named)[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
        self.warn(f"layers {self.format_ids(every)} ({fields}) are not on this pipeline stage, which "
                  f"holds global layers {self.format_ids(self.plans)}: ignored here (each stage acts on its own "
                  f"layers; the same config goes to every stage)")

    def format_ids(self, ids):
        return ", ".join(str(spec) for spec in format_layer_specs(sorted(ids)))

    def absent_mtp_ids(self):
        """The MTP ids the config names, on the stage that holds the last decoder layer, with no MTP block."""
        stack = self.stack
        if stack.mtp_cells or stack.offset + len(stack.cells) != stack.num_layers:
            return []
        return sorted(i for i in self.requested if i not in self.plans)

    def note_absent_mtp(self):
        """MTP ids named on the stage that holds the last decoder layer, without an MTP block: say they
        do nothing here (on earlier stages they are another stage's layers, like any other id)."""
        stack, absent = self.stack, self.absent_mtp_ids()
        if not absent:
            return
        self.warn(f"the config names MTP layers {format_layer_specs(absent)} (config.mtp_num_layers="
                  f"{stack.num_mtp_layers}) but apply_ac got no mtp_block, so they are left as they are: pass "
                  f"mtp_block=<the MTP block> (e.g. model.mtp) to act on them")


def check_pynative():
    """mindformers_ac runs in PyNative mode only: ConfigError naming the mode otherwise."""
    mode = ms.get_context("mode")
    if mode != ms.PYNATIVE_MODE:
        name = "GRAPH_MODE" if mode == ms.GRAPH_MODE else repr(mode)
        raise ConfigError("mode", f"mindformers_ac works in PyNative mode only, and MindSpore runs in {name}: "
                                  f"it recomputes and swaps by patching cells and intercepting ops in Python, "
                                  f"which a compiled graph never runs. Call "
                                  f"ms.set_context(mode=ms.PYNATIVE_MODE) before building the model, and don't "
                                  f"wrap the training step in ms.jit (in graph mode use MindSpore's own "
                                  f"Cell.recompute())")


def _check_pp(pp):
    check_int(pp, "pp", 1, meaning=" (the pipeline-parallel size)")


def check_layer_ids(config, num_layers, pp=1):
    """The checks that need at most the layer count (``mindformers-ac validate``).

    With ``num_layers=None``: the config's structure and the pp rule. With a
    count (at most ``MAX_LAYERS``): also layer-spec bounds, prefetch bounds and
    full-recompute vs layer-swap overlap. Pattern matches need a model and are
    left to ``plan_ac``. Returns the layer plans (empty without a count).
    """
    _check_pp(pp)
    config = _budget_config(resolve_config(config))
    if num_layers is None:
        return {}
    check_int(num_layers, "num_layers", 1, MAX_LAYERS)
    return _PlanPass(config, pp, num_layers).plan()


def _budget_config(config):
    """With ``memory_budget`` set, the config the profiling plan starts from: its layer lists are the
    budget's to choose (a warning names the hand-written ones it replaces), its settings stay."""
    if not config.memory_budget.enabled:
        return config
    cleared = with_layer_lists(config)
    given = [f"{name}.{key}" for name in ("recompute", "recompute_comm", "swap")
             for key in LAYER_LIST_FIELDS[name]
             if key not in ("mode", "enable")
             and getattr(getattr(config, name), key) != getattr(getattr(cleared, name), key)]
    if given:
        logger.warning("memory_budget is set, so it chooses every layer's recompute and swap: the hand-written lists "
                       "(%s) are not applied (remove memory_budget to apply them)", ", ".join(given))
    return cleared


def plan_ac(model, recompute=None, recompute_comm=None, swap=None, pp=1, mtp_block=None, *, config=None,
            layers=None, layer_offset=None, num_layers=None):
    """Resolve and validate a config against ``model`` without changing it.

    Takes MindFormers' arguments (three sections as dataclasses, dicts or
    ``None``) or ``config=`` (an ``AcConfig``, a dict of sections or a YAML
    path). ``layers`` names the layer list when it can't be found
    automatically; ``layer_offset`` / ``num_layers`` place a pipeline stage
    whose layer list has no ``layer_start`` / ``config.num_layers`` (see
    ``apply_ac``). ``mtp_block`` (MindFormers' multi-token-prediction block,
    a cell holding its layer list, e.g. ``model.mtp``): its layer ``i`` is
    global layer ``num_layers + i`` in every section and in the plan
    (``plan.layers[num_layers + i]``). Raises ``ConfigError`` for any rule in
    this module's docstring; logs a warning for each pattern that matched
    nothing.
    """
    return plan_with_layers(model, recompute, recompute_comm, swap, pp, mtp_block, config=config,
                            layers=layers, layer_offset=layer_offset, num_layers=num_layers)[0]


def plan_with_layers(model, recompute=None, recompute_comm=None, swap=None, pp=1, mtp_block=None, *,
                     config=None, layers=None, layer_offset=None, num_layers=None):
    """``plan_ac`` that also returns the ``LayerStack`` it planned against (for ``apply_ac``)."""
    _check_pp(pp)
    config = _budget_config(resolve_config(config, recompute, recompute_comm, swap))
    check_pynative()
    refuse_copied_patches(model)
    if isinstance(mtp_block, ms.nn.Cell):
        refuse_copied_patches(mtp_block)
    stack = find_layer_stack(model, layers, mtp_block, layer_offset, num_layers)
    if pp > 1 and not stack.offset_known:
        raise ConfigError("layer_offset", f"pp={pp}, and the global id of this stage's first layer is not known: "
                                          f"'{stack.path}' has no layer_start (as MindFormers' TransformerBlock "
                                          f"has). Pass layer_offset=<the global id of its first layer> (0 on the "
                                          f"first stage), and num_layers=<the whole model's layers> if the model "
                                          f"has no config.num_layers, so the config's global ids land on the "
                                          f"right layers")
    planner = _PlanPass(config, pp, stack.total_layers, stack, model)
    layer_plans = planner.plan()
    plan = AcPlan(config=config, layers=layer_plans, num_layers=stack.num_layers,
                  layer_path=stack.path, pp=pp, matches=planner.matches, warnings=planner.warnings,
                  num_mtp_layers=stack.num_mtp_layers, mtp_path=stack.mtp_path)
    # per layer at debug level: apply_ac reports the whole plan once (AcPlan.summary)
    for lp in plan.active_layers():
        logger.debug("plan: layer %s: %s", lp.label, "; ".join(lp.describe()))
    if not plan.active_layers():
        logger.debug("plan: no layer is recomputed or swapped")
    return plan, stack
