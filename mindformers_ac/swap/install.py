"""Install swap on a model's layers or sub-cells: what ``apply_ac`` calls.

``install_layer_swap(layers, layer_ids, prefetch=1, ...)`` swaps whole layers;
``install_op_swap(layer, sub_cell_paths, ...)`` only what chosen sub-cells of
one layer save. Both return a ``SwapInstallation`` whose ``remove()`` restores
the model. Each call of a swapped cell is one swap group of the scheduler;
when the backward of the layer ``prefetch`` places later starts (a hook on the
gradient of its output), the group starts coming back.

Gradients are bitwise equal to training without swap: the host copy is an
exact byte copy and the loaded tensor replaces the saved one. Parameters,
inputs of the swapped layer (or of the model call, when ``model`` is given),
tensors under ``min_bytes`` and extra views of an offloaded tensor stay on the
device. A saved tensor written after its offload is read as MindSpore reads it
without AC: from its live storage, or refused on a new version (rule W6s of
docs/exactness.md, ``executor.SavedStorage``).
"""
import logging
import weakref

from mindspore import nn

from ..config import SwapConfig
from ..construct_patch import ConstructPatch, bracket_calls
from ..layer_specs import prefetch_trigger_id, swappable_layers
from ..mindspore_compat import pynative_executor as _executor
from ..tensors import is_tracked, tensor_leaves, tensor_storage_ptrs
from ..whitelist import sub_cell
from .executor import SwapExecutor
from .scheduler import SwapScheduler, with_min_bytes

logger = logging.getLogger("mindformers_ac.swap")


class SwapInstallation:
    """Hooks installed on a model by ``install_layer_swap``/``install_op_swap``.

    ``remove()`` takes every hook off (the model is exactly as before) and, if
    the installer created its executor, stops its worker thread. Idempotent.
    ``report``/``executor``/``scheduler`` expose the engine state.
    """

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.executor = scheduler.executor
        self.report = scheduler.report
        self._hooks = []

    def add(self, hook_handle):
        self._hooks.append(hook_handle)

    def remove(self):
        while self._hooks:
            self._hooks.pop().remove()
        self.scheduler.close()


def _section(settings, min_bytes):
    """The swap section an installer's scheduler holds: ``settings`` (default ``SwapConfig()``), with the
    caller's own ``min_bytes`` when it gave one."""
    return with_min_bytes(settings if settings is not None else SwapConfig(), min_bytes)


def _make_scheduler(executor, report, params, max_pool_bytes, settings):
    if executor is not None and report is not None and executor.report is not report:
        raise ValueError("pass the report to the executor instead: SwapExecutor(report=report)")
    owns = executor is None
    if owns:
        executor = SwapExecutor(max_pool_bytes=max_pool_bytes, report=report)
    sched = SwapScheduler(executor, params=params, settings=settings)
    sched.owns_executor = owns
    return sched


def _params_of(*sources):
    params = []
    for src in sources:
        if isinstance(src, nn.Cell):
            params.extend(src.get_parameters())
        else:
            for cell in src:
                params.extend(cell.get_parameters())
    return params


def _track_inputs(sched, model, inst):
    """Keep the storages of the model call's inputs (masks, rotary tables) on the device."""
    if model is None:
        return

    def enter(args, kwargs):
        previous, sched.extra_exclude = sched.extra_exclude, tensor_storage_ptrs(args, kwargs)
        return previous

    def leave(previous, _failed):
        sched.extra_exclude = previous   # a nested model call (e.g. a teacher inside) restores the outer one

    # Several installations (layer swap, op swap of each layer) may track the same model.
    inst.add(bracket_calls(model, "swap_model_inputs", enter, leave, unique=False))


