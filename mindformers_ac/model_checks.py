"""What a model must allow for ``apply_ac`` to act on it, checked by ``plan_ac`` before anything changes.

The checks read what each action of a layer acts on (``Action.targets``: the layer, a module, the module
holding an op or a method; ``actions.base.Target``) and name no action, so a new action's targets pass
through all of them:

* no recompute or swap on a layer whose cell is also another layer of the list (weight-shared layers),
  nor on a target below the layer (a module, or the module holding an op or method) that another layer
  also holds: the installers patch the cell itself, which can't tell the layers apart
  (``check_shared_layers``, ``check_shared_targets``);
* PyNative only: no cell the installers patch (the model, a target or a cell around it, the layer whose
  backward fetches a swap back) may have a construct compiled by ``ms.jit``; a jit cell *inside* a
  recompute or swap region runs as one op, and what it saves stays in memory: that is noted on the layer
  (``LayerPlan.notes``) and logged once (``check_engine_reach``, ``check_layer_reach``);
* MindSpore's own ``Cell.recompute()`` on a recompute region, or on a cell inside or around it (or
  around the layer list, when anything is recomputed): one recompute can't run inside the other;
* no ``checkpoint_wrapper`` / ``swap_wrapper`` of the user's on a recompute region's cell;
* no cell carrying patches that ``apply_ac`` made for another cell (a network rewritten after
  ``apply_ac``, e.g. by amp O1: apply amp first; ``refuse_copied_patches``).

Each refusal is a ``ConfigError`` on field ``model`` naming the cell, the action on it (``Target.text``),
and what to change. Rules between actions (a swap on a recomputed module ...) are ``actions.base.OVERLAPS``.
"""
import logging

import mindspore as ms

from .construct_patch import copied_patch_message, find_patch, foreign_patches
from .errors import ConfigError
from .mindspore_compat import jit_compiled, uses_native_recompute
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
        if uses_native_recompute(cell) and any(lp.recomputed for lp in active):
            raise ConfigError("model", f"{_name(path, cell)} uses MindSpore's Cell.recompute(), which "
                                       f"re-runs the layers the config recomputes inside its own recompute; "
                                       f"one recompute can't run inside the other: drop its "
                                       f"cell.recompute() call or the recompute section")
    for lp in active:
        check_layer_reach(stack, lp)
        for action in lp.actions:
            _refuse_jit_prefetch(stack, lp.layer_id, action.prefetch_layer)


def _targets(lp):
    """Every ``actions.base.Target`` of the layer's actions, in plan order."""
    return [target for action in lp.actions for target in action.targets(lp)]


def check_layer_reach(stack, lp):
    """The checks on what the layer's actions patch (every action's ``targets``): no jit cell on the way to
    a target, no wrapper of the user's or ``Cell.recompute()`` on or around a recompute region; jit cells
    inside a region are noted on the layer."""
    layer, targets = stack.cell(lp.layer_id), _targets(lp)
    _refuse_jit(layer, lp.layer_id, targets)
    regions = [t for t in targets if t.region and t.recomputes]
    for target in regions:
        _refuse_wrapped(layer, lp.layer_id, target)
        _refuse_native_recompute(layer, lp.layer_id, target)
    notes = tuple(dict.fromkeys(note for t in targets if t.region for note in _jit_inside(layer, t)))
    if notes:
        lp.notes = notes
        for note in notes:
            logger.warning("layer %d: %s", lp.layer_id, note)


def _refuse_jit(layer, layer_id, targets):
    """A target, or a cell around it (the layer included), whose construct is compiled by ms.jit."""
    for target in targets:
        for path in _self_and_ancestors(target.cell_path):
            cell = sub_cell(layer, path)
            if _jit_compiled(cell):
                raise ConfigError("model", f"{_name(path, cell, layer_id)} has a construct compiled by "
                                           f"ms.jit, and the config acts on it or inside it "
                                           f"({target.text}): AC patches the cell in PyNative, which a "
                                           f"jit graph bypasses (every forward would fail with 'Parse "
                                           f"Resolve convert failed'). Remove ms.jit from that cell, or leave "
                                           f"it out of recompute and swap (a jit cell inside a recomputed "
                                           f"module runs, but as one op)")


