"""Facts about tensors and cells that every engine asks: storage, outputs, weights, the cell of a call.

MindSpore hands saved-tensor hooks plain tensors: a weight arrives as a
non-Parameter tensor sharing the parameter's ``data_ptr``, and views of one
activation share a storage. Engines therefore key what they keep by storage
base pointer and recognise weights by pointer; these helpers are the one
place that knows how.
"""
import dataclasses
import types
import weakref

from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype

from .mindspore_compat import no_grad, tensor_tracked, view_op

MiB = 2 ** 20


def storage_info(t):
    """(base pointer, bytes) of the storage behind ``t``: views of one storage share the key."""
    try:
        storage = t.untyped_storage()
        return int(storage.data_ptr()), int(storage.nbytes())
    except (AttributeError, RuntimeError, TypeError):   # some tensor kinds have no untyped_storage on CPU
        return int(t.data_ptr()), int(t.nbytes)


def storage_ptr(t):
    """Base pointer of the storage behind ``t``."""
    return storage_info(t)[0]


def storage_nbytes(t):
    """Bytes of the storage behind ``t``."""
    return storage_info(t)[1]


def output_tensors(out):
    """The items of an op's or cell's output as a tuple (a single output becomes a 1-tuple)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def tensors_equal(a, b):
    """Bitwise equality of two op outputs (tensors, or tuples of them): same shapes, dtypes and bytes, so a
    NaN equals the same NaN."""
    a, b = output_tensors(a), output_tensors(b)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
            if x is not y and x != y:
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype or tensor_bytes(x) != tensor_bytes(y):
            return False
    return True


def tensor_bytes(t):
    """The bytes of ``t``'s values, row-major (bfloat16 widened to float32 exactly, so equal bits compare alike)."""
    if t.dtype == mstype.bfloat16:   # numpy has no bfloat16; the widening cast is exact, so bits compare alike
        with no_grad():
            t = ops.cast(t, mstype.float32)
    return t.asnumpy().tobytes()


def tensor_leaves(value, depth=8):
    """The tensors in ``value``: a tensor, or tuples (namedtuples too), lists and dicts of them, nested.

    Other objects are not searched (issue 49: no walk of a dataclass's fields or an object's ``__dict__``):
    swap finds a saved tensor that the code after its layer holds, in any object, by the tensor's own stamp
    (``swap/executor.py``, ``SavedStorage``; rule W6s of docs/exactness.md). ``depth`` bounds the nesting
    searched, so a self-referencing list ends.
    """
    return _leaves(value, _container_items, depth)


def tensor_leaves_in_objects(value, depth=8):
    """``tensor_leaves`` that also searches dataclasses and other objects by their instance ``__dict__`` (a
    Hugging Face-style ``LayerOutput(hidden=h)``; an object with slots only is not). A Cell, a class, a
    module or a function is not searched (they hold weights and code, not a call's values).

    Used by the recompute engine (its saved outputs, rule W6; the safety net's sample; Parameters handed in an
    argument object), the meter and the budget's controller (a layer's outputs, wherever they are held).
    """
    return _leaves(value, _held_values, depth)


def _leaves(value, held, depth):
    """The tensors in ``value`` and, ``depth`` levels down, in what ``held(value)`` yields."""
    if isinstance(value, Tensor):
        return [value]
    if depth <= 0:
        return []
    found = []
    for item in held(value):
        found.extend(_leaves(item, held, depth - 1))
    return found


def _container_items(value):
    """What ``tensor_leaves`` searches in ``value``: a tuple's or list's items, a dict's values."""
    if isinstance(value, dict):
        return value.values()
    return value if isinstance(value, (tuple, list)) else ()


_NOT_SEARCHED = (str, bytes, int, float, bool, type(None), nn.Cell, type, types.ModuleType, types.FunctionType,
                 types.MethodType, types.BuiltinFunctionType)


def _held_values(value):
    """What ``tensor_leaves_in_objects`` searches in ``value``: a container's items, an object's attributes."""
    if isinstance(value, (dict, tuple, list)):
        return _container_items(value)
    if isinstance(value, _NOT_SEARCHED):
        return ()
    if dataclasses.is_dataclass(value):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    attrs = getattr(value, "__dict__", None)
    return list(attrs.values()) if isinstance(attrs, dict) else ()


def tensor_storage_ptrs(*values):
    """Storage pointers of the tensors in ``values`` (searched as ``tensor_leaves`` does)."""
    return {storage_ptr(t) for t in tensor_leaves(values)}


def param_ptrs(params):
    """``data_ptr`` and storage pointer of each parameter: how a weight is recognised in a pack hook."""
    ptrs = set()
    for p in params:
        try:
            ptrs.add(p.data_ptr())
            ptrs.add(storage_ptr(p))
        except (RuntimeError, TypeError):   # not initialised yet: it has no storage, so it can't be packed
            continue
    return ptrs


