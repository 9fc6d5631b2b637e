"""``apply_ac``: execute an ``AcPlan`` on a model; ``remove_ac`` undoes it.

The flow is one way: config -> ``plan_ac`` (every check, nothing changed) ->
installers. Installation is all or nothing: if any installer fails, what was
already installed is removed again before the error propagates. What was
installed is kept on the model (``ac_state(model)``) so that a second
``apply_ac`` is refused and ``remove_ac`` can restore the original cells.

Per layer, one ``RecomputeStats`` collects every recompute region of that
layer; swap figures come from one ``SwapReport`` keyed by global layer id.
MTP layers (``mtp_block``) are layers like the others, with global ids
``num_layers + i``.

Each action of the plan installs itself (``actions``: one class per action,
installed in ``actions.ACTIONS`` order, each undo added as soon as what it
undoes exists); this module holds what they share: the state, the all or
nothing, the copy hook and the report.

What was applied is reported once per call (``logs.report_summary``); the
per-layer detail is logged at debug level.

With a ``memory_budget`` section the plan installed first is empty, and the
budget's controller (``budget.controller``) replaces it on the training steps
that follow (``AcState.replace_plan``): profiling plans, then the chosen one.
"""
import copy
import dataclasses
import logging

from .actions import ACTIONS
from .construct_patch import DROPPED, hold_copy_hook, release_copy_hook
from .errors import ConfigError
from .installed import STATE_ATTR, ac_state
from .logs import report_summary
from .model_checks import refuse_copied_patches
from .plan import LayerPlan, plan_with_layers
from .recompute import RecomputeStats
from .recompute.markers import resolve_context_fn

logger = logging.getLogger("mindformers_ac")

__all__ = ["AcState", "ac_state", "apply_ac", "install_actions", "plan_without_actions", "remove_ac"]


class AcState:
    """What ``apply_ac`` installed on one model: the plan, undo handles and the engines' counters."""

    def __init__(self, plan, layer_cells, layers_arg=None, mtp_block=None, context_fn=None, stage_args=None):
        self.plan = plan
        self.config = plan.config               # what apply_ac was given (a copy of the model gets it too)
        self.budget = None                      # budget.controller.BudgetController, with memory_budget
        self._plan_mark = 0                     # undos below this index are not the plan's (see replace_plan)
        self.layer_cells = layer_cells          # global id -> layer cell (MTP layers too)
        self.layers_arg = layers_arg            # apply_ac's ``layers=``, to plan a deep copy the same way
        self.stage_args = stage_args or {}      # apply_ac's ``layer_offset=`` / ``num_layers=``, likewise
        self.mtp_block = mtp_block              # apply_ac's ``mtp_block=``, likewise
        self.context_fn = context_fn
        self.recompute_stats = {}               # global id -> RecomputeStats
        self.chains = {}                        # first layer id of a recompute group -> its LayerChain
        self.swap_executor = None
        self.unmatched_keeps = None             # actions.region.UnmatchedNames of a list-form exclude_op
        self.swap_engine = None                 # actions.swap_section.SwapEngine, made by the first swap action
        self._undo = []                         # callables, run in reverse by remove()

    def add_undo(self, fn):
        self._undo.append(fn)

    def stats_for(self, layer_id):
        """The ``RecomputeStats`` every recompute region of layer ``layer_id`` shares."""
        return self.recompute_stats.setdefault(layer_id, RecomputeStats())

    def __deepcopy__(self, memo):   # the copy of the model gets its own state (see _install_copy_hook)
        return DROPPED

    def remove(self, keep=0):
        """Run every undo, newest first, whatever any of them raises; then raise the first error.

        ``keep``: the number of oldest undos to leave in place (``replace_plan``
        removes only the plan's own installs).

        An undo that raises an ``Exception`` is dropped (running it again would
        fail the same way). One interrupted by a KeyboardInterrupt or
        SystemExit is run once more at once (a Ctrl-C is a single event, and
        a half-restored model works neither with nor without AC); if that is
        interrupted too it stays in ``pending`` for a later ``remove``. The
        other undos run either way, and the first error is re-raised at the end.
        """
        first, failed = None, []
        while len(self._undo) > keep:
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
        self._undo += failed[::-1]
        if self.swap_executor is not None and not failed:
            executor, self.swap_executor, self.swap_engine = self.swap_executor, None, None
            try:
                executor.close()
            except BaseException as exc:  # pylint: disable=broad-exception-caught  # re-raised below
                first = first if first is not None else exc
        if first is not None:
            raise first

    def replace_plan(self, make_plan, model):
        """Remove what the current plan installed and install ``make_plan()`` in its place (the
        memory-budget controller's switch between profiling plans and the chosen one; planned once the
        old plan is gone, so its checks see the model's own cells). What was installed before the plan
        (the copy hook, the controller's own hooks) stays. All or nothing, as ``apply_ac``: if planning
        or installing fails, the model is left without a plan (the error propagates)."""
        self.remove(keep=self._plan_mark)
        self.recompute_stats, self.chains = {}, {}
        self.plan = plan_without_actions(self.plan)
        plan = make_plan()
        self.plan = plan
        try:
            install_actions(self, plan, model)
        except BaseException:
            self.remove(keep=self._plan_mark)
            self.plan = plan_without_actions(plan)
            raise

    def mark_plan_start(self):
        """What is installed from here on is the plan's (``replace_plan`` removes it)."""
        self._plan_mark = len(self._undo)

    @property
    def pending(self):
        """Undos an interrupted ``remove`` left to run (``remove_ac`` runs them when called again)."""
        return len(self._undo)

    @property
    def swap_report(self):
        return self.swap_executor.report if self.swap_executor is not None else None


