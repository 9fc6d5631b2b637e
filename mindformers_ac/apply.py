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

A select target may be a cell (its construct becomes a region), an op (its
output is recomputed, ``wrap_op_output``) or a method of a cell: the method
is shadowed on that cell instance by a function that runs it as a region
(``checkpoint_wrapper`` of the bound method), so every call of
``self.method(...)`` recomputes its work; ``remove_ac`` deletes the instance
attribute again, and a deep copy of the cell drops it (the copy gets its
class's method back, and the copied model its own AC).

What was applied is reported once per call (``logs.report_summary``); the
per-layer detail is logged at debug level.
"""
import copy
import logging

import regex
from mindspore import nn

from .construct_patch import DROPPED, drop_on_copy, hold_copy_hook, release_copy_hook
from .errors import ConfigError
from .logs import report_summary
from .model_checks import refuse_copied_patches
from .plan import plan_with_layers
from .recompute import RecomputeStats, checkpoint_wrapper, exclude_policy, unwrap, wrap_op_output
from .recompute.chain import LayerChain
from .recompute.markers import resolve_context_fn
from .swap import SwapExecutor, install_layer_swap, install_op_swap
from .swap.backends import select_backend
from .whitelist import METHOD_WRAPPER_MARK, sub_cell

logger = logging.getLogger("mindformers_ac")

STATE_ATTR = "_mindformers_ac"


class AcState:
    """What ``apply_ac`` installed on one model: the plan, undo handles and the engines' counters."""

    def __init__(self, plan, layer_cells, layers_arg=None, mtp_block=None, context_fn=None):
        self.plan = plan
        self.layer_cells = layer_cells          # global id -> layer cell (MTP layers too)
        self.layers_arg = layers_arg            # apply_ac's ``layers=``, to plan a deep copy the same way
        self.mtp_block = mtp_block              # apply_ac's ``mtp_block=``, likewise
        self.context_fn = context_fn
        self.recompute_stats = {}               # global id -> RecomputeStats
        self.chains = {}                        # first layer id of a recompute group -> its LayerChain
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


def _install_checkpoint(state, cell, policy_fn, stats, chain=None):
    checkpoint_wrapper(cell, policy_fn=policy_fn, stats=stats, context_fn=state.context_fn, chain=chain)
    state.add_undo(lambda: unwrap(cell))


def _chain_of(state, lp):
    """``(LayerChain, member index)`` of a layer in a recompute group, one chain per group; None outside one."""
    if not lp.group:
        return None
    chain = state.chains.setdefault(lp.group[0], LayerChain(lp.group))
    return chain, lp.group.index(lp.layer_id)


def _install_op_output(state, layer, entry, stats):
    owner = sub_cell(layer, entry.owner_path)
    registry = entry.registry or None
    # TODO(lead): context_fn for output recompute
    handle = wrap_op_output(owner, entry.attr, stats=stats, registry=registry, scope=layer)
    state.add_undo(handle.remove)


def _install_method(state, layer, entry, policy_fn, stats):
    """Shadow method ``entry.attr`` of its owner cell, on the instance, by a region that runs it."""
    owner, name = sub_cell(layer, entry.owner_path), entry.attr
    if name in vars(owner):
        raise ValueError(f"{type(owner).__name__}.{name}: the instance already has an attribute of this name "
                         f"(wrapped twice?)")
    wrapped = checkpoint_wrapper(getattr(owner, name), policy_fn=policy_fn, stats=stats,
                                 context_fn=state.context_fn)
    setattr(wrapped, METHOD_WRAPPER_MARK, True)
    drop_on_copy(wrapped)   # a deep copy of the cell gets its class's method back (construct_patch._scrub)

    held = []

    def undo():
        if owner.__dict__.get(name) is wrapped:
            del owner.__dict__[name]
            unwrap(wrapped)
        if held:
            held.pop()
            release_copy_hook(owner)
    state.add_undo(undo)     # first: an interrupt in the next lines still finds its undo
    hold_copy_hook(owner)    # ... also when only the cell or its layer is copied
    held.append(True)
    object.__setattr__(owner, name, wrapped)   # an instance attribute, as MindFormers shadows a method


def _install_recompute(state, lp, layer):
    stats = state.recompute_stats.setdefault(lp.layer_id, RecomputeStats())
    if lp.full_recompute:
        _install_checkpoint(state, layer, _exclude_policy_for(lp), stats, _chain_of(state, lp))
        logger.debug("Set full recompute at layer %s%s%s", lp.label,
                     f", keeping {', '.join(lp.exclude)}" if lp.exclude else "",
                     f", in the group of layers {', '.join(map(str, lp.group))}" if lp.group else "")
    for path in lp.recompute:
        entry = lp.targets[path]
        if entry.is_op:
            _install_op_output(state, layer, entry, stats)
        elif entry.is_method:
            # the region is rooted at the method's cell: exclude paths are relative to it
            _install_method(state, layer, entry, _exclude_policy_for(lp, entry.owner_path), stats)
        else:
            _install_checkpoint(state, sub_cell(layer, path), _exclude_policy_for(lp, path), stats)
    if lp.recompute:
        logger.debug("Set select recompute at layer %s: %s", lp.label, ", ".join(lp.recompute))
    for path in lp.recompute_comm:
        _install_op_output(state, layer, lp.targets[path], stats)
    if lp.recompute_comm:
        logger.debug("Set comm recompute at layer %s: %s", lp.label, ", ".join(lp.recompute_comm))


def _install_swap(state, plan, model):
    swapped = [lp for lp in plan.layers.values() if lp.swapped]
    if not swapped:
        return
    sc = plan.config.swap
    state.swap_executor = SwapExecutor(select_backend(kind=sc.backend), max_pool_bytes=sc.max_host_bytes)
    p = sc.default_prefetch
    # MTP layers run in the MTP block's call, not the model's: the tensors that call receives (the
    # decoder's output, masks) stay on the device for them, as the model's inputs do for the decoder.
    # Parameters of both never leave the device.
    mtp = state.mtp_block if isinstance(state.mtp_block, nn.Cell) and state.mtp_block is not model else None
    params = None if mtp is None else list(model.get_parameters()) + list(mtp.get_parameters())

    def top(layer_id):
        return mtp if mtp is not None and layer_id >= plan.num_layers else model

    layer_ids = [lp.layer_id for lp in swapped if lp.layer_swap]
    by_id = [state.layer_cells.get(i) for i in range(plan.total_layers)]
    for ids in ([i for i in layer_ids if top(i) is model], [i for i in layer_ids if top(i) is not model]):
        if ids:
            inst = install_layer_swap(by_id, ids, prefetch=p, executor=state.swap_executor, model=top(ids[0]),
                                      min_bytes=sc.min_bytes, params=params)
            state.add_undo(inst.remove)
    for i in layer_ids:
        logger.debug("Set layer swap at layer %s, prefetched when layer %s starts backward",
                     plan.layer_label(i), plan.layer_label(i + p))
    for lp in swapped:
        if lp.op_swap:
            inst = install_op_swap(state.layer_cells[lp.layer_id], list(lp.op_swap), layer_id=lp.layer_id,
                                   prefetch_layer=state.layer_cells[lp.prefetch_layer],
                                   executor=state.swap_executor, model=top(lp.layer_id), min_bytes=sc.min_bytes,
                                   params=params)
            state.add_undo(inst.remove)
            logger.debug("Set op swap at layer %s: %s, prefetched when layer %s starts backward",
                         lp.label, ", ".join(lp.op_swap), plan.layer_label(lp.prefetch_layer))


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
        apply_ac(dup, config=state.plan.config, pp=state.plan.pp, mtp_block=mtp, layers=layers,
                 context_fn=state.context_fn if state.context_fn is not None else False)

    hook = hold_copy_hook(model)
    hook.after.append(apply_to_copy)

    def remove():
        hook.after.remove(apply_to_copy)
        release_copy_hook(model)
    state.add_undo(remove)


def apply_ac(model, recompute=None, recompute_comm=None, swap=None, pp=1, mtp_block=None, *, config=None,
             layers=None, context_fn=None):
    """Plan and install recompute / swap on ``model``; return the executed ``AcPlan``.

    Same arguments as ``plan_ac`` (MindFormers' signature
    ``apply_ac(model, recompute, recompute_comm, swap, pp, mtp_block=None)``,
    or ``config=``). ``mtp_block``: the multi-token-prediction block (a cell
    holding its layer list, e.g. ``model.mtp`` beside ``model.decoder``); its
    layer ``i`` is global layer ``num_layers + i`` in every section, in the
    plan and in the report. ``context_fn`` is passed to every recompute
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
    plan, stack = plan_with_layers(model, recompute, recompute_comm, swap, pp, mtp_block, config=config,
                                   layers=layers)
    state = AcState(plan, {i: stack.cell(i) for i in stack.layer_ids}, layers, mtp_block, context_fn)
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
    summary = "apply_ac: " + plan.summary()
    if bridged and context_fn is not None and any(lp.recomputed for lp in plan.layers.values()):
        summary += ("; MindFormers' recompute_context_fn is entered around every recompute region's forward and "
                    "re-run, so its is_in_recompute() and replay metadata see the recompute (context_fn=False "
                    "turns this off)")
    report_summary(summary)
    return plan


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
