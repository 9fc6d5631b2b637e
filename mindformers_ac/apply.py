"""``apply_ac``: execute an ``AcPlan`` on a model; ``remove_ac`` undoes it.

The flow is one way: config -> ``plan_ac`` (every check, nothing changed) ->
installers. Installation is all or nothing: if any installer fails, what was
already installed is removed again before the error propagates. What was
installed is kept on the model (``ac_state(model)``) so that a second
``apply_ac`` is refused and ``remove_ac`` can restore the original cells.

Per layer, one ``RecomputeStats`` collects every recompute region of that
layer; swap figures come from one ``SwapReport`` keyed by global layer id.
"""
import logging

import regex

from .errors import ConfigError
from .plan import plan_with_layers, refuse_copied_patches
from .recompute import RecomputeStats, checkpoint_wrapper, exclude_policy, unwrap, wrap_op_output
from .swap import SwapExecutor, install_layer_swap, install_op_swap
from .whitelist import sub_cell

logger = logging.getLogger("mindformers_ac")

STATE_ATTR = "_mindformers_ac"


class AcState:
    """What ``apply_ac`` installed on one model: the plan, undo handles and the engines' counters."""

    def __init__(self, plan, layer_cells):
        self.plan = plan
        self.layer_cells = layer_cells          # global id -> layer cell
        self.recompute_stats = {}               # global id -> RecomputeStats
        self.swap_executor = None
        self._undo = []                         # callables, run in reverse by remove()

    def add_undo(self, fn):
        self._undo.append(fn)

    def remove(self):
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:  # keep undoing the rest; report the first failure after
                errors.append(exc)
        if self.swap_executor is not None:
            self.swap_executor.close()
            self.swap_executor = None
        if errors:
            raise errors[0]

    @property
    def swap_report(self):
        return self.swap_executor.report if self.swap_executor is not None else None


def ac_state(model):
    """The ``AcState`` of a model ``apply_ac`` was applied to, else None."""
    return model.__dict__.get(STATE_ATTR)


def _exclude_policy_for(lp, region_path=""):
    """The policy_fn that keeps the plan's excluded ops inside a region rooted at ``region_path``."""
    if not lp.exclude:
        return None
    if not lp.exclude_by_path:
        return exclude_policy(names=lp.exclude)
    prefix = region_path + "." if region_path else ""
    patterns = [regex.escape(path[len(prefix):], special_only=True) + r"(\..*)?"
                for path in lp.exclude if path.startswith(prefix) and path != region_path]
    return exclude_policy(path_patterns=patterns) if patterns else None


def _install_checkpoint(state, cell, policy_fn, stats):
    checkpoint_wrapper(cell, policy_fn=policy_fn, stats=stats)
    state.add_undo(lambda: unwrap(cell))


def _install_op_output(state, layer, entry, stats):
    owner = sub_cell(layer, entry.owner_path)
    registry = entry.registry or None
    handle = wrap_op_output(owner, entry.attr, stats=stats, registry=registry, scope=layer)
    state.add_undo(handle.remove)


def _install_recompute(state, lp, layer):
    stats = state.recompute_stats.setdefault(lp.layer_id, RecomputeStats())
    if lp.full_recompute:
        _install_checkpoint(state, layer, _exclude_policy_for(lp), stats)
        logger.info("Set full recompute at layer %d%s", lp.layer_id,
                    f", keeping {', '.join(lp.exclude)}" if lp.exclude else "")
    for path in lp.recompute:
        if path in lp.op_paths:
            _install_op_output(state, layer, lp.targets[path], stats)
        else:
            _install_checkpoint(state, sub_cell(layer, path), _exclude_policy_for(lp, path), stats)
    if lp.recompute:
        logger.info("Set select recompute at layer %d: %s", lp.layer_id, ", ".join(lp.recompute))
    for path in lp.recompute_comm:
        _install_op_output(state, layer, lp.targets[path], stats)
    if lp.recompute_comm:
        logger.info("Set comm recompute at layer %d: %s", lp.layer_id, ", ".join(lp.recompute_comm))


def _install_swap(state, plan, model):
    swapped = [lp for lp in plan.layers.values() if lp.swapped]
    if not swapped:
        return
    state.swap_executor = SwapExecutor()
    p = plan.config.swap.default_prefetch
    layer_ids = [lp.layer_id for lp in swapped if lp.layer_swap]
    if layer_ids:
        by_id = [state.layer_cells.get(i) for i in range(plan.num_layers)]
        inst = install_layer_swap(by_id, layer_ids, prefetch=p, executor=state.swap_executor, model=model)
        state.add_undo(inst.remove)
        for i in layer_ids:
            logger.info("Set layer swap at layer %d, prefetched when layer %d starts backward", i, i + p)
    for lp in swapped:
        if lp.op_swap:
            inst = install_op_swap(state.layer_cells[lp.layer_id], list(lp.op_swap), layer_id=lp.layer_id,
                                   prefetch_layer=state.layer_cells[lp.prefetch_layer],
                                   executor=state.swap_executor, model=model)
            state.add_undo(inst.remove)
            logger.info("Set op swap at layer %d: %s, prefetched when layer %d starts backward",
                        lp.layer_id, ", ".join(lp.op_swap), lp.prefetch_layer)


def apply_ac(model, recompute=None, recompute_comm=None, swap=None, pp=1, *, config=None, layers=None):
    """Plan and install recompute / swap on ``model``; return the executed ``AcPlan``.

    Same arguments as ``plan_ac`` (MindFormers' signature, or ``config=``).
    Everything is validated before anything is installed, and a failure while
    installing removes what was installed, so the model is either fully set up
    or untouched. Parameters keep their names (cells are patched in place, not
    wrapped in new cells), so optimizers and checkpoints keep working.
    Applying twice to one model raises ``ConfigError``; call ``remove_ac``
    first to change the config.
    """
    refuse_copied_patches(model)
    if ac_state(model) is not None:
        raise ConfigError("model", "apply_ac was already applied to this model; call "
                                   "mindformers_ac.remove_ac(model) first to apply another config")
    plan, stack = plan_with_layers(model, recompute, recompute_comm, swap, pp, config=config, layers=layers)
    state = AcState(plan, {i: stack.cell(i) for i in stack.layer_ids})
    try:
        for lp in plan.layers.values():
            if lp.recomputed:
                _install_recompute(state, lp, state.layer_cells[lp.layer_id])
        _install_swap(state, plan, model)
    except Exception:
        state.remove()
        raise
    object.__setattr__(model, STATE_ATTR, state)
    if not plan.active_layers():
        logger.info("apply_ac: nothing to install (no layer is recomputed or swapped)")
    return plan


def remove_ac(model):
    """Undo ``apply_ac``: restore every patched cell and op and stop the swap worker.

    Refused (``ConfigError``, nothing changed) on a network rebuilt from the
    model after ``apply_ac`` (amp O1 rewrites it into new cells that carry
    copies of the patches): those copies can't be undone; apply mixed
    precision before ``apply_ac`` instead.
    """
    refuse_copied_patches(model)
    state = ac_state(model)
    if state is None:
        raise ConfigError("model", "apply_ac was not applied to this model; nothing to remove")
    object.__delattr__(model, STATE_ATTR)
    state.remove()
    logger.info("remove_ac: restored %d layers", len(state.plan.active_layers()))
