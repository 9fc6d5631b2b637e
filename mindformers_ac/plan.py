"""Dry run: resolve a config against a model into an ``AcPlan``, checking every rule.

``plan_ac`` reads the model (layer list, whitelists) and never changes it.
``apply_ac`` executes exactly the plan this returns, so what ``explain``
prints is what training gets. All cross-section rules live here, in one pass,
so a rejected config fails before anything is installed:

* layer specs within ``[0, total - 1]`` (global ids; ``total`` is ``num_layers``
  plus the MTP layers, which come after the decoder's: MTP layer ``i`` is
  ``num_layers + i``);
* ``swap.default_prefetch`` in ``[1, total - 1]`` and ``layer + p < total``
  for every swapped layer (the last decoder layer is prefetched by an MTP
  layer's backward; the last MTP layer can't be swapped);
* no layer both recomputed (full, or select / comm targets in it) and layer-swapped;
* no op swap on a recomputed module or on its parent or child;
* no swap with pipeline parallelism (``pp > 1``);
* no recompute or swap on a layer whose cell is also another layer of the list
  (weight-shared layers), nor a select / comm / op-swap target (a module, or
  the module holding an op) that another layer also holds: the installers
  patch the cell itself, which can't tell the layers apart;
* PyNative only: not in GRAPH_MODE, and no cell the installers patch (the
  model, a recomputed or swapped layer, a target or a cell around it) may
  have a construct compiled by ``ms.jit`` (a jit graph never runs the
  patched Python); a jit cell *inside* a recomputed region or swapped
  layer/module runs as one op, and what it saves stays in memory: that is
  noted on the layer (``LayerPlan.notes``) and logged once;
* MindSpore's own ``Cell.recompute()`` on a cell the config recomputes, or
  on a cell inside or around such a region: one recompute can't run inside
  the other;
* no ``checkpoint_wrapper`` / ``swap_wrapper`` of the user's on a cell the config
  recomputes (``apply_ac`` wraps it itself, and a cell takes one such wrapper);
* no cell carrying patches that ``apply_ac`` made for another cell (a network
  rewritten after ``apply_ac``, e.g. by amp O1: apply amp first).

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
import regex
import yaml

from .config import DEVICE_BACKEND_TARGETS, AcConfig, RecomputeMode, resolve_config, with_layer_lists
from .construct_patch import copied_patch_message, find_patch, foreign_patches
from .errors import ConfigError, clip, item_field, quote
from .layer_specs import format_layer_specs, parse_layer_specs, spec_ranges, swappable_layers
from .layers import find_layer_stack
from .limits import MAX_LAYERS
from .matching import MatchBudget, drop_covered, match_entries
from .whitelist import as_op_target, is_under, layer_inventory, sub_cell

logger = logging.getLogger("mindformers_ac")


@dataclass
class LayerPlan:
    """What happens to one layer (global id ``layer_id``)."""

    layer_id: int
    full_recompute: bool = False
    recompute: tuple = ()        # select-recompute target paths (cells or ops)
    recompute_comm: tuple = ()   # comm op paths re-run in backward
    exclude: tuple = ()          # op names (list form) or paths (dict form) kept inside recompute
    exclude_by_path: bool = False
    layer_swap: bool = False
    op_swap: tuple = ()          # module / op paths swapped
    prefetch_layer: Optional[int] = None
    targets: dict = field(default_factory=dict, repr=False)   # target path -> its WhitelistEntry
    notes: tuple = ()            # what the engine runs around but can't act on (e.g. jit cells)
    mtp_index: Optional[int] = None   # i for MTP layer i (global id num_layers + i), None for a decoder layer
    group: tuple = ()            # full recompute in a group (recompute.group_layers): the group's layer ids

    @property
    def label(self):
        """``'3'``, or ``'9 (MTP 1)'`` for an MTP layer."""
        return str(self.layer_id) if self.mtp_index is None else f"{self.layer_id} (MTP {self.mtp_index})"

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
        return self.full_recompute or bool(self.recompute) or bool(self.recompute_comm)

    @property
    def swapped(self):
        return self.layer_swap or bool(self.op_swap)

    @property
    def is_empty(self):
        return not (self.recomputed or self.swapped)

    def describe(self):
        """Short human-readable actions, e.g. ``['full recompute', 'exclude AllGather']``."""
        parts = []
        if self.full_recompute:
            parts.append("full recompute" + (f" (group {format_layer_specs(self.group)[0]})" if self.group else ""))
        if self.recompute:
            parts.append("recompute " + ", ".join(self.recompute))
        if self.recompute_comm:
            parts.append("comm recompute " + ", ".join(self.recompute_comm))
        if self.exclude:
            parts.append("keep " + ", ".join(self.exclude))
        if self.layer_swap:
            parts.append("layer swap")
        if self.op_swap:
            parts.append("swap " + ", ".join(self.op_swap))
        if self.prefetch_layer is not None:
            parts.append(f"prefetch at layer {self.prefetch_layer} backward")
        return parts


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
        rows = [("layer", "recompute", "comm recompute", "keep (exclude_op)", "swap", "prefetch at")]
        for lp in self.layers.values():
            recompute = "full" if lp.full_recompute else ", ".join(lp.recompute) or "-"
            if lp.group:
                recompute += f" (group {format_layer_specs(lp.group)[0]})"
            swap = "layer" if lp.layer_swap else ", ".join(lp.op_swap) or "-"
            rows.append((lp.label, recompute, ", ".join(lp.recompute_comm) or "-",
                         ", ".join(lp.exclude) or "-", swap,
                         "-" if lp.prefetch_layer is None else self.layer_label(lp.prefetch_layer)))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = [header] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                            for row in rows]
        if any(lp.swapped for lp in self.layers.values()):
            sc = self.config.swap
            bound = "none (no bound)" if sc.max_host_bytes is None else str(sc.max_host_bytes)
            lines.append(f"Swap settings: min_bytes {sc.min_bytes}, max_host_bytes {bound}, backend {sc.backend}")
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
        groups = {}   # action text -> layer ids, in the order the actions are first seen
        p = self.config.swap.default_prefetch

        def keep(lp):
            return f"keeping {', '.join(lp.exclude)}" if lp.exclude else ""

        grouped = self.config.recompute.group_layers > 1 and any(lp.group for lp in self.layers.values())
        for lp in self.layers.values():
            if lp.full_recompute:
                detail = "; ".join(x for x in (self._groups_text() if grouped else "", keep(lp)) if x)
                groups.setdefault(("full recompute", detail), []).append(lp.layer_id)
            if lp.recompute:
                detail = "; ".join(x for x in (", ".join(lp.recompute), keep(lp)) if x)
                groups.setdefault(("select recompute", detail), []).append(lp.layer_id)
            if lp.recompute_comm:
                groups.setdefault(("comm recompute", ", ".join(lp.recompute_comm)), []).append(lp.layer_id)
            if lp.layer_swap:
                groups.setdefault(("layer swap", f"prefetch {p}"), []).append(lp.layer_id)
            if lp.op_swap:
                groups.setdefault(("op swap", f"{', '.join(lp.op_swap)}; prefetch {p}"), []).append(lp.layer_id)
        text = "; ".join(f"{action} on layer{'s' if len(ids) > 1 else ''} {self.format_layers(ids)}"
                         + (f" ({detail})" if detail else "") for (action, detail), ids in groups.items()) \
            or "nothing to install (no layer is recomputed or swapped)"
        notes = sum(len(lp.notes) for lp in self.layers.values())
        extra = [f"{n} {what}{'s' if n > 1 else ''}" for n, what in ((len(self.warnings), "warning"),
                                                                      (notes, "note")) if n]
        return text + (f" ({', '.join(extra)}: see plan.explain())" if extra else "")

    def groups(self):
        """The recompute groups (``recompute.group_layers``): a tuple of layer ids per group, in order."""
        return list(dict.fromkeys(lp.group for lp in self.layers.values() if lp.group))

    def _groups_text(self):
        n = self.config.recompute.group_layers
        return f"groups of {n}: " + ", ".join(str(format_layer_specs(g)[0]) for g in self.groups())

    def to_config(self):
        """The ``AcConfig`` that reproduces this plan with exact paths."""
        layers = self.layers.values()
        excluded = [lp for lp in layers if lp.exclude]
        exclude_op = None
        if excluded:
            exclude_op = (_paths_to_layers(excluded, "exclude") if excluded[0].exclude_by_path
                          else list(excluded[0].exclude))
        return with_layer_lists(
            self.config, full=[lp.layer_id for lp in layers if lp.full_recompute],
            select_module=_paths_to_layers(layers, "recompute"), exclude_op=exclude_op,
            comm_select=_paths_to_layers(layers, "recompute_comm"),
            layer_swap=[lp.layer_id for lp in layers if lp.layer_swap],
            op_swap=_paths_to_layers(layers, "op_swap"))

    def to_dict(self):
        """The three YAML sections that reproduce this plan with exact paths."""
        return self.to_config().to_dict()

    def to_yaml(self):
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


def _paths_to_layers(layer_plans, attr):
    by_path = {}
    for lp in layer_plans:
        for path in getattr(lp, attr):
            by_path.setdefault(regex.escape(path, special_only=True), []).append(lp.layer_id)
    return {path: format_layer_specs(ids) for path, ids in by_path.items()}


class _PlanPass:
    """One pass of ``plan_ac`` over a config; holds per-call state only (nothing survives the call).

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
        self.budget = MatchBudget()
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
        return ids

    def match(self, field_path, pattern, specs):
        """Match ``pattern`` in every local layer of ``specs``; record and warn if empty."""
        layer_ids = self.layer_ids(specs, field_path)
        if not self.match_patterns:
            return {}
        local = [i for i in layer_ids if i in self.plans]
        found = {i: match_entries(pattern, self.inventory(i), field_path, self.budget) for i in local}
        self.matches.append(PatternMatch(field_path, pattern, tuple(layer_ids),
                                         {i: [e.path for e in es] for i, es in found.items()}))
        if local and not any(found.values()):
            section = field_path.split("[")[0]
            self.warn(f"{section} pattern '{clip(pattern)}' did not match any module")
        return found

    def plan(self):
        self.plan_recompute()
        self.plan_comm()
        self.plan_swap()
        if self.match_patterns:   # a real model: its cells can be compared
            self.check_shared_layers()
            self.check_shared_targets()
            self.check_engine_reach()
            self.note_absent_mtp()
        return self.plans

    def note_absent_mtp(self):
        """MTP ids named on the stage that holds the last decoder layer, without an MTP block: say they
        do nothing here (on earlier stages they are another stage's layers, like any other id)."""
        stack = self.stack
        absent = sorted(i for i in self.requested if i not in self.plans)
        if stack.mtp_cells or not absent or stack.offset + len(stack.cells) != stack.num_layers:
            return
        self.warn(f"the config names MTP layers {format_layer_specs(absent)} (config.mtp_num_layers="
                  f"{stack.num_mtp_layers}) but apply_ac got no mtp_block, so they are left as they are: pass "
                  f"mtp_block=<the MTP block> (e.g. model.mtp) to act on them")

    def enclosing_cells(self):
        """(path, cell) of the model and every cell on the way down to the layer list, outermost first;
        then the MTP block and the cells down to its layer list."""
        if self.model is None:
            return []
        found = [("<model>", self.model)]
        if self.stack.path != "<given>":
            found += _cells_on_path(self.model, self.stack.path, "")
        block = self.stack.mtp_block
        if isinstance(block, ms.nn.Cell):
            found.append(("mtp_block", block))
            found += _cells_on_path(block, self.stack.mtp_path[len("mtp_block."):], "mtp_block.")
        return found

    def check_engine_reach(self):
        """Refuse cells the engine can't run (jit-compiled, or under MindSpore's own recompute); note jit
        cells it runs around without acting on them. See the module docstring."""
        active = [lp for lp in self.plans.values() if not lp.is_empty]
        if not active:
            return
        for path, cell in self.enclosing_cells():
            if _jit_compiled(cell):
                raise ConfigError("model", f"{_name(path, cell)} has a construct compiled by ms.jit: the "
                                           f"forward runs as a graph, and mindformers_ac works in PyNative only "
                                           f"(it patches layers and intercepts ops in Python, which a graph never "
                                           f"runs; it would fail with 'Parse Resolve convert failed'). Remove "
                                           f"ms.jit from it and from the training step; jit cells inside a layer "
                                           f"are fine")
            if _native_recompute(cell) and any(lp.recomputed for lp in active):
                raise ConfigError("model", f"{_name(path, cell)} uses MindSpore's Cell.recompute(), which "
                                           f"re-runs the layers the config recomputes inside its own recompute; "
                                           f"one recompute can't run inside the other: drop its "
                                           f"cell.recompute() call or the recompute section")
        for lp in active:
            self.check_layer_reach(lp)
            prefetch = lp.prefetch_layer
            if prefetch is not None and self.stack.holds(prefetch) and _jit_compiled(self.stack.cell(prefetch)):
                cell = self.stack.cell(prefetch)
                raise ConfigError("model", f"{_name('', cell, prefetch)} has a construct compiled by ms.jit, and "
                                           f"the swap of layer {lp.layer_id} is prefetched when its backward "
                                           f"starts (a patch on that layer, which a jit graph bypasses). Remove "
                                           f"ms.jit from it, or change swap.default_prefetch")

    def check_layer_reach(self, lp):
        i = lp.layer_id
        layer = self.stack.cell(i)
        cells = dict(layer.cells_and_names())   # '' is the layer itself
        # a method's region runs inside its owner cell: the owner is what a jit graph or a native
        # recompute around or inside it would affect
        methods = {lp.targets[p].owner_path: p for p in lp.recompute if p in lp.method_paths}
        regions = ([""] if lp.full_recompute else []) + list(dict.fromkeys(
            lp.targets[p].cell_path for p in lp.recompute if p not in lp.op_paths))
        swapped = ([""] if lp.layer_swap else []) + list(lp.op_swap)
        owners = [lp.targets[p].owner_path for p in lp.recompute + lp.recompute_comm if p in lp.op_paths]

        def action(path):
            if lp.full_recompute:
                return f"full recompute of layer {i}"
            if path in lp.recompute:
                return f"select recompute of '{path}' in layer {i}"
            if path in methods:
                return f"select recompute of method '{methods[path]}' in layer {i}"
            if path in lp.op_swap:
                return f"op swap of '{path}' in layer {i}"
            if path in owners:
                return f"output recompute of an op of '{path}' in layer {i}"
            return f"{'; '.join(lp.describe())} (layer {i})"

        for target in [""] + regions + swapped + owners:
            for path in _self_and_ancestors(target):
                cell = sub_cell(layer, path)
                if _jit_compiled(cell):
                    raise ConfigError("model", f"{_name(path, cell, i)} has a construct compiled by "
                                               f"ms.jit, and the config acts on it or inside it "
                                               f"({action(target)}): AC patches the cell in PyNative, which a "
                                               f"jit graph bypasses (every forward would fail with 'Parse "
                                               f"Resolve convert failed'). Remove ms.jit from that cell, or leave "
                                               f"it out of recompute and swap (a jit cell inside a recomputed "
                                               f"module runs, but as one op)")
        for root in regions:
            cell = sub_cell(layer, root)
            for kind, undo in _CELL_WRAPPERS:
                if find_patch(cell, kind) is not None:
                    raise ConfigError("model", f"{_name(root, cell, i)} is already wrapped by {kind}, and the "
                                               f"config recomputes it ({action(root)}): apply_ac wraps the cells "
                                               f"it recomputes itself, and a cell takes one such wrapper. Undo "
                                               f"yours with mindformers_ac.{undo} (or remove_ac(model) if an "
                                               f"earlier apply_ac made it), or leave the cell out of the config")
        for root in regions:
            for path, cell in cells.items():
                if not _native_recompute(cell):
                    continue
                if path == root:
                    raise ConfigError("model", f"{_name(path, cell, i)} already uses MindSpore's "
                                               f"Cell.recompute() and the config recomputes it too "
                                               f"({action(root)}); the two recompute mechanisms can't be "
                                               f"combined on one cell: drop its cell.recompute() call (the "
                                               f"config's recompute is exact, dropout included) or leave it out "
                                               f"of the config")
                if _within(path, root) or _within(root, path):
                    where = "inside" if _within(path, root) else "around"
                    raise ConfigError("model", f"{_name(path, cell, i)} uses MindSpore's Cell.recompute() "
                                               f"{where} a region the config recomputes ({action(root)}); one "
                                               f"recompute can't run inside the other (backward fails with "
                                               f"'The pointer[top_cell_] is null'): drop its cell.recompute() "
                                               f"call (the config's recompute covers it) or recompute only "
                                               f"modules beside it")
        notes = []
        for root, what in [(r, "recomputed") for r in regions] + [(r, "swapped") for r in swapped]:
            for path, cell in cells.items():
                if path != root and _within(path, root) and _jit_compiled(cell):
                    notes.append(f"'{path}' ({type(cell).__name__}) runs under ms.jit: the engine sees it "
                                 f"as one op, and what it saves for backward stays in memory (not {what})")
        if notes:
            lp.notes = tuple(dict.fromkeys(notes))
            for note in lp.notes:
                logger.warning("layer %d: %s", i, note)

    def check_shared_layers(self):
        """Refuse recompute or swap on a layer whose cell object is also another layer of the list.

        Recompute and swap patch the cell in place (an instance ``construct``,
        hooks) and key what they keep by layer id: a shared cell would be
        patched twice, or acted on for ids the plan leaves alone.
        """
        by_cell = {}
        for i in self.stack.layer_ids:
            by_cell.setdefault(id(self.stack.cell(i)), []).append(i)
        for ids in by_cell.values():
            active = [i for i in ids if not self.plans[i].is_empty]
            if len(ids) > 1 and active:
                shared = ", ".join(map(str, ids))
                raise ConfigError("model", f"layers {shared} of '{self.stack.path}' are one "
                                           f"{type(self.stack.cell(ids[0])).__name__} cell (weight-shared layers) "
                                           f"and the config recomputes or swaps layer "
                                           f"{', '.join(map(str, active))}; recompute and swap patch the cell "
                                           f"itself, so they can't act on one of these layers only or tell their "
                                           f"calls apart: give each layer its own cell (sharing parameters is "
                                           f"fine), or leave layers {shared} out of recompute and swap")

    def check_shared_targets(self):
        """Refuse a select / comm / op-swap target (module, or the module holding an op) that is also
        part of another layer: patching it would act on that layer's calls too, which the plan says
        are untouched (or patch it twice)."""
        if not any(lp.recompute or lp.recompute_comm or lp.op_swap for lp in self.plans.values()):
            return
        owner_of = {}   # id of a cell inside a layer -> ids of the layers holding it
        for i in self.stack.layer_ids:
            for _, cell in self.stack.cell(i).cells_and_names():
                owner_of.setdefault(id(cell), []).append(i)
        for i, lp in self.plans.items():
            layer = self.stack.cell(i)
            for path in lp.recompute + lp.recompute_comm + lp.op_swap:
                entry = lp.targets[path]
                cell = sub_cell(layer, entry.cell_path)
                others = [j for j in owner_of[id(cell)] if j != i]
                if others:
                    what = {"op": "the module holding op ", "method": "the module holding method "}.get(
                        entry.kind, "module ") + path
                    raise ConfigError("model", f"{what} of layer {i} is also part of layer "
                                               f"{', '.join(map(str, others))} (a shared module) and the config "
                                               f"recomputes or swaps it; recompute and swap patch it in place, so "
                                               f"they would act on it in every layer that holds it: give each "
                                               f"layer its own (sharing parameters is fine), or leave it out of "
                                               f"recompute and swap")

    def plan_recompute(self):
        rc = self.config.recompute
        if not rc.enabled:
            if rc.exclude_op:
                self.warn("recompute.exclude_op has no effect when recompute.mode is None")
            return
        if rc.mode == RecomputeMode.FULL and rc.select_module:
            self.warn("recompute.select_module is ignored when recompute.mode is full")
        full = set()
        if rc.full_recompute_layer is not None:
            full = set(self.layer_ids(rc.full_recompute_layer, "recompute.full_recompute_layer"))
        for i in full & set(self.plans):
            self.plans[i].full_recompute = True
        self.plan_groups(sorted(full & set(self.plans)), rc.group_layers)
        if rc.mode == RecomputeMode.SELECT:
            chosen = {i: [] for i in self.plans}
            for pattern, specs in rc.select_module.items():
                for i, entries in self.match(item_field("recompute.select_module", pattern), pattern,
                                             specs).items():
                    if i not in full:
                        chosen[i].extend(entries)
            for i, entries in chosen.items():
                order = {e.path: k for k, e in enumerate(self.inventory(i))} if entries else {}
                kept = drop_covered(sorted(entries, key=lambda e: order[e.path]))
                self.plans[i].recompute = tuple(e.path for e in kept)
                self.plans[i].targets.update({e.path: e for e in kept})
        self.plan_exclude(rc.exclude_op)
        for i, lp in self.plans.items():
            if lp.recompute and not lp.exclude:   # exclude_op keeps ops of a region: it stays one
                layer = self.stack.cell(i)
                lp.targets.update({p: as_op_target(lp.targets[p], layer) for p in lp.recompute})

    def plan_groups(self, full, size):
        """``recompute.group_layers``: runs of ``size`` consecutive ids of ``full`` (a gap, the end of a run
        or the start of the MTP layers cuts a group short) become one region each (``LayerPlan.group``)."""
        if size == 1:
            return
        if not full:
            self.warn("recompute.group_layers has no effect without recompute.full_recompute_layer")
            return
        runs = []
        for i in full:
            if runs and i == runs[-1][-1] + 1 and (i < self.num_decoder) == (runs[-1][-1] < self.num_decoder):
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            for k in range(0, len(run), size):
                group = tuple(run[k:k + size])
                if len(group) > 1:
                    for i in group:
                        self.plans[i].group = group

    def plan_exclude(self, exclude_op):
        if not exclude_op:
            return
        recomputed = [i for i, lp in self.plans.items() if lp.full_recompute or lp.recompute]
        if isinstance(exclude_op, dict):
            for pattern, specs in exclude_op.items():
                field_path = item_field("recompute.exclude_op", pattern)
                found = self.match(field_path, pattern, specs)
                for i, entries in found.items():
                    methods = [e.path for e in entries if e.is_method]
                    if methods:
                        self.warn(f"{field_path}: {', '.join(methods)} in layer {i} "
                                  f"{'is a method' if len(methods) == 1 else 'are methods'}; exclude_op keeps "
                                  f"what ops and modules compute, name the module or the ops the method calls "
                                  f"instead (not effective)")
                        entries = [e for e in entries if not e.is_method]
                    if entries and i not in recomputed:
                        self.warn(f"{field_path}: layer {i} is not recomputed, "
                                  f"so excluding {', '.join(e.path for e in entries)} has no effect")
                    elif entries:
                        lp = self.plans[i]
                        lp.exclude = lp.exclude + tuple(e.path for e in entries if e.path not in lp.exclude)
                        lp.exclude_by_path = True
            return
        names = tuple(dict.fromkeys(str(name) for name in exclude_op))
        for i in recomputed:
            self.plans[i].exclude = names

    def plan_comm(self):
        rcc = self.config.recompute_comm
        if not rcc.enabled:
            return
        for pattern, specs in rcc.select_module.items():
            field_path = item_field("recompute_comm.select_module", pattern)
            for i, entries in self.match(field_path, pattern, specs).items():
                lp = self.plans[i]
                for entry in entries:
                    if entry.is_method:
                        self.warn(f"{field_path}: {entry.path} in layer {i} is a method, not a communication "
                                  f"operation; name the collective's op or _comm_ops slot (not effective)")
                    elif not entry.is_op:
                        self.warn(f"{field_path}: {entry.path} in layer {i} is expected to be "
                                  f"operation but got cell, this configuration will not be effective")
                    elif lp.full_recompute or any(is_under(entry.path, t) for t in lp.recompute):
                        logger.info("recompute_comm: %s in layer %d is already recomputed with its "
                                    "enclosing region", entry.path, i)
                    elif entry.path not in lp.recompute_comm:
                        lp.recompute_comm = lp.recompute_comm + (entry.path,)
                        lp.targets[entry.path] = entry

    def plan_swap(self):
        sc = self.config.swap
        if not sc.enabled:
            return
        check_swap_pp(self.config, self.pp)
        target = ms.get_context("device_target") if self.stack is not None else None
        if sc.backend == "device" and target is not None and target not in DEVICE_BACKEND_TARGETS:
            raise ConfigError("swap.backend", f"device copies need an Ascend or GPU device, and MindSpore's "
                                              f"device_target is {target}: use auto or host")
        p = sc.default_prefetch
        if p > self.num_layers - 1:
            mtp = "" if self.num_layers == self.num_decoder else \
                f" ({self.num_decoder} decoder + {self.num_layers - self.num_decoder} MTP)"
            raise ConfigError("swap.default_prefetch", f"must be in [1, {self.num_layers - 1}] for a "
                                                       f"model with {self.num_layers} layers{mtp}, got {quote(p)}")
        for k, entry in enumerate(sc.layer_swap or ()):
            field_path = f"swap.layer_swap[{k}].layers"
            for i in self.layer_ids(entry.layers, field_path):
                self.check_prefetch_bound(i, field_path)
                if i not in self.plans:
                    continue
                lp = self.plans[i]
                if lp.recomputed:
                    raise ConfigError(field_path, f"layer {i} is also recomputed "
                                                  f"({'; '.join(lp.describe())}); a layer can't be both "
                                                  f"recomputed and swapped")
                lp.layer_swap, lp.prefetch_layer = True, i + p
        for k, entry in enumerate(sc.op_swap or ()):
            field_path = f"swap.op_swap[{k}]"
            for i in self.layer_ids(entry.layers, f"{field_path}.layers"):
                self.check_prefetch_bound(i, f"{field_path}.layers")
            for i, entries in self.match(f"{field_path}.op_name", entry.op_name, entry.layers).items():
                self.add_op_swap(i, drop_covered(entries), field_path)

    def check_prefetch_bound(self, layer_id, field_path):
        p = self.config.swap.default_prefetch
        if layer_id not in swappable_layers(self.num_layers, p):
            count = f"num_layers {self.num_layers}" if self.num_layers == self.num_decoder else \
                (f"the {self.num_layers} layers ({self.num_decoder} decoder + "
                 f"{self.num_layers - self.num_decoder} MTP; layer i is fetched back when layer i + p "
                 f"starts its backward)")
            raise ConfigError(field_path, f"layer {layer_id} + default_prefetch {p} must be < {count}: the last "
                                          f"layer that can be swapped is {self.num_layers - p - 1}")

    def add_op_swap(self, layer_id, entries, field_path):
        lp = self.plans[layer_id]
        if entries and lp.layer_swap:
            self.warn(f"{field_path}: layer {layer_id} is swapped whole by layer_swap; "
                      f"the op swap of {', '.join(e.path for e in entries)} is covered")
            return
        for entry in entries:
            if entry.is_op or entry.is_method:
                what = "an operation" if entry.is_op else "a method"
                self.warn(f"{field_path}: {entry.path} in layer {layer_id} is {what}; op_swap "
                          f"swaps what a module saves, name its module instead (not effective)")
                continue
            if lp.full_recompute:
                raise ConfigError(field_path, f"{entry.path} in layer {layer_id} lies in a fully "
                                              f"recomputed layer; recompute and swap can't share a module")
            clash = [t for t in lp.recompute + lp.recompute_comm
                     if is_under(entry.path, t) or is_under(t, entry.path)]
            if clash:
                raise ConfigError(field_path, f"{entry.path} in layer {layer_id} overlaps the recompute "
                                              f"target {clash[0]} (same module, parent or child); "
                                              f"recompute and swap can't share a module")
            if entry.path not in lp.op_swap:
                lp.op_swap = lp.op_swap + (entry.path,)
                lp.targets[entry.path] = entry
        if lp.op_swap:
            lp.prefetch_layer = layer_id + self.config.swap.default_prefetch