def _refuse_jit_prefetch(stack, layer_id, prefetch):
    """The layer whose backward start fetches a swap back can't be a jit graph (it is patched to do so)."""
    if prefetch is None or not stack.holds(prefetch) or not _jit_compiled(stack.cell(prefetch)):
        return
    cell = stack.cell(prefetch)
    raise ConfigError("model", f"{_name('', cell, prefetch)} has a construct compiled by ms.jit, and "
                               f"the swap of layer {layer_id} is prefetched when its backward "
                               f"starts (a patch on that layer, which a jit graph bypasses). Remove "
                               f"ms.jit from it, or change swap.default_prefetch")


def _refuse_wrapped(layer, layer_id, target):
    """A recompute region on a cell the user wrapped already (``checkpoint_wrapper``, ``swap_wrapper``)."""
    cell = sub_cell(layer, target.cell_path)
    for kind, undo in _CELL_WRAPPERS:
        if find_patch(cell, kind) is not None:
            raise ConfigError("model", f"{_name(target.cell_path, cell, layer_id)} is already wrapped by {kind}, "
                                       f"and the config recomputes it ({target.text}): apply_ac wraps the cells "
                                       f"it recomputes itself, and a cell takes one such wrapper. Undo "
                                       f"yours with mindformers_ac.{undo} (or remove_ac(model) if an "
                                       f"earlier apply_ac made it), or leave the cell out of the config")


def _refuse_native_recompute(layer, layer_id, target):
    """MindSpore's ``Cell.recompute()`` on a recompute region, inside it or around it."""
    root = target.cell_path
    for path, cell in layer.cells_and_names():   # '' is the layer itself
        if not uses_native_recompute(cell):
            continue
        if path == root:
            raise ConfigError("model", f"{_name(path, cell, layer_id)} already uses MindSpore's "
                                       f"Cell.recompute() and the config recomputes it too "
                                       f"({target.text}); the two recompute mechanisms can't be "
                                       f"combined on one cell: drop its cell.recompute() call (the "
                                       f"config's recompute is exact, dropout included) or leave it out "
                                       f"of the config")
        if _within(path, root) or _within(root, path):
            where = "inside" if _within(path, root) else "around"
            raise ConfigError("model", f"{_name(path, cell, layer_id)} uses MindSpore's Cell.recompute() "
                                       f"{where} a region the config recomputes ({target.text}); one "
                                       f"recompute can't run inside the other (backward fails with "
                                       f"'The pointer[top_cell_] is null'): drop its cell.recompute() "
                                       f"call (the config's recompute covers it) or recompute only "
                                       f"modules beside it")


def _jit_inside(layer, target):
    """Notes on the jit cells strictly inside a region target: they run as one op, and keep what they save."""
    what = "recomputed" if target.recomputes else "swapped"
    return [f"'{path}' ({type(cell).__name__}) runs under ms.jit: the engine sees it as one op, and what it "
            f"saves for backward stays in memory (not {what})"
            for path, cell in layer.cells_and_names()
            if path != target.cell_path and _within(path, target.cell_path) and _jit_compiled(cell)]


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
    """Refuse a target below the layer (a module, or the module holding an op or method) that is also
    part of another layer: patching it would act on that layer's calls too, which the plan says
    are untouched (or patch it twice). Whole-layer targets are ``check_shared_layers``'."""
    inner = {i: [t for t in _targets(lp) if t.path] for i, lp in plans.items()}
    if not any(inner.values()):
        return
    owner_of = {}   # id of a cell inside a layer -> ids of the layers holding it
    for i in stack.layer_ids:
        for _, cell in stack.cell(i).cells_and_names():
            owner_of.setdefault(id(cell), []).append(i)
    for i, targets in inner.items():
        layer = stack.cell(i)
        for target in targets:
            others = [j for j in owner_of[id(sub_cell(layer, target.cell_path))] if j != i]
            if others:
                what = f"module {target.path}" if target.path == target.cell_path else \
                    f"the module holding {target.path}"
                raise ConfigError("model", f"{what} of layer {i} is also part of layer "
                                           f"{', '.join(map(str, others))} (a shared module) and the config "
                                           f"acts on it ({target.text}); recompute and swap patch it in place, "
                                           f"so they would act on it in every layer that holds it: give each "
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
    return any(jit_compiled(fn) for fn in (cell.__dict__.get("construct"), getattr(type(cell), "construct", None)))


# The user's cell wrappers that apply_ac's own checkpoint_wrapper refuses on the same cell, and their undo.
_CELL_WRAPPERS = (("checkpoint_wrapper", "unwrap(cell)"), ("swap_wrapper", "remove_swap_wrapper(cell)"))


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