def bracket_swap_group(cell, sched, key, mode="all", exclude_fn=None, begins_call=True):
    """Open a swap group of ``key`` around every call of ``cell`` and close it however the call ends.

    The group excludes the call's own input tensors (or ``exclude_fn()``);
    ``begins_call`` starts a new call of ``key`` (so older calls are not
    prefetched with it). A call that raises closes its group (and any opened
    inside it) without queueing it for prefetch. The call's output goes to
    ``close_group`` (what it saved of its own output stays on the device: rule
    W6s of docs/exactness.md). Returns the ``ConstructPatch``.
    """
    def enter(args, kwargs):
        if begins_call:
            sched.begin_call(key)
        exclude = tensor_storage_ptrs(args, kwargs) if exclude_fn is None else exclude_fn()
        return sched.open_group(key, mode, exclude=exclude)

    return bracket_calls(cell, "swap_group", enter, sched.close_group, unique=False, pass_output=True)


def prefetch_trigger(cell, sched, key, trigger):
    """Start loading ``key``'s latest call back when ``cell``'s backward is about to start.

    Each forward call of ``cell`` registers a hook on the gradient of its
    tracked outputs, wherever they sit in the output (a tensor, tuples,
    lists, dicts, nested); the first gradient to arrive is the start of the
    cell's backward. An output with no tracked tensor to hook (or one held by
    another kind of object) can't trigger the prefetch: that is logged once
    per trigger, and those tensors load on demand. A backward pre-hook on the cell would fire at the same point,
    but MindSpore wraps every call of a cell with backward hooks, which cost
    about 5% of a dispatch-bound step for a stack of layers; a tensor hook
    costs nothing measurable. Returns the ``ConstructPatch``.
    """
    # Weak: the hooks live in the autograd graph, which may outlive the model; a strong reference
    # would keep the scheduler and its worker thread alive with it.
    sched_ref = weakref.ref(sched)
    warned = []   # this trigger's one warning

    def fire(_grad):
        live = sched_ref()
        if live is not None:
            live.prefetch(key, trigger=trigger)   # a no-op once the call's groups are loading
        # None: the gradient passes through unchanged.

    def around(inner, *args, **kwargs):
        out = inner(*args, **kwargs)
        hooked = False
        for t in tensor_leaves(out):
            if is_tracked(t):
                t.register_hook(fire)
                hooked = True
        if not hooked and not warned and _executor.requires_grad():   # no graph: nothing to prefetch
            warned.append(True)
            logger.warning("swap prefetch of %r can't be triggered by %s (%r): its output (%s) holds no tensor "
                           "that autograd tracks in a tuple, list or dict, so the prefetch never starts and "
                           "those tensors load on demand in backward. Return the hidden states as a tensor or "
                           "in a tuple, list or dict.", key, type(cell).__name__, trigger, type(out).__name__)
        return out

    return ConstructPatch(cell, "swap_prefetch_trigger", around, unique=False, outer=True)