def _cells_on_path(root, path, prefix):
    """``(prefix + 'a', cell), (prefix + 'a.b', cell) ...`` for each cell on dotted ``path`` below ``root``."""
    found, cell, walked = [], root, []
    for part in path.split(".") if path else ():
        cell = cell.name_cells().get(part) if isinstance(cell, ms.nn.Cell) else None
        if cell is None:
            break
        walked.append(part)
        found.append((prefix + ".".join(walked), cell))
    return found


def _jit_compiled(cell):
    """Whether ``cell``'s construct (instance or class) is wrapped by ``ms.jit`` (any capture mode)."""
    for fn in (cell.__dict__.get("construct"), getattr(type(cell), "construct", None)):
        if getattr(getattr(fn, "__func__", fn), "__wrapped_by_jit__", False):
            return True
    return False


# The user's cell wrappers that apply_ac's own checkpoint_wrapper refuses on the same cell, and their undo.
_CELL_WRAPPERS = (("checkpoint_wrapper", "unwrap(cell)"), ("swap_wrapper", "remove_swap_wrapper(cell)"))


def _native_recompute(cell):
    """Whether MindSpore's ``Cell.recompute()`` was called on ``cell``."""
    return getattr(cell, "_recompute_cell", None) is not None


def _name(path, cell, layer_id=None):
    """``layer 3 cell 'mlp' (MLP)``, ``layer 3 (Block)`` or ``'decoder' (Decoder)`` for messages."""
    if layer_id is None:
        return f"'{path}' ({type(cell).__name__})"
    if not path:
        return f"layer {layer_id} ({type(cell).__name__})"
    return f"layer {layer_id} cell '{path}' ({type(cell).__name__})"


