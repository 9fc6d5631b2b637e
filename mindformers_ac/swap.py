"""Activation swap: keep saved activations in host memory between forward and backward.

Public API (names mirror HyperParallel and MindSpeed):

* ``install_layer_swap(layers, layer_ids, prefetch=1, ...)`` and
  ``install_op_swap(layer, sub_cell_paths, ...)``: what ``apply_ac`` installs;
  both return a ``SwapInstallation`` whose ``remove()`` restores the model.
* ``SwapManager()``: the process-wide manager behind ``swap``, ``swap_wrapper``,
  ``swap_tensor_wrapper`` and ``async_save_on_cpu``;
  ``set_forward_prefetch_layer(layer, prefetch_layer)`` makes ``layer``'s
  activations come back when ``prefetch_layer`` starts its backward.
* ``SwapExecutor`` (``offload(t) -> handle``, ``load(handle) -> Tensor``) for
  other engines, ``SwapReport`` for what happened.

Gradients are bitwise equal to training without swap: the host copy is an
exact byte copy and the loaded tensor replaces the saved one. Parameters,
inputs of the swapped layer (or of the model call, when ``model`` is given),
tensors under ``min_bytes`` and extra views of an offloaded tensor stay on the
device. A saved tensor modified in place after its offload raises RuntimeError
(checked when the layer's forward ends, and at load while it is still alive).
"""
import contextlib
import functools
import logging
import threading
import weakref

from mindspore import Parameter, nn

from mindformers_ac.swap_executor import LayerSwapStats, SwapExecutor, SwapHandle, SwapReport  # noqa: F401
from mindformers_ac.swap_scheduler import DEFAULT_MIN_BYTES, SwapScheduler, tensor_storage_ptrs
from mindformers_ac.whitelist import sub_cell

logger = logging.getLogger("mindformers_ac.swap")

__all__ = ["SwapManager", "SwapExecutor", "SwapReport", "SwapHandle", "SwapInstallation", "install_layer_swap",
           "install_op_swap", "swap", "swap_wrapper", "remove_swap_wrapper", "swap_tensor_wrapper",
           "async_save_on_cpu"]


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


def _make_scheduler(executor, report, min_bytes, params, max_pool_bytes):
    if executor is not None and report is not None and executor.report is not report:
        raise ValueError("pass the report to the executor instead: SwapExecutor(report=report)")
    owns = executor is None
    if owns:
        executor = SwapExecutor(max_pool_bytes=max_pool_bytes, report=report)
    sched = SwapScheduler(executor, min_bytes, params)
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

    def pre(cell, args, kwargs):
        del cell
        sched.extra_exclude = tensor_storage_ptrs(args, kwargs)

    def post(cell, args, output):
        del cell, args, output
        sched.extra_exclude = set()

    inst.add(model.register_forward_pre_hook(pre, with_kwargs=True))
    inst.add(model.register_forward_hook(post, always_call=True))


def _region_hooks(sched, key, mode="all", exclude_fn=None, begins_call=True):
    """Forward pre/post hooks that open and close a swap group for each call of a cell."""
    open_groups = []   # a stack: a cell may be re-entered (recursion, nested calls)

    def pre(cell, args, kwargs):
        del cell
        if begins_call:
            sched.begin_call(key)
        exclude = tensor_storage_ptrs(args, kwargs) if exclude_fn is None else exclude_fn()
        open_groups.append(sched.open_group(key, mode, exclude=exclude))

    def post(cell, args, output):
        del cell, args, output
        if open_groups:
            sched.close_group(open_groups.pop())

    return pre, post


def _prefetch_hook(sched, key, trigger):
    # Weak: MindSpore keeps a cell with a backward hook (and the hook) alive after the model is
    # deleted; a strong reference here would keep the scheduler and its worker thread alive too.
    sched_ref = weakref.ref(sched)

    def hook(cell, grad_output):
        del cell, grad_output
        live = sched_ref()
        if live is not None:
            live.prefetch(key, trigger=trigger)
        # None: the gradients pass through unchanged.
    return hook


