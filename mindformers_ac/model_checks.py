"""What a model must allow for ``apply_ac`` to act on it, checked by ``plan_ac`` before anything changes.

Every action's targets (a recomputed or swapped layer, a selected module, the module holding an op or
a method) pass through these checks, whichever section put them in the plan:

* no recompute or swap on a layer whose cell is also another layer of the list (weight-shared layers),
  nor on a select / comm / op-swap target (a module, or the module holding an op) that another layer
  also holds: the installers patch the cell itself, which can't tell the layers apart
  (``check_shared_layers``, ``check_shared_targets``);
* PyNative only: no cell the installers patch (the model, a recomputed or swapped layer, a target or a
  cell around it) may have a construct compiled by ``ms.jit``; a jit cell *inside* a recomputed region
  or swapped layer/module runs as one op, and what it saves stays in memory: that is noted on the layer
  (``LayerPlan.notes``) and logged once (``check_engine_reach``, ``check_layer_reach``);
* MindSpore's own ``Cell.recompute()`` on a cell the config recomputes, or on a cell inside or around
  such a region: one recompute can't run inside the other;
* no ``checkpoint_wrapper`` / ``swap_wrapper`` of the user's on a cell the config recomputes;
* no cell carrying patches that ``apply_ac`` made for another cell (a network rewritten after
  ``apply_ac``, e.g. by amp O1: apply amp first; ``refuse_copied_patches``).

Each refusal is a ``ConfigError`` on field ``model`` naming the cell, the action, and what to change.
"""
import logging

import mindspore as ms

from .construct_patch import copied_patch_message, find_patch, foreign_patches
from .errors import ConfigError
from .whitelist import is_under, sub_cell

logger = logging.getLogger("mindformers_ac")


def enclosing_cells(model, stack):
    """(path, cell) of the model and every cell on the way down to the layer list, outermost first;
    then the MTP block and the cells down to its layer list."""
    if model is None:
        return []
    found = [("<model>", model)]
    if stack.path != "<given>":
        found += _cells_on_path(model, stack.path, "")
    block = stack.mtp_block
    if isinstance(block, ms.nn.Cell):
        found.append(("mtp_block", block))
        found += _cells_on_path(block, stack.mtp_path[len("mtp_block."):], "mtp_block.")
    return found


def check_engine_reach(stack, plans, model):
    """Refuse cells the engine can't run (jit-compiled, or under MindSpore's own recompute); note jit
    cells it runs around without acting on them. See the module docstring."""
    active = [lp for lp in plans.values() if not lp.is_empty]
    if not active:
        return
    for path, cell in enclosing_cells(model, stack):
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
        check_layer_reach(stack, lp)
        prefetch = lp.prefetch_layer
        if prefetch is not None and stack.holds(prefetch) and _jit_compiled(stack.cell(prefetch)):
            cell = stack.cell(prefetch)
            raise ConfigError("model", f"{_name('', cell, prefetch)} has a construct compiled by ms.jit, and "
                                       f"the swap of layer {lp.layer_id} is prefetched when its backward "
                                       f"starts (a patch on that layer, which a jit graph bypasses). Remove "
                                       f"ms.jit from it, or change swap.default_prefetch")


def check_layer_reach(stack, lp):
    i = lp.layer_id
    layer = stack.cell(i)
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


def check_shared_layers(stack, plans):
    """Refuse recompute or swap on a layer whose cell object is also another layer of the list.

    Recompute and swap patch the cell in place (an instance ``construct``,
    hooks) and key what they keep by layer id: a shared cell would be
    patched twice, or acted on for ids the plan leaves alone.
    """
    by_cell = {}
    for i in stack.layer_ids:
        by_cell.setdefault(id(stack.cell(i)), []).append(i)
    for ids in by_cell.values():
        active = [i for i in ids if not plans[i].is_empty]
        if len(ids) > 1 and active:
            shared = ", ".join(map(str, ids))
            raise ConfigError("model", f"layers {shared} of '{stack.path}' are one "
                                       f"{type(stack.cell(ids[0])).__name__} cell (weight-shared layers) "
                                       f"and the config recomputes or swaps layer "
                                       f"{', '.join(map(str, active))}; recompute and swap patch the cell "
                                       f"itself, so they can't act on one of these layers only or tell their "
                                       f"calls apart: give each layer its own cell (sharing parameters is "
                                       f"fine), or leave layers {shared} out of recompute and swap")


def check_shared_targets(stack, plans):
    """Refuse a select / comm / op-swap target (module, or the module holding an op) that is also
    part of another layer: patching it would act on that layer's calls too, which the plan says
    are untouched (or patch it twice)."""
    if not any(lp.recompute or lp.recompute_comm or lp.op_swap for lp in plans.values()):
        return
    owner_of = {}   # id of a cell inside a layer -> ids of the layers holding it
    for i in stack.layer_ids:
        for _, cell in stack.cell(i).cells_and_names():
            owner_of.setdefault(id(cell), []).append(i)
    for i, lp in plans.items():
        layer = stack.cell(i)
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