def _within(path, root):
    """``is_under`` for paths inside a layer, where ``''`` is the layer itself (and holds every path)."""
    return root == "" or is_under(path, root)


def _self_and_ancestors(path):
    """``'a.b.c'`` -> ``['a.b.c', 'a.b', 'a', '']`` (``''`` is the layer)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:k]) for k in range(len(parts), -1, -1)]


def refuse_copied_patches(model):
    """ConfigError when ``model`` holds cells carrying patches apply_ac made for other cells (a rewritten copy)."""
    found = foreign_patches(model) if isinstance(model, ms.nn.Cell) else []
    if found:
        raise ConfigError("model", copied_patch_message(*found[0]))


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
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConfigError("pp", f"expected the pipeline-parallel size as an integer >= 1, got {quote(pp)}")


def check_swap_pp(config, pp):
    """Swap is refused under pipeline parallelism, whatever the model."""
    if config.swap.enabled and pp != 1:
        raise ConfigError("swap.enable", f"swap is not supported with pipeline parallelism "
                                         f"(pp={quote(pp)}); use recompute on pipeline stages")


def check_layer_ids(config, num_layers, pp=1):
    """The checks that need at most the layer count (``mindformers-ac validate``).

    With ``num_layers=None``: the config's structure and the pp rule. With a
    count (at most ``MAX_LAYERS``): also layer-spec bounds, prefetch bounds and
    full-recompute vs layer-swap overlap. Pattern matches need a model and are
    left to ``plan_ac``. Returns the layer plans (empty without a count).
    """
    _check_pp(pp)
    config = resolve_config(config)
    check_swap_pp(config, pp)
    if num_layers is None:
        return {}
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= MAX_LAYERS:
        raise ConfigError("num_layers", f"expected an integer in [1, {MAX_LAYERS}], got {quote(num_layers)}")
    return _PlanPass(config, pp, num_layers).plan()


def plan_ac(model, recompute=None, recompute_comm=None, swap=None, pp=1, mtp_block=None, *, config=None,
            layers=None):
    """Resolve and validate a config against ``model`` without changing it.

    Takes MindFormers' arguments (three sections as dataclasses, dicts or
    ``None``) or ``config=`` (an ``AcConfig``, a dict of sections or a YAML
    path). ``layers`` names the layer list when it can't be found
    automatically. ``mtp_block`` (MindFormers' multi-token-prediction block,
    a cell holding its layer list, e.g. ``model.mtp``): its layer ``i`` is
    global layer ``num_layers + i`` in every section and in the plan
    (``plan.layers[num_layers + i]``). Raises ``ConfigError`` for any rule in
    this module's docstring; logs a warning for each pattern that matched
    nothing.
    """
    return plan_with_layers(model, recompute, recompute_comm, swap, pp, mtp_block, config=config,
                            layers=layers)[0]


def plan_with_layers(model, recompute=None, recompute_comm=None, swap=None, pp=1, mtp_block=None, *,
                     config=None, layers=None):
    """``plan_ac`` that also returns the ``LayerStack`` it planned against (for ``apply_ac``)."""
    _check_pp(pp)
    config = resolve_config(config, recompute, recompute_comm, swap)
    check_pynative()
    refuse_copied_patches(model)
    if isinstance(mtp_block, ms.nn.Cell):
        refuse_copied_patches(mtp_block)
    stack = find_layer_stack(model, layers, mtp_block)
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
