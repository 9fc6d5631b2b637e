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
import regex
import yaml

from .config import DEVICE_BACKEND_TARGETS, AcConfig, RecomputeMode, resolve_config, with_layer_lists
from .errors import ConfigError, clip, item_field, quote
from .layer_specs import format_layer_specs, parse_layer_specs, spec_ranges, swappable_layers
from .layers import find_layer_stack
from .limits import MAX_LAYERS
from .matching import MatchBudget, drop_covered, match_entries
from .model_checks import check_engine_reach, check_shared_layers, check_shared_targets, refuse_copied_patches
from .whitelist import as_op_target, is_under, layer_inventory

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
            check_shared_layers(self.stack, self.plans)
            check_shared_targets(self.stack, self.plans)
            check_engine_reach(self.stack, self.plans, self.model)
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