def install_layer_swap(layers, layer_ids, prefetch=1, executor=None, report=None, model=None,
                       min_bytes=DEFAULT_MIN_BYTES, max_pool_bytes=None, params=None):
    """Swap whole layers: everything ``layers[i]`` saves for backward goes to host, ``i`` in ``layer_ids``.

    Args:
        layers: the model's layer list (global ids index it).
        layer_ids: global ids of the layers to swap.
        prefetch: p >= 1: when ``layers[i + p]`` starts its backward, layer i's tensors are
            loaded on the copy worker; p = 0: no prefetch, every tensor is loaded on demand.
            Every swapped id needs ``i + p < len(layers)`` (else ValueError, nothing installed).
        executor: a shared ``SwapExecutor`` (not closed by ``remove()``); default: a new one.
        report: a ``SwapReport`` for a new executor (with ``executor``, pass it there).
        model: the top-level model; its call's input tensors stay on the device.
        min_bytes: tensors smaller than this stay on the device.
        max_pool_bytes: host pool bound for a new executor.
        params: parameters never to offload (default: those of ``model``, else of ``layers``).
    Returns a ``SwapInstallation``; report keys are the global layer ids.
    """
    layer_ids = list(layer_ids)
    n = len(layers)
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (0 = load on demand), got {prefetch}")
    for i in layer_ids:
        if not 0 <= i < n:
            raise ValueError(f"layer id {i} out of range for {n} layers")
        if prefetch and i + prefetch >= n:
            raise ValueError(f"layer {i} with prefetch {prefetch} needs layer {i + prefetch} to trigger its "
                             f"prefetch, but there are {n} layers: lower the prefetch or do not swap layer {i}")
    if params is None:
        params = _params_of(model if model is not None else layers)
    sched = _make_scheduler(executor, report, min_bytes, params, max_pool_bytes)
    inst = SwapInstallation(sched)
    _track_inputs(sched, model, inst)
    for i in layer_ids:
        pre, post = _region_hooks(sched, i)
        inst.add(layers[i].register_forward_pre_hook(pre, with_kwargs=True))
        inst.add(layers[i].register_forward_hook(post, always_call=True))
        if prefetch:
            sched.mark_prefetchable(i)
            inst.add(layers[i + prefetch].register_backward_pre_hook(_prefetch_hook(sched, i, i + prefetch)))
    return inst


def install_op_swap(layer, sub_cell_paths, layer_id=None, prefetch_layer=None, executor=None, report=None,
                    model=None, min_bytes=DEFAULT_MIN_BYTES, max_pool_bytes=None, params=None):
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
    sched = _make_scheduler(executor, report, min_bytes, params, max_pool_bytes)
    inst = SwapInstallation(sched)
    _track_inputs(sched, model, inst)
    layer_inputs = []

    def layer_pre(cell, args, kwargs):
        del cell
        sched.begin_call(key)
        layer_inputs.append(tensor_storage_ptrs(args, kwargs))

    def layer_post(cell, args, output):
        del cell, args, output
        if layer_inputs:
            layer_inputs.pop()

    inst.add(layer.register_forward_pre_hook(layer_pre, with_kwargs=True))
    inst.add(layer.register_forward_hook(layer_post, always_call=True))
    for cell in cells:
        pre, post = _region_hooks(sched, key, exclude_fn=lambda: layer_inputs[-1] if layer_inputs else set(),
                                  begins_call=False)
        inst.add(cell.register_forward_pre_hook(pre, with_kwargs=True))
        inst.add(cell.register_forward_hook(post, always_call=True))
    if prefetch_layer is not None:
        sched.mark_prefetchable(key)
        trigger = getattr(prefetch_layer, "layer_number", type(prefetch_layer).__name__)
        inst.add(prefetch_layer.register_backward_pre_hook(_prefetch_hook(sched, key, trigger)))
    return inst