def _install_copy_hook(state, model):
    """``copy.deepcopy(model)`` gives a copy with its own AC, planned and installed like this one.

    The copy is made without any of the original's patches (``CopyHook``), so
    its cells run their own code; the same config is then applied to it. A
    copy of a single layer or sub-cell is a plain cell without AC.

    The MTP block is mapped through the same ``memo``: its copy is the one
    the enclosing deep copy makes (``deepcopy(gpt)`` copying ``gpt.decoder``
    and ``gpt.mtp``), made now if the copy has not reached it yet, so the
    copied model's AC acts on the copied MTP layers in either order.
    """
    def apply_to_copy(_original, dup, memo):
        layers = state.layers_arg
        if layers is not None and not isinstance(layers, str):
            copies = [memo.get(id(cell)) for cell in layers]
            if any(c is None for c in copies):
                raise ConfigError("layers", "copy.deepcopy of a model whose apply_ac got layers= cells that are "
                                            "not part of the model: pass layers='path.to.layers' instead")
            layers = copies
        mtp = state.mtp_block
        if mtp is not None:
            mtp = copy.deepcopy(mtp, memo)   # memo: the same copy the rest of the deep copy uses
        # the resolved context_fn; none resolved means none for the copy too (None would mean the default)
        apply_ac(dup, config=state.config, pp=state.plan.pp, mtp_block=mtp, layers=layers,
                 context_fn=state.context_fn if state.context_fn is not None else False, **state.stage_args)

    hook = hold_copy_hook(model)
    hook.after.append(apply_to_copy)

    def remove():
        hook.after.remove(apply_to_copy)
        release_copy_hook(model)
    state.add_undo(remove)


def apply_ac(model, recompute=None, recompute_comm=None, swap=None, pp=1, mtp_block=None, *, config=None,
             layers=None, context_fn=None, layer_offset=None, num_layers=None):
    """Plan and install recompute / swap on ``model``; return the executed ``AcPlan``.

    Same arguments as ``plan_ac`` (MindFormers' signature
    ``apply_ac(model, recompute, recompute_comm, swap, pp, mtp_block=None)``,
    or ``config=``). ``mtp_block``: the multi-token-prediction block (a cell
    holding its layer list, e.g. ``model.mtp`` beside ``model.decoder``); its
    layer ``i`` is global layer ``num_layers + i`` in every section, in the
    plan and in the report. On a pipeline stage (``pp > 1``) config ids
    are global: the stage's first id is its layer list owner's
    ``layer_start`` (MindFormers' ``TransformerBlock``) or ``layer_offset``,
    one of which is required; ``num_layers`` is the whole model's decoder
    layer count where the model has no ``config.num_layers``. Ids of other
    stages are ignored (one warning names them), and swap bounds are the
    stage's own. ``context_fn`` is passed to every recompute
    region (``checkpoint_wrapper``): by default (None) MindFormers'
    ``recompute_context_fn`` when MindFormers' marker module is loaded or
    importable (``recompute.markers.default_context_fn``; said once in the
    log), so MindFormers' ``is_in_recompute()`` is true in the re-run;
    ``False`` for none. What was applied is reported once, where
    a user sees it (``logs.report_summary``: MindFormers' logger when
    MindFormers is loaded, else the ``mindformers_ac`` logger).
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
    bridged = context_fn is None
    context_fn = resolve_context_fn(context_fn)   # a bad one is a TypeError before anything is touched
    stage_args = {k: v for k, v in (("layer_offset", layer_offset), ("num_layers", num_layers)) if v is not None}
    plan, stack = plan_with_layers(model, recompute, recompute_comm, swap, pp, mtp_block, config=config,
                                   layers=layers, **stage_args)
    state = AcState(plan, {i: stack.cell(i) for i in stack.layer_ids}, layers, mtp_block, context_fn, stage_args)
    try:
        _install_copy_hook(state, model)
        if plan.config.memory_budget.enabled:
            from .budget.controller import install_budget
            install_budget(state, model, stack)
        state.mark_plan_start()
        install_actions(state, plan, model)
    except BaseException:
        try:
            state.remove()
        finally:
            if state.pending:   # interrupted twice while rolling back: let remove_ac finish the job
                object.__setattr__(model, STATE_ATTR, state)
        raise
    object.__setattr__(model, STATE_ATTR, state)
    summary = "apply_ac: " + plan.summary()
    if bridged and context_fn is not None and any(lp.recomputed for lp in plan.layers.values()):
        summary += ("; MindFormers' recompute_context_fn is entered around every recompute region's forward and "
                    "re-run, so its is_in_recompute() and replay metadata see the recompute (context_fn=False "
                    "turns this off)")
    report_summary(summary)
    return plan


def install_actions(state, plan, model):
    """Install every action of ``plan`` on ``model`` in ``actions.ACTIONS`` order, each undo into ``state``."""
    for action in ACTIONS:
        items = [(lp, a) for lp in plan.layers.values() for a in lp.actions if type(a) is action]
        if items:
            action.install_all(state, items, model)


def plan_without_actions(plan):
    """``plan`` with nothing installed: what a model whose plan failed to install runs."""
    return dataclasses.replace(plan, layers={i: LayerPlan(i, mtp_index=lp.mtp_index) for i, lp in plan.layers.items()})


def remove_ac(model):
    """Undo ``apply_ac``: restore every patched cell, op and method (MTP layers too) and stop the swap worker.

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
