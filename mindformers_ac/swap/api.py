"""The swap API of HyperParallel and MindSpeed, on one process-wide ``SwapManager``.

* ``swap(fn, *args)`` / ``swap_wrapper(cell_or_fn)``: a call whose saved
  activations go to host memory;
* ``swap_tensor_wrapper(t)``: mark one tensor to offload inside a linked layer;
* ``SwapManager().set_forward_prefetch_layer(layer, prefetch_layer)``: bring
  ``layer``'s activations back when ``prefetch_layer`` starts its backward;
* ``async_save_on_cpu(...)``: MindSpeed's block-offload context manager.

Gradients are bitwise equal to training without swap (see ``install``).
"""
import contextlib
import functools
import logging
import numbers
import threading
import weakref

from mindspore import Parameter, Tensor, nn

from ..checkpoint_policy import check_policy_fn
from ..construct_patch import ConstructPatch, find_patch, mark_wrapped_function, refuse_wrapped_function
from ..errors import quote
from ..logs import OnceLogger
from ..tensors import root_cell_of, tensor_storage_ptrs
from .install import bracket_swap_group, prefetch_trigger
from .scheduler import SwapScheduler

__all__ = ["SwapManager", "swap", "swap_wrapper", "remove_swap_wrapper", "swap_tensor_wrapper", "async_save_on_cpu"]

_KIND = "swap_wrapper"
_SWAP_POLICY = "(tensor) -> CheckpointPolicy"


class _Link:
    """One ``set_forward_prefetch_layer`` link, held weakly: a dropped model is freed with its links.

    The patches live as long as their cells (each cell's construct holds its
    patch); the manager only needs to find them again to undo them.
    """

    __slots__ = ("key", "layer", "patches")

    def __init__(self, key, layer, patches, on_death):
        self.key = key
        self.layer = weakref.ref(layer, on_death)
        self.patches = [weakref.ref(p) for p in patches]

    def remove(self):
        for ref in self.patches:
            patch = ref()
            if patch is not None:
                patch.remove()


class SwapManager:
    """Process-wide swap state (HyperParallel's singleton): ``SwapManager() is SwapManager()``.

    Holds one scheduler (created on first use, with its executor and report)
    and the layer links made by ``set_forward_prefetch_layer``. Linked layers
    and their parameters are held weakly: a model dropped without ``reset()``
    or ``unlink`` is freed (its links go with it). ``reset()`` removes every
    link, stops the worker and forgets everything.
    """

    _instance = None
    _lock = threading.Lock()

    def __new__(cls):
        with cls._lock:
            if cls._instance is None:
                inst = super().__new__(cls)
                inst._scheduler = None
                inst._links = {}          # id(layer) -> _Link
                inst.warnings = OnceLogger(logging.getLogger("mindformers_ac.swap"))
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
        return link.key if link is not None and link.layer() is cell else None

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
        trigger = self.key_of(prefetch_layer) or type(prefetch_layer).__name__
        hooks = [bracket_swap_group(layer, sched, key, mode="marked"),
                 prefetch_trigger(prefetch_layer, sched, key, trigger)]
        sched.mark_prefetchable(key)
        lid, links = id(layer), self._links

        def forget(ref):   # the layer died: drop its entry (unless the id was linked again since)
            link = links.get(lid)
            if link is not None and link.layer is ref:
                del links[lid]
                sched.forget(key)
        self._links[lid] = _Link(key, layer, hooks, forget)
        return key

    def unlink(self, layer):
        link = self._links.get(id(layer))
        if link is None or link.layer() is not layer:
            return None
        del self._links[id(layer)]
        link.remove()
        if self._scheduler is not None:
            self._scheduler.forget(link.key)
        return link.key

    def reset(self):
        """Remove all links, stop the worker, drop the scheduler (pending handles still load on demand)."""
        for lid in list(self._links):
            link = self._links.pop(lid, None)
            if link is not None:
                link.remove()
        if self._scheduler is not None:
            self._scheduler.close()
        self._scheduler = None
        self.warnings.reset()



class ManagerSwapExecutor:
    """The swap executor ``checkpoint`` / ``checkpoint_wrapper`` use when given none: ``SwapManager``'s.

    HyperParallel's recipe (``checkpoint(..., policy_fn=..., swap_inputs=True)``
    with layers linked by ``SwapManager``) names no executor: a MUST_SWAP op's
    saved tensors and output, and swapped region inputs, go to the process-wide
    scheduler's executor, counted in ``SwapManager().report`` under the key of
    the linked layer the region runs in (``"checkpoint"`` outside one).
    ``offload(tensor) -> handle`` copies synchronously; ``load(handle)`` loads
    on demand (the region's recompute asks for them: no prefetch). Stateless:
    a handle carries the executor that made it, so a ``SwapManager().reset()``
    between forward and backward still loads it.
    """

    __slots__ = ()

    @staticmethod
    def offload(tensor):
        sched = SwapManager().scheduler
        group = sched.current_group()
        executor = sched.executor
        return executor, executor.offload(tensor, group.key if group is not None else "checkpoint")

    @staticmethod
    def load(handle):
        executor, h = handle
        return executor.load(h)


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
        out = call()
    except BaseException:
        sched.close_group(group, failed=True)
        raise
    sched.close_group(group, outputs=out)
    return out