class SwapManager:
    """Process-wide swap state (HyperParallel's singleton): ``SwapManager() is SwapManager()``.

    Holds one scheduler (created on first use, with its executor and report)
    and the layer links made by ``set_forward_prefetch_layer``. ``reset()``
    removes every link, stops the worker and forgets everything.
    """

    _instance = None
    _lock = threading.Lock()

    def __new__(cls):
        with cls._lock:
            if cls._instance is None:
                inst = super().__new__(cls)
                inst._scheduler = None
                inst._links = {}          # id(layer) -> (key, [hook handles])
                inst._warned = False
                cls._instance = inst
        return cls._instance

    @property
    def scheduler(self):
        if self._scheduler is None:
            self._scheduler = SwapScheduler()
        return self._scheduler

    @property
    def report(self):
        return self.scheduler.report

    def key_of(self, cell):
        """Report/prefetch key of a linked layer, or None."""
        link = self._links.get(id(cell))
        return link[0] if link else None

    def set_forward_prefetch_layer(self, layer, prefetch_layer):
        """When ``prefetch_layer`` starts its backward, bring ``layer``'s swapped activations back.

        Links ``layer`` as a swap group: inside its forward, ``swap_tensor_wrapper`` marks
        tensors to offload, and ``swap``/``swap_wrapper`` regions inside it are prefetched
        with it. Linking a layer again replaces its previous link.
        """
        self.unlink(layer)
        sched = self.scheduler
        sched.add_params(layer.get_parameters())
        key = f"{type(layer).__name__}[{getattr(layer, 'layer_number', '?')}]@{id(layer):x}"
        pre, post = _region_hooks(sched, key, mode="marked")
        hooks = [layer.register_forward_pre_hook(pre, with_kwargs=True),
                 layer.register_forward_hook(post, always_call=True),
                 prefetch_layer.register_backward_pre_hook(_prefetch_hook(sched, key, self.key_of(prefetch_layer)
                                                                          or type(prefetch_layer).__name__))]
        sched.mark_prefetchable(key)
        self._links[id(layer)] = (key, hooks)
        return key

    def unlink(self, layer):
        key, hooks = self._links.pop(id(layer), (None, ()))
        for h in hooks:
            h.remove()
        return key

    def warn_once(self, msg):
        if not self._warned:
            self._warned = True
            logger.warning(msg)

    def reset(self):
        """Remove all links, stop the worker, drop the scheduler (pending handles still load on demand)."""
        for key in list(self._links):
            for h in self._links.pop(key)[1]:
                h.remove()
        if self._scheduler is not None:
            self._scheduler.close()
        self._scheduler = None
        self._warned = False


def _cell_of(fn):
    if isinstance(fn, nn.Cell):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Cell) else None


def _run_swapped(call, cell, name, args, kwargs, policy_fn):
    mgr = SwapManager()
    sched = mgr.scheduler
    if cell is not None:
        sched.add_params(cell.get_parameters())
    sched.add_params(a for a in args if isinstance(a, Parameter))
    outer = sched.current_group()
    key = (mgr.key_of(cell) if cell is not None else None) or (outer.key if outer is not None else f"swap:{name}")
    group = sched.open_group(key, "all", exclude=tensor_storage_ptrs(args, kwargs), policy_fn=policy_fn)
    try:
        return call()
    finally:
        sched.close_group(group)