class WeightPointers:
    """The pointers a pack hook recognises weights by, kept current while training goes on.

    ``ptrs`` is one set object for the life of this object (engines keep a
    reference to it and look tensors up there: one set lookup per tensor).
    ``load_param_into_net``, ``set_data`` or a cast give parameters new
    storage; ``refresh()`` compares every parameter's ``data_ptr`` with the
    last build (one call per parameter, about 0.2 us) and rebuilds ``ptrs`` in
    place when any changed, so a reloaded weight is never taken for an
    activation. Parameters are held weakly: a dropped model is freed, and its
    pointers leave the set at the next ``refresh()`` (its addresses would
    otherwise hide new activations from an engine).
    """

    def __init__(self, params=()):
        self.ptrs = set()
        self._params = {}       # id -> weakref to the Parameter
        self._built_from = ()   # data_ptr of each parameter when ``ptrs`` was built
        self.add(params)

    def add(self, params):
        """Recognise these parameters too (already known ones are skipped)."""
        added = False
        for p in params:
            ref = self._params.get(id(p))
            if ref is None or ref() is not p:
                self._params[id(p)] = weakref.ref(p)
                added = True
        if added:
            self._build()

    def learn(self, p):
        """Recognise one more parameter, met in a pack hook: its pointers join ``ptrs`` without a rebuild
        (a model whose weights are all met this way would otherwise rebuild once per weight)."""
        ref = self._params.get(id(p))
        if ref is not None and ref() is p:
            if p.data_ptr() not in self.ptrs:
                self._build()   # known, but its storage changed since the last build
            return
        reused = id(p) in self._params   # a dead parameter's id: its slot keeps its place, refresh() rebuilds
        self._params[id(p)] = weakref.ref(p)
        self.ptrs |= param_ptrs((p,))
        try:
            ptr = p.data_ptr()
        except (RuntimeError, TypeError):
            ptr = -1
        self._built_from = () if reused else self._built_from + (ptr,)

    def refresh(self):
        """Rebuild ``ptrs`` if a parameter's storage changed or a parameter died since the last build."""
        if self._current() != self._built_from:
            self._build()

    def _current(self):
        ptrs = []
        for ref in self._params.values():
            p = ref()
            try:
                ptrs.append(p.data_ptr() if p is not None else None)
            except (RuntimeError, TypeError):   # not initialised yet: no storage, nothing to recognise
                ptrs.append(-1)
        return tuple(ptrs)

    def _build(self):
        live = {k: r for k, r in self._params.items() if r() is not None}
        self._params = live
        self.ptrs.clear()
        self.ptrs |= param_ptrs(r() for r in live.values())
        self._built_from = self._current()


def cell_path_of(cell):
    """The path of ``cell`` in its model (``layers.0``), read from its Parameters' names (MindSpore names a
    Parameter by its path from the top cell): the global name less the cell's own local name. Its class name
    when it holds no named Parameter."""
    for local, p in cell.parameters_and_names():
        if p.name.endswith("." + local):
            return p.name[:-len(local) - 1]
    return type(cell).__name__   # the top cell, or one without Parameters


def root_cell_of(fn):
    """The Cell a call runs: ``fn`` itself, or the owner of a bound method; else None."""
    if isinstance(fn, nn.Cell):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Cell) else None


# ``is_tracked(t)``: whether autograd records ops on ``t`` in the graph being built (any dtype). A
# grad-function input is tracked whatever its dtype (int position ids and bool masks from the batch too); a
# constant float tensor is not. Ops save for backward only what their tracked inputs' gradients need, so this
# decides which tensors an op packs. The door's function itself: swap asks it for every tensor it keeps.
is_tracked = tensor_tracked


def version_alias(t):
    """``t``'s storage as another C++ tensor that autograd does not track and that shares ``t``'s version counter:
    a view (about 4 us). ``Tensor.data`` has a counter of its own, and MindSpore's check of a saved tensor's version
    reads the counter of what an unpack returns. Call it under ``no_grad()`` (once around a loop: entering it costs
    as much as the view): a recorded view would have a graph node, and holding it would tie the holder to the
    graph (a cycle through MindSpore's C++ nodes). Raises what ``view`` raises for a layout it refuses."""
    return view_op(t, t.shape)


def detached(t):
    """``t`` cut from autograd: same storage, no graph node, not tracked.

    ``ops.stop_gradient`` while a graph is being recorded is itself recorded,
    and on a tensor that is an input of the graph (a grad function's argument,
    or a recompute's re-tracked input) it makes later backward kernels of the
    ops that saved that tensor take it as a constant: kernels without a
    PyBoost CPU implementation (``LayerNormGrad``) then key their single-op
    graph by the tensor's printed values, about 10x their normal time
    (MindSpore 2.10, measured: ``docs/benchmarks.md``). Run under ``no_grad``
    it records nothing and detaches the same.
    """
    with no_grad():
        return ops.stop_gradient(t)