def swap(fn, *args, policy_fn=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` with its saved activations offloaded to host (no recompute).

    ``policy_fn(tensor) -> CheckpointPolicy``: MUST_SWAP offloads (even below ``min_bytes``),
    anything else keeps it on the device; default: offload every tensor >= ``min_bytes``.
    The region joins the group of the linked layer it runs in (or of ``fn`` if ``fn`` is a
    linked Cell), so ``SwapManager().set_forward_prefetch_layer`` prefetches it; otherwise
    its tensors are loaded on demand in backward.
    """
    check_policy_fn("swap", policy_fn, _SWAP_POLICY)
    name = getattr(fn, "__name__", type(fn).__name__)
    return _run_swapped(lambda: fn(*args, **kwargs), root_cell_of(fn), name, args, kwargs, policy_fn)


def swap_wrapper(cell_or_fn, policy_fn=None):
    """Make every call of a Cell (or function) a ``swap`` region.

    For a Cell the instance's ``construct`` is wrapped and the same cell is
    returned (parameter names unchanged); ``remove_swap_wrapper(cell)`` undoes
    it. Wrapping a cell twice raises ValueError, and so does a cell that
    ``checkpoint_wrapper`` wraps (in either order: recompute or swap a cell,
    not both).
    """
    check_policy_fn("swap_wrapper", policy_fn, _SWAP_POLICY)
    if isinstance(cell_or_fn, nn.Cell):
        cell = cell_or_fn
        name = type(cell).__name__

        def around(inner, *args, **kwargs):
            return _run_swapped(lambda: inner(*args, **kwargs), cell, name, args, kwargs, policy_fn)

        ConstructPatch(cell, _KIND, around, undo="remove_swap_wrapper(cell)")
        return cell

    fn = cell_or_fn
    refuse_wrapped_function(fn, _KIND)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return swap(fn, *args, policy_fn=policy_fn, **kwargs)

    mark_wrapped_function(wrapped, _KIND, fn)
    return wrapped


def remove_swap_wrapper(cell):
    """Undo ``swap_wrapper(cell)``; returns True if the cell was wrapped."""
    patch = find_patch(cell, _KIND)
    if patch is None:
        return False
    patch.remove()
    return True


def swap_tensor_wrapper(tensor, tag=None):
    """Mark ``tensor`` (inside a construct) to be offloaded when an op saves it; returns it unchanged.

    Needs an open swap group: a layer linked with ``SwapManager().set_forward_prefetch_layer``
    or a ``swap``/``swap_wrapper``/``async_save_on_cpu`` region; outside one it logs a
    warning (once) and does nothing. Only saves made after the mark are offloaded.
    Anything that is not a Tensor (``None``, a tuple, a number) is returned as it is,
    inside a group or outside: HyperParallel registers only the tensors that qualify, so
    ``x = swap_tensor_wrapper(x)`` may sit on an optional output.
    """
    if not isinstance(tensor, Tensor):
        return tensor
    mgr = SwapManager()
    group = mgr.scheduler.current_group()
    if group is None:
        mgr.warnings.warning(
            "swap_tensor_wrapper", "swap_tensor_wrapper called outside a swap group: tensor stays on the device. "
            "Link its layer with SwapManager().set_forward_prefetch_layer(layer, prefetch_layer) "
            "or wrap it with swap_wrapper.")
        return tensor
    group.mark(tensor, tag)
    return tensor


def _check_blocks(block_idx, depth, custom_check_fn):
    for name, value in (("depth", depth), ("block_idx", block_idx)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"async_save_on_cpu: {name} must be an int, got {type(value).__name__} {quote(value)}")
    if depth < 1:
        raise ValueError(f"async_save_on_cpu: depth (the number of blocks) must be >= 1, got {depth}")
    if not 0 <= block_idx < depth:
        raise ValueError(f"async_save_on_cpu: block_idx must be in [0, depth - 1] = [0, {depth - 1}], "
                         f"got {block_idx}")
    if custom_check_fn is not None and not callable(custom_check_fn):
        raise TypeError(f"async_save_on_cpu: custom_check_fn must be a callable (tensor -> bool) or None, "
                        f"got {type(custom_check_fn).__name__}")


def async_save_on_cpu(h2d_stream=None, d2h_stream=None, block_idx=0, depth=1, custom_check_fn=None,
                      prefetch=True, params=None):
    """MindSpeed-style: offload the activations saved by one block's forward.

    ``with async_save_on_cpu(block_idx=i, depth=n, custom_check_fn=fn): out = block(x)``

    * ``custom_check_fn(tensor) -> bool``: True offloads, whatever its size (as PyTorch's ``save_on_cpu``
      moves every saved tensor); default: tensors >= ``min_bytes``.
    * ``depth``: number of blocks (an int >= 1); ``block_idx`` an int in ``[0, depth - 1]``,
      checked when called (TypeError / ValueError naming the argument). The last block
      (``block_idx == depth - 1``) keeps its tensors on the device because its backward
      starts right after the forward.
    * ``prefetch``: when block i's backward first unpacks, block i-1 is loaded.
    * ``h2d_stream``/``d2h_stream``: ignored; the executor's backend owns its copy streams.
    * ``params``: parameters (or a Cell) never to offload; without them a weight that
      passes ``custom_check_fn`` is copied too (correct, but wasted bandwidth).
    """
    del h2d_stream, d2h_stream
    _check_blocks(block_idx, depth, custom_check_fn)
    return _async_save_on_cpu(int(block_idx), int(depth), custom_check_fn, prefetch, params)


@contextlib.contextmanager
def _async_save_on_cpu(block_idx, depth, custom_check_fn, prefetch, params):
    sched = SwapManager().scheduler
    if params is not None:
        sched.add_params(params.get_parameters() if isinstance(params, nn.Cell) else params)
    key, prev_key = ("async_save_on_cpu", block_idx), ("async_save_on_cpu", block_idx - 1)
    last = block_idx == depth - 1
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
    except BaseException:
        sched.close_group(group, failed=True)
        raise
    sched.close_group(group, defer=True)
