"""Measure activation memory on CPU: bytes kept alive for backward.

MindSpore's allocator statistics (``mindspore.runtime.max_memory_allocated``)
read 0 on CPU and tracemalloc does not see tensor storage, so the figure used
throughout this package is *saved-tensor bytes*: every tensor that autograd
packs for backward is counted once per storage (``data_ptr``), parameters are
skipped, and the bytes are released when the last packed reference dies.

The innermost saved-tensor hook wins, so hooks installed inside the metered
region hide the meter. While its hooks are installed the meter therefore
wraps every other hook pushed on MindSpore's executor (a cell's
``register_saved_tensors_hooks``, ``ms.saved_tensors_hooks`` in a model's
``construct``, MindSpore's own recompute): their pack runs as before, and the
meter counts the tensors their packed object holds (itself, in a tuple, list
or dict, or in one of its attributes), on the device the tensor came from,
until that object dies. A packed object holding no tensor the meter can see
(a host copy, a handle into a store of its own) can't be counted: a warning,
once per hook, names the cell (or the code line) that installed it and says
the figure excludes what it keeps. The package's own engines report what
they keep themselves (see ``RecomputeStats``) and are not wrapped, except a
pack marked ``CHAIN_PASSED`` (the output-recompute scope): the tensors it
lets through as they are are counted here, with everything else the meter
sees. Packs made while a wrapped hook unpacks (MindSpore's recompute running
in backward) or while ``skip_chained()`` says so (the package's recompute)
belong to a throw-away graph and are not counted.
"""
import logging
import os
import types
import weakref

import mindspore as ms
from mindspore import Tensor, nn

from .logs import OnceLogger
from .mindspore_compat import chained_hook_pushes, registered_pack_hook
from .tensors import param_ptrs, storage_info, tensor_leaves_in_objects

logger = logging.getLogger("mindformers_ac.meter")

# A pack hook with this attribute set lets tensors through that the meter must count (see the docstring).
CHAIN_PASSED = "mac_meter_counts_passed"
# A pack of the package's own that an outer meter sees through like a model's hook: a meter's (the
# memory-budget controller measures inside ``train``'s meter, which must still count every step).
SEEN_THROUGH = "mac_meter_seen_through"

_PACKAGE = __name__.split(".")[0]
_MINDSPORE_DIR = os.path.dirname(ms.__file__)

NOT_SEEN = ("measure_step: the saved-tensor hooks of %s (and of any cell using the same hook functions) keep %s "
            "objects holding no tensor the meter can see (a host copy, or a handle into a store of their own): "
            "the figure excludes what they keep")