def swap(fn, *args, policy_fn=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` with its saved activations offloaded to host (no recompute).

    ``policy_fn(tensor) -> CheckpointPolicy``: MUST_SWAP offloads (even below ``min_bytes``),
    anything else keeps it on the device; default: offload every tensor >= ``min_bytes``.
    The region joins the group of the linked layer it runs in (or of ``fn`` if ``fn`` is a
    linked Cell), so ``SwapManager().set_forward_prefetch_layer`` prefetches it; otherwise
    its tensors are loaded on demand in backward.
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    return _run_swapped(lambda: fn(*args, **kwargs), _cell_of(fn), name, args, kwargs, policy_fn)


def swap_wrapper(cell_or_fn, policy_fn=None):
    """Make every call of a Cell (or function) a ``swap`` region.

    For a Cell the instance's ``construct`` is patched and the same cell is
    returned (parameter names unchanged); ``remove_swap_wrapper(cell)`` undoes it.
    Wrapping an already wrapped cell raises ValueError.
    """
    if isinstance(cell_or_fn, nn.Cell):
        cell = cell_or_fn
        if "construct" in cell.__dict__:
            raise ValueError(f"{type(cell).__name__} already has an instance construct (wrapped before?); "
                             "call remove_swap_wrapper(cell) first")
        original = type(cell).construct

        @functools.wraps(original)
        def construct(*args, **kwargs):
            return _run_swapped(lambda: original(cell, *args, **kwargs), cell, type(cell).__name__,
                                args, kwargs, policy_fn)

        construct.mac_swap_wrapped = True
        cell.construct = construct
        return cell

    fn = cell_or_fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return swap(fn, *args, policy_fn=policy_fn, **kwargs)

    return wrapped


def remove_swap_wrapper(cell):
    """Undo ``swap_wrapper(cell)``; returns True if the cell was wrapped."""
    if getattr(cell.__dict__.get("construct"), "mac_swap_wrapped", False):
        del cell.construct
        return True
    return False


def swap_tensor_wrapper(tensor, tag=None):
    """Mark ``tensor`` (inside a construct) to be offloaded when an op saves it; returns it unchanged.

    Needs an open swap group: a layer linked with ``SwapManager().set_forward_prefetch_layer``
    or a ``swap``/``swap_wrapper``/``async_save_on_cpu`` region; outside one it logs a
    warning (once) and does nothing. Only saves made after the mark are offloaded.
    """
    mgr = SwapManager()
    group = mgr.scheduler.current_group()
    if group is None:
        mgr.warn_once("swap_tensor_wrapper called outside a swap group: tensor stays on the device. "
                      "Link its layer with SwapManager().set_forward_prefetch_layer(layer, prefetch_layer) "
                      "or wrap it with swap_wrapper.")
        return tensor
    group.mark(tensor, tag)
    return tensor


@contextlib.contextmanager
def async_save_on_cpu(h2d_stream=None, d2h_stream=None, block_idx=0, depth=1, custom_check_fn=None,
                      prefetch=True, params=None):
    """MindSpeed-style: offload the activations saved by one block's forward.

    ``with async_save_on_cpu(block_idx=i, depth=n, custom_check_fn=fn): out = block(x)``

    * ``custom_check_fn(tensor) -> bool``: True offloads; default: tensors >= ``min_bytes``.
    * ``depth``: number of blocks; the last block (``block_idx == depth - 1``) keeps its
      tensors on the device because its backward starts right after the forward.
    * ``prefetch``: when block i's backward first unpacks, block i-1 is loaded.
    * ``h2d_stream``/``d2h_stream``: ignored; the executor's backend owns its copy streams.
    * ``params``: parameters (or a Cell) never to offload; without them a weight that
      passes ``custom_check_fn`` is copied too (correct, but wasted bandwidth).
    """
    del h2d_stream, d2h_stream
    sched = SwapManager().scheduler
    if params is not None:
        sched.add_params(params.get_parameters() if isinstance(params, nn.Cell) else params)
    key, prev_key = ("async_save_on_cpu", block_idx), ("async_save_on_cpu", block_idx - 1)
    last = block_idx >= depth - 1
    if prefetch and not last:
        sched.mark_prefetchable(key)
    if last:
        check = lambda t: False  # noqa: E731
    else:
        check = custom_check_fn or (lambda t: t.nbytes >= sched.min_bytes)
    on_first = (lambda: sched.prefetch(prev_key, trigger=key)) if prefetch and block_idx > 0 else None
    sched.begin_call(key)
    group = sched.open_group(key, "check", check_fn=check, on_first_unpack=on_first)
    try:
        yield
    finally:
        sched.close_group(group)