def install_layer_swap(layers, layer_ids, prefetch=None, executor=None, report=None, model=None,
                       min_bytes=None, max_pool_bytes=None, params=None, triggers=None, settings=None):
    """Swap whole layers: everything ``layers[i]`` saves for backward goes to host, ``i`` in ``layer_ids``.

    Args:
        layers: the model's layer list (global ids index it).
        layer_ids: global ids of the layers to swap.
        prefetch: p >= 1 (default: the section's ``default_prefetch``): when ``layers[i + p]`` starts its
            backward, layer i's tensors are
            loaded back (by the backend: inline on CPU, on the H2D stream on a device); p = 0: no prefetch, every tensor is loaded on demand.
            Every swapped id needs ``i + p < len(layers)`` (else ValueError, nothing installed).
        executor: a shared ``SwapExecutor`` (not closed by ``remove()``); default: a new one.
        report: a ``SwapReport`` for a new executor (with ``executor``, pass it there).
        model: the top-level model; its call's input tensors stay on the device.
        min_bytes: tensors smaller than this stay on the device (default: the section's ``min_bytes``).
        max_pool_bytes: host pool bound for a new executor.
        params: parameters never to offload (default: those of ``model``, else of ``layers``).
        triggers: ``{layer id: trigger id}`` for swapped layers fetched back by another layer than
            ``i + prefetch`` (a pipeline stage's last layers: an earlier layer of the stage, whose backward
            of the next microbatch comes ``prefetch`` layers before theirs).
        settings: the ``SwapConfig`` the scheduler reads its settings from (``apply_ac``'s ``swap`` section;
            default: ``SwapConfig()``'s).
    Returns a ``SwapInstallation``; report keys are the global layer ids.
    """
    settings = _section(settings, min_bytes)
    prefetch = settings.default_prefetch if prefetch is None else prefetch
    triggers = dict(triggers or {})
    layer_ids = list(layer_ids)
    n = len(layers)
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (0 = load on demand), got {prefetch}")
    for i in layer_ids:
        if not 0 <= i < n:
            raise ValueError(f"layer id {i} out of range for {n} layers")
        if i not in triggers and i not in swappable_layers(n, prefetch):
            raise ValueError(f"layer {i} with prefetch {prefetch} needs layer {prefetch_trigger_id(i, prefetch)} to "
                             f"trigger its "
                             f"prefetch, but there are {n} layers: lower the prefetch or do not swap layer {i}")
    if params is None:
        params = _params_of(model if model is not None else layers)
    sched = _make_scheduler(executor, report, params, max_pool_bytes, settings)
    inst = SwapInstallation(sched)
    _track_inputs(sched, model, inst)
    for i in layer_ids:
        inst.add(bracket_swap_group(layers[i], sched, i))
        if prefetch:
            sched.mark_prefetchable(i)
            by = triggers.get(i, prefetch_trigger_id(i, prefetch))
            inst.add(prefetch_trigger(layers[by], sched, i, by))
    return inst


def install_op_swap(layer, sub_cell_paths, layer_id=None, prefetch_layer=None, executor=None, report=None,
                    model=None, min_bytes=None, max_pool_bytes=None, params=None, settings=None):
    """Swap only what the given sub-cells of ``layer`` save (e.g. ``["mlp", "self_attention.core_attention"]``).

    The layer's own inputs (and the model call's, with ``model``) stay on the device.
    ``prefetch_layer``: a Cell whose backward start triggers the load of this layer's
    tensors (typically ``layers[layer_id + p]``); None: loads on demand.
    ``layer_id`` is the report key (default: the layer's class name and id).
    Other arguments as ``install_layer_swap``. Returns a ``SwapInstallation``.
    """
    if isinstance(sub_cell_paths, str):
        sub_cell_paths = [sub_cell_paths]
    cells = [sub_cell(layer, p) for p in sub_cell_paths]   # raise before installing anything
    key = layer_id if layer_id is not None else f"{type(layer).__name__}@{id(layer):x}"
    if params is None:
        params = _params_of(model if model is not None else layer)
    sched = _make_scheduler(executor, report, params, max_pool_bytes, _section(settings, min_bytes))
    inst = SwapInstallation(sched)
    _track_inputs(sched, model, inst)
    layer_inputs = []   # a stack: the layer may be re-entered

    def enter_layer(args, kwargs):
        sched.begin_call(key)
        layer_inputs.append(tensor_storage_ptrs(args, kwargs))

    def leave_layer(_state, _failed):
        layer_inputs.pop()

    inst.add(bracket_calls(layer, "swap_layer_inputs", enter_layer, leave_layer, unique=False))
    for cell in cells:
        inst.add(bracket_swap_group(cell, sched, key, exclude_fn=lambda: layer_inputs[-1] if layer_inputs else set(),
                                    begins_call=False))
    if prefetch_layer is not None:
        sched.mark_prefetchable(key)
        trigger = getattr(prefetch_layer, "layer_number", type(prefetch_layer).__name__)
        inst.add(prefetch_trigger(prefetch_layer, sched, key, trigger))
    return inst