class _Packed:
    """What the meter returns from pack: holds the tensor; its death releases the bytes."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class _Chained:
    """What a wrapped hook's pack returns: the hook's own packed object; its death releases the bytes."""

    __slots__ = ("packed", "__weakref__")

    def __init__(self, packed):
        self.packed = packed


def _is_ours(fn):
    fn = getattr(fn, "func", fn)   # a functools.partial
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return module == _PACKAGE or module.startswith(_PACKAGE + ".")


def held_tensors(obj):
    """The tensors a packed object holds: itself, its items (nested tuples, lists, dicts), or the values of
    its attributes (``__dict__`` and ``__slots__``), one level down."""
    if isinstance(obj, Tensor):
        return [obj]
    found = tensor_leaves_in_objects(obj)
    if found or isinstance(obj, (tuple, list, dict)) or obj is None:
        return found
    values = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name != "__weakref__" and hasattr(obj, name):
                values.append(getattr(obj, name))
    return tensor_leaves_in_objects(tuple(values))


class _HookChain:
    """While installed, every saved-tensor hook pushed on the executor is wrapped so ``meter`` sees what it
    keeps (see the module docstring). ``cells``: ``{id(cell): path}`` to name a hook's cell."""

    def __init__(self, meter, cells):
        self.meter = meter
        self.cells = cells
        self.unpacking = 0   # wrapped unpacks running: a pack now is a backward-time re-run's
        self._saved = None

    def __enter__(self):
        self._saved = chained_hook_pushes(self.wrap)
        self._saved.__enter__()
        return self

    def __exit__(self, *exc):
        saved, self._saved = self._saved, None
        saved.__exit__(*exc)

    def wrap(self, pack, unpack):
        passed = getattr(pack, CHAIN_PASSED, False) is True
        if not passed and _is_ours(pack) and not getattr(pack, SEEN_THROUGH, False):
            return pack, unpack   # the engine reports what it keeps
        meter = self.meter
        # Once per hook function: every layer may register the same one, or make it anew (a closure).
        key = getattr(getattr(pack, "__func__", pack), "__code__", pack)

        def chained_pack(t):
            packed = pack(t)
            if self.unpacking or meter.skip_chained():
                return packed
            if passed:
                return meter.hold(_Chained(packed), [t]) if packed is t else packed
            device = getattr(t, "device", None)
            held = [x for x in held_tensors(packed) if getattr(x, "device", None) == device]
            if not held:
                meter.warnings.warning(("not_seen", key), NOT_SEEN, _Described(self, pack), type(packed).__name__)
            return meter.hold(_Chained(packed), held)

        def chained_unpack(obj):
            if isinstance(obj, _Chained):
                obj = obj.packed
            self.unpacking += 1
            try:
                return unpack(obj)
            finally:
                self.unpacking -= 1

        return chained_pack, chained_unpack

    def describe(self, pack):
        """Who pushed ``pack``, read from the hook and the model (no Python frame): the model's cell that
        registered it, holds it as an attribute (``ms.saved_tensors_hooks(self.pack, ...)`` in its
        construct) or is reached from the objects the hook's closure holds (MindSpore's recompute), and
        the file and line where the hook function is defined."""
        fn = getattr(pack, "__func__", pack)
        code = getattr(fn, "__code__", None)
        line = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code is not None else None
        for _, cell in self.cells.values():
            if registered_pack_hook(cell) is pack:
                return f"cell {self.name(cell)}"   # Cell.__call__ pushes what the cell registered
        cell = next((cell for _, cell in self.cells.values()
                     if any(value is pack or value is fn for value in vars(cell).values())), None)
        if cell is None:
            cell = self._reached_cell(pack)
            if cell is not None and code is not None and code.co_filename.startswith(_MINDSPORE_DIR):
                return f"cell {self.name(cell)} (in MindSpore's code, its hook defined at {line})"
        if cell is None:
            return f"the hook {getattr(fn, '__qualname__', repr(pack))} at {line}" if line else repr(pack)
        return f"cell {self.name(cell)} at {line}" if line else f"cell {self.name(cell)}"

    def _reached_cell(self, pack, limit=256):
        """The first of the model's cells reached from ``pack`` through closures, bound ``self``s, and the
        attributes, lists and dicts of what those hold (breadth first, at most ``limit`` objects)."""
        todo, seen = [pack], set()
        while todo and len(seen) < limit:
            obj = todo.pop(0)
            if id(obj) in seen or isinstance(obj, (Tensor, str, bytes, int, float, type, types.ModuleType)):
                continue
            seen.add(id(obj))
            if isinstance(obj, nn.Cell) and id(obj) in self.cells:
                return obj
            if isinstance(obj, (list, tuple, set)):
                todo.extend(obj)
            elif isinstance(obj, dict):
                todo.extend(obj.values())
            todo.extend(getattr(obj, attr) for attr in ("__self__", "__func__", "__wrapped__") if hasattr(obj, attr))
            todo.extend(c.cell_contents for c in getattr(obj, "__closure__", None) or () if _filled(c))
            todo.extend(getattr(obj, "__dict__", {}).values())
        return None

    def name(self, cell):
        path = self.cells.get(id(cell), (None,))[0]
        return f"'{path}' ({type(cell).__name__})" if path is not None else type(cell).__name__


class _Described:
    """``_HookChain.describe(pack)`` when a warning is formatted: the search runs once per warning, not per push."""

    __slots__ = ("chain", "pack")

    def __init__(self, chain, pack):
        self.chain, self.pack = chain, pack

    def __str__(self):
        return self.chain.describe(self.pack)


def _filled(closure_cell):
    try:
        closure_cell.cell_contents   # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


