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

from .construct_patch import DROPPED, hold_copy_hook, release_copy_hook
from .errors import ConfigError
from .plan import plan_with_layers, refuse_copied_patches
from .recompute import RecomputeStats, checkpoint_wrapper, exclude_policy, unwrap, wrap_op_output
from .swap import SwapExecutor, install_layer_swap, install_op_swap
from .whitelist import sub_cell

logger = logging.getLogger("mindformers_ac")

STATE_ATTR = "_mindformers_ac"


class AcState:
    """What ``apply_ac`` installed on one model: the plan, undo handles and the engines' counters."""

    def __init__(self, plan, layer_cells, layers_arg=None):
        self.plan = plan
        self.layer_cells = layer_cells          # global id -> layer cell
        self.layers_arg = layers_arg            # apply_ac's ``layers=``, to plan a deep copy the same way
        self.recompute_stats = {}               # global id -> RecomputeStats
        self.swap_executor = None
        self._undo = []                         # callables, run in reverse by remove()

    def add_undo(self, fn):
        self._undo.append(fn)

    def __deepcopy__(self, memo):   # the copy of the model gets its own state (see _install_copy_hook)
        return DROPPED

    def remove(self):
        """Run every undo, newest first, whatever any of them raises; then raise the first error.

        An undo that raises an ``Exception`` is dropped (running it again would
        fail the same way). One interrupted by a KeyboardInterrupt or
        SystemExit is run once more at once (a Ctrl-C is a single event, and
        a half-restored model works neither with nor without AC); if that is
        interrupted too it stays in ``pending`` for a later ``remove``. The
        other undos run either way, and the first error is re-raised at the end.
        """
        first, failed = None, []
        while self._undo:
            undo = self._undo.pop()
            for attempt in (1, 2):
                try:
                    undo()
                    break
                except BaseException as exc:  # pylint: disable=broad-exception-caught  # re-raised below
                    first = first if first is not None else exc
                    if isinstance(exc, Exception):
                        break
                    if attempt == 2:
                        failed.append(undo)
        self._undo = failed[::-1]
        if self.swap_executor is not None and not failed:
            executor, self.swap_executor = self.swap_executor, None
            try:
                executor.close()
            except BaseException as exc:  # pylint: disable=broad-exception-caught  # re-raised below
                first = first if first is not None else exc
        if first is not None:
            raise first

    @property
    def pending(self):
        """Undos an interrupted ``remove`` left to run (``remove_ac`` runs them when called again)."""
        return len(self._undo)

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


def _install_copy_hook(state, model):
    """``copy.deepcopy(model)`` gives a copy with its own AC, planned and installed like this one.

    The copy is made without any of the original's patches (``CopyHook``), so
    its cells run their own code; the same config is then applied to it. A
    copy of a single layer or sub-cell is a plain cell without AC.
    """
    def apply_to_copy(_original, dup, memo):
        layers = state.layers_arg
        if layers is not None and not isinstance(layers, str):
            copies = [memo.get(id(cell)) for cell in layers]
            if any(c is None for c in copies):
                raise ConfigError("layers", "copy.deepcopy of a model whose apply_ac got layers= cells that are "
                                            "not part of the model: pass layers='path.to.layers' instead")
            layers = copies
        apply_ac(dup, config=state.plan.config, pp=state.plan.pp, layers=layers)

    hook = hold_copy_hook(model)
    hook.after.append(apply_to_copy)

    def remove():
        hook.after.remove(apply_to_copy)
        release_copy_hook(model)
    state.add_undo(remove)


def apply_ac(model, recompute=None, recompute_comm=None, swap=None, pp=1, *, config=None, layers=None):
    """Plan and install recompute / swap on ``model``; return the executed ``AcPlan``.

    Same arguments as ``plan_ac`` (MindFormers' signature, or ``config=``).
    Everything is validated before anything is installed, and a failure while
    installing removes what was installed, so the model is either fully set up
    or untouched. Parameters keep their names (cells are patched in place, not
    wrapped in new cells), so optimizers and checkpoints keep working.
    Applying twice to one model raises ``ConfigError``; call ``remove_ac``
    first to change the config. All or nothing holds for every
    ``BaseException``: a KeyboardInterrupt while installing leaves the model
    untouched, with no state attached.
    """
    refuse_copied_patches(model)
    if ac_state(model) is not None:
        raise ConfigError("model", "apply_ac was already applied to this model; call "
                                   "mindformers_ac.remove_ac(model) first to apply another config")
    plan, stack = plan_with_layers(model, recompute, recompute_comm, swap, pp, config=config, layers=layers)
    state = AcState(plan, {i: stack.cell(i) for i in stack.layer_ids}, layers)
    try:
        _install_copy_hook(state, model)
        for lp in plan.layers.values():
            if lp.recomputed:
                _install_recompute(state, lp, state.layer_cells[lp.layer_id])
        _install_swap(state, plan, model)
    except BaseException:
        try:
            state.remove()
        finally:
            if state.pending:   # interrupted twice while rolling back: let remove_ac finish the job
                object.__setattr__(model, STATE_ATTR, state)
        raise
    object.__setattr__(model, STATE_ATTR, state)
    if not plan.active_layers():
        logger.info("apply_ac: nothing to install (no layer is recomputed or swapped)")
    return plan


def remove_ac(model):
    """Undo ``apply_ac``: restore every patched cell and op and stop the swap worker.

    Every undo runs even if one of them raises or is interrupted (Ctrl-C
    included, see ``AcState.remove``); the first error is re-raised after the
    model is restored and its state detached, so ``apply_ac`` works again.
    In the rare case that an undo could not finish (interrupted twice), the
    state stays attached and calling ``remove_ac`` again completes it.

    Refused (``ConfigError``, nothing changed) on a network rebuilt from the
    model after ``apply_ac`` (amp O1 rewrites it into new cells that carry
    copies of the patches): those copies can't be undone; apply mixed
    precision before ``apply_ac`` instead.
    """
    refuse_copied_patches(model)
    state = ac_state(model)
    if state is None:
        raise ConfigError("model", "apply_ac was not applied to this model; nothing to remove")
    try:
        state.remove()
    finally:
        if not state.pending:
            model.__dict__.pop(STATE_ATTR, None)
    logger.info("remove_ac: restored %d layers", len(state.plan.active_layers()))