class SavedTensorMeter:
    """Count bytes kept alive for backward by autograd, deduplicated by storage.

    Use ``with meter.hooks(): loss, grads = grad_fn(...)`` or ``peak_saved_bytes``.
    ``current`` is the bytes held now, ``peak`` the maximum since
    construction; ``counts`` maps a storage base pointer to how many packed
    references hold it (views of one storage count once). Weights (by
    ``data_ptr`` in ``params``) are not counted. The meter is inert outside
    ``hooks()``. ``model``: the cells to name in a warning about a hook it
    can't see into; ``warnings``: a ``logs.OnceLogger`` to warn through (a
    meter made per step gets its owner's, so a warning is not repeated).
    """

    def __init__(self, params=(), model=None, warnings=None):
        self.param_ptrs = param_ptrs(params)
        self.counts = {}        # data_ptr -> number of live packed references
        self._nbytes = {}       # data_ptr -> storage bytes
        self.current = 0
        self.peak = 0
        self.model = model
        self.warnings = warnings if warnings is not None else OnceLogger(logger)

    def _release(self, ptr):
        n = self.counts.get(ptr, 0) - 1
        if n > 0:
            self.counts[ptr] = n
            return
        self.counts.pop(ptr, None)
        nbytes = self._nbytes.pop(ptr, 0)
        self.current -= nbytes
        self.storage_released(ptr, nbytes)

    def _release_all(self, ptrs):
        for ptr in ptrs:
            self._release(ptr)

    def storage_added(self, ptr, nbytes):
        """Called once per new storage after ``current``/``peak`` are updated (for subclasses)."""

    def storage_released(self, ptr, nbytes):
        """Called when the last packed reference to a storage dies (for subclasses)."""

    def skip_chained(self):
        """True while packs seen through other hooks belong to a throw-away graph (for subclasses)."""
        return False

    def _add(self, t):
        """Count one packed reference to ``t``'s storage; returns its pointer (None for a weight)."""
        if t.data_ptr() in self.param_ptrs:
            return None
        ptr, nb = storage_info(t)
        if ptr in self.counts:
            self.counts[ptr] += 1
        else:
            self.counts[ptr] = 1
            self._nbytes[ptr] = nb
            self.current += nb
            self.peak = max(self.peak, self.current)
            self.storage_added(ptr, nb)
        return ptr

    def hold(self, holder, tensors):
        """Count ``tensors`` until ``holder`` dies; returns ``holder``."""
        ptrs = [ptr for ptr in map(self._add, tensors) if ptr is not None]
        if ptrs:
            # The callback gets the pointers, not the holder, so it can't keep the holder alive.
            weakref.finalize(holder, self._release_all, ptrs).atexit = False
        return holder

    def pack(self, t):
        if t.data_ptr() in self.param_ptrs:
            return t
        return self.hold(_Packed(t), [t])

    def unpack(self, packed):
        return packed.tensor if isinstance(packed, _Packed) else packed

    setattr(pack, SEEN_THROUGH, True)

    def hooks(self):
        """Context manager installing the meter's pack/unpack, and seeing through hooks installed inside."""
        return _MeterHooks(self)

    def cell_paths(self):
        if self.model is None:
            return {}
        return {id(cell): (path, cell) for path, cell in self.model.cells_and_names()}


class _MeterHooks:
    """``SavedTensorMeter.hooks()``: the meter's own hooks, and the chain through hooks pushed inside."""

    def __init__(self, meter):
        self.meter = meter
        self._chain = self._hooks = None

    def __enter__(self):
        self._hooks = ms.saved_tensors_hooks(self.meter.pack, self.meter.unpack)
        self._hooks.__enter__()
        try:
            self._chain = _HookChain(self.meter, self.meter.cell_paths()).__enter__()
        except BaseException:
            self._hooks.__exit__(None, None, None)
            raise
        return self.meter

    def __exit__(self, *exc):
        try:
            self._chain.__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)


def peak_saved_bytes(fn, *args, params=(), weights=None, meter=None):
    """Run one forward+backward of ``fn(*args)`` under a fresh meter; return peak kept bytes.

    ``fn`` returns a scalar loss (or a tuple whose first item is the loss).
    ``params`` are excluded from the count; gradients are taken w.r.t.
    ``weights`` (default: ``params``). Pass ``meter`` to inspect counts after.
    The gradients are computed and discarded; no optimizer step is taken.
    """
    params = list(params)
    meter = meter if meter is not None else SavedTensorMeter(params)
    weights = params if weights is None else list(weights)
    grad_fn = ms.value_and_grad(fn, grad_position=None, weights=weights)
    with meter.hooks():
        out = grad_fn(*args)
    del out
    return meter.peak
