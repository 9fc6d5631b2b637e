"""The one door to MindSpore's internals: the releases this package runs on, and every private name it uses.

The engines rely on APIs that appeared in MindSpore 2.9.0: ``MsDispatchMode``
(op interception), the ``mindspore.graph`` package, and the PyNative
executor's ``new_empty_graph`` (the recompute's throw-away graph). An older
MindSpore fails at import with a message naming the release needed, instead
of an AttributeError deep inside a training step.

Private MindSpore names are imported here and nowhere else
(``tests/test_layout.py`` checks it), so a MindSpore upgrade is audited in
this one file:

* ``pynative_executor``: ``mindspore.graph.api._pynative_executor`` (grad
  flags, the recompute's empty graph, ``requires_grad``, saved-tensor hook
  state, ``sync``);
* ``no_grad``: ``mindspore._no_grad``, a context that records no graph;
* ``MixedPrecisionType``: from ``mindspore._c_expression``, the type
  ``Cell.__call__`` pushes on the executor for ``to_float`` / amp O2-O3;
* ``autodiff_engine_id``: ``get_current_autodiff_engine_id``, the key of a
  region's re-run (one per backward that reaches it, as MindSpore's own
  non-reentrant recompute keys them); ``recording_backward``: whether a
  backward is recorded for a higher-order one (``requires_grad``);
* ``EXECUTOR_CALLS`` (``ExecutorCalls``): only while an op-intercepting run
  of a region runs (``counting()``), counters at MindSpore's grad-call entry
  points (``mindspore.ops.composite.base``'s ``_pynative_func_grad_forward`` /
  ``_backward``, and ``grad_func``'s): a save inside a grad call the region's
  own function makes (no Python frame is read); MindSpore's own functions
  are back once no run counts;
* ``pushes_cell_state``: a cell's ``mixed_precision_type`` and
  ``_dynamic_shape_inputs``, what ``Cell.__call__`` pushes on the executor
  (early stop is off for a region whose cells push it);
* ``chained_hook_pushes``: the meter's wrapping of the executor's
  ``push_saved_tensor_hook``, for the duration of a measurement;
* ``dispatch_mode_depth``: ``_DispatchGuardStack.depth()`` from
  ``mindspore._c_expression``, how many ``MsDispatchMode`` are entered (the
  failure-path tests check that none is left);
* ``RandomState``: MindSpore's two sources of seeds for random ops, the
  per-kernel seed table of ``mindspore.common.seed`` (``_KERNEL_SEED``, which
  ``ops.dropout``, ``ops.rand_like``, ``ops.uniform`` ... advance on every
  call) and ``mindspore.common.generator.default_generator`` (the ``mint``
  random ops' seed and offset).

* ``tensor_stamp``: a tensor's storage pointer and ``_version``, the counter
  MindSpore's own "modified by an inplace operation" check reads (``Inplace*``
  ops advance it; a rebinding gives the tensor new storage instead).
* ``generator_random_op``: MindSpore's generated op tables
  (``mindspore.ops.auto_generate.cpp_create_prim_instance_helper``'s
  ``op_labels`` and ``op_args_default_value``), read only: which pyboost ops
  are random (the recompute engine's random-op facts).

``synchronous_pynative`` picks, per release, the API that sets synchronous
PyNative execution.
"""
import contextlib
import functools
import importlib
import operator
import threading

import mindspore
from mindspore._c_expression import (
    MixedPrecisionType,  # noqa: F401  (re-exported: the door)
    _DispatchGuardStack,
)

try:   # a too-old MindSpore lacks it: require_mindspore() says so before any engine uses it
    from mindspore.graph.api import _pynative_executor as pynative_executor
except ImportError:
    pynative_executor = None

no_grad = mindspore._no_grad   # pylint: disable=protected-access

try:   # the View primitive's own call: ``Tensor.view`` and the primitive's ``__call__`` cost 2-3 us more around it
    from mindspore._c_expression import pyboost_view as _pyboost_view
    from mindspore.ops.auto_generate.gen_ops_prim import view_op as _VIEW

    def view_op(t, shape):
        """``t.view(shape)`` (outside ``ms.jit``, where the engines run)."""
        return _pyboost_view(_VIEW, [t, shape])
except ImportError:
    view_op = mindspore.Tensor.view


_op_tables = importlib.import_module("mindspore.ops.auto_generate.cpp_create_prim_instance_helper")
_OP_LABELS = getattr(_op_tables, "op_labels", {})              # op name -> attributes MindSpore labels it with
_OP_DEFAULTS = getattr(_op_tables, "op_args_default_value", {})   # op name -> its arguments with defaults


def generator_random_op(name):
    """True for a pyboost op MindSpore's generated op tables mark as random (read-only): labelled
    ``side_effect_hidden`` (DropoutExt), or taking a generator's ``seed`` and ``offset`` (InplaceRandom,
    RandpermV2 ...). Pyboost ops are dispatched without their primitive, so these tables are their facts."""
    labels, args = _OP_LABELS.get(name, {}), _OP_DEFAULTS.get(name, {})
    return labels.get("side_effect_hidden") is True or ("seed" in args and "offset" in args)


MIN_MINDSPORE = "2.9.0"

# ``mindspore.common.seed`` is shadowed by the function ``seed`` in ``mindspore.common``'s namespace.
_seed_module = importlib.import_module("mindspore.common.seed")
_generator_module = importlib.import_module("mindspore.common.generator")


def tensor_stamp(t):
    """``(data_ptr, version)`` of ``t``: unchanged until something writes it in place or rebinds its storage.

    Views share their base's version counter; a detached alias (``stop_gradient``) does not, so stamp
    the tensor the model holds. Legacy side-effect ops (``AssignAdd`` ...) do not advance it (what rule
    W1 of docs/exactness.md can't see)."""
    return t.data_ptr(), t._version   # pylint: disable=protected-access


def attach_to_tensor(t, key, obj):
    """Store ``obj`` in the user data of ``t``'s C++ tensor, which every Python object of that tensor shares
    (the one a saved-tensor hook receives is another Python object than the one the op returned); False when
    the release has no user data. Measured on MindSpore 2.10 (docs/exactness.md, rule W6s): ``obj`` lives
    as long as the C++ tensor; an entry stored after the tensor was saved is not held by the autograd graph's
    record of the save, so it dies when the code outside drops the tensor and its views."""
    try:
        t._set_user_data(key, obj)   # pylint: disable=protected-access
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


# ``tensor_version(t)``: MindSpore's in-place version counter of ``t`` (shared with its views; see
# ``tensor_stamp``). An attrgetter, not a function: swap reads it twice per saved tensor (rule W6s).
tensor_version = operator.attrgetter("_version")


_GRAD_ENTRY_MODULES = ("mindspore.ops.composite.base",   # GradOperation, ms.grad, value_and_grad
                       "mindspore.ops.function.grad.grad_func")   # vjp (it imported both names)


_GRAD_HALVES = ("_pynative_func_grad_forward", "_pynative_func_grad_backward")


def _entry_points():
    """``(module, name)`` of each MindSpore callable ``ExecutorCalls`` wraps while it counts: the two halves of a
    grad call, in both modules that bind them."""
    modules = [importlib.import_module(name) for name in _GRAD_ENTRY_MODULES]
    return [(module, name) for module in modules for name in _GRAD_HALVES if hasattr(module, name)]


class ExecutorCalls:
    """How many MindSpore grad calls run on this thread while a region's op-intercepting run runs, counted at
    their Python entry points.

    Nothing is wrapped at import, nor for good: ``counting()`` wraps the two
    halves of a grad call (``_pynative_func_grad_forward`` / ``_backward``,
    what ``ms.grad`` / ``value_and_grad`` / ``GradOperation`` / ``vjp`` run)
    while at least one run on any thread is inside it, and puts MindSpore's
    own back when the last leaves (one another patcher rebound meanwhile is
    left to it). The wrappers only count, per thread, in ``try``/``finally``;
    MindSpore's functions run unchanged inside them. ``grad_calls()`` is read
    relative to what a run noted when it started, so a grad call already
    running then (the step's own) is no concern: a save made while more run
    is made inside a grad call of the region's own function. A higher-order
    backward needs none of it (re-runs are keyed by ``autodiff_engine_id``),
    nor does early stop (``pushes_cell_state``). No Python frame is read.
    """

    def __init__(self):
        self._local = threading.local()
        self._lock = threading.Lock()
        self._users = 0
        self._originals = None   # [(module, name, MindSpore's function, our wrapper)] while counting
        self._wrappers = {}      # MindSpore's function -> our wrapper, made once (a re-run installs them each time)

    def grad_calls(self):
        """How many grad calls (either half) this thread runs inside ``counting()``."""
        return getattr(self._local, "grad_calls", 0)

    def installed(self):
        return self._originals is not None

    @contextlib.contextmanager
    def counting(self):
        """Wrap the entry points for the duration (reentrant, any thread); MindSpore's own are back after."""
        with self._lock:
            if not self._users:
                self._install()
            self._users += 1
        try:
            yield self
        finally:
            with self._lock:
                self._users -= 1
                if not self._users:
                    self._remove()

    def _install(self):
        originals = []
        for module, name in _entry_points():
            original = getattr(module, name)
            wrapper = self._wrappers.get(original)
            if wrapper is None:
                wrapper = self._wrappers[original] = self._counted(original)
            setattr(module, name, wrapper)
            originals.append((module, name, original, wrapper))
        self._originals = originals

    def _remove(self):
        for module, name, original, wrapper in self._originals:
            if getattr(module, name) is wrapper:   # else rebound by someone else meanwhile: theirs now
                setattr(module, name, original)
        self._originals = None

    def _counted(self, original):
        local = self._local

        @functools.wraps(original)
        def grad_half(*args, **kwargs):
            local.grad_calls = getattr(local, "grad_calls", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.grad_calls -= 1
        return grad_half


EXECUTOR_CALLS = ExecutorCalls()
"""The process's one ``ExecutorCalls``: MindSpore's entry points are process-wide, so is what wraps them
while a region's run counts (``ExecutorCalls.counting``)."""


def _closure_values(fn):
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:   # an empty cell: a name its scope binds later
            pass
    return values


def pushes_cell_state(root):
    """Whether calling ``root`` (a Cell, or a function: the Cells it is bound to or closes over) runs a
    ``Cell.__call__`` that pushes executor state it pops only on return: a mixed-precision type
    (``mixed_precision_type``: ``to_float``, amp O2-O3) or the dynamic-shape flag (``_dynamic_shape_inputs``:
    ``set_inputs``). A re-run stopped early inside one would leave it set (MindSpore 2.10 undoes neither on an
    exception)."""
    stack = [root] if isinstance(root, mindspore.nn.Cell) else \
        [v for v in _closure_values(root) if isinstance(v, mindspore.nn.Cell)]
    seen = set()
    while stack:   # the cell tree by ``_cells``: half the time of ``cells_and_names``' nested generators
        cell = stack.pop()
        if id(cell) in seen:   # a cell held twice, or one holding its parent
            continue
        seen.add(id(cell))
        if cell.mixed_precision_type is not None or getattr(cell, "_dynamic_shape_inputs", None) is not None:
            return True
        stack.extend(c for c in cell._cells.values() if c is not None)   # pylint: disable=protected-access
    return False


def autodiff_engine_id():
    """A key for the backward running now: MindSpore's id of the autodiff engine running it
    (``get_current_autodiff_engine_id``, what MindSpore's own non-reentrant recompute keys by), or, outside
    any backward (the engine answers -1), a new object, so such an unpack shares no re-run."""
    engine = pynative_executor.get_current_autodiff_engine_id()
    return engine if engine != -1 else object()


def recording_backward():
    """Whether the executor records what runs now for a gradient: in a backward, that it is being recorded for
    a higher-order one (``requires_grad``; also left set by a grad call that raised, which then only costs
    keeping a light region's inputs till its graph dies)."""
    return bool(pynative_executor.requires_grad())


_PUSH = "push_saved_tensor_hook"


@contextlib.contextmanager
def chained_hook_pushes(wrap):
    """While entered, every saved-tensor hook pair pushed on the executor goes through ``wrap(pack, unpack) ->
    (pack, unpack)`` first (the meter's view of what each hook keeps); the executor's push (its own, or an outer
    measurement's) is back after."""
    executor = pynative_executor
    had, previous = _PUSH in vars(executor), vars(executor).get(_PUSH)
    push = getattr(executor, _PUSH)

    def chained_push(pack_hook, unpack_hook):
        return push(*wrap(pack_hook, unpack_hook))

    setattr(executor, _PUSH, chained_push)
    try:
        yield
    finally:
        if had:
            setattr(executor, _PUSH, previous)
        else:
            delattr(executor, _PUSH)


def dispatch_mode_depth():
    """How many ``MsDispatchMode`` contexts are entered on this thread (0 when no region is running)."""
    return _DispatchGuardStack.depth()


class RandomState:
    """A snapshot of the seeds MindSpore's functional random ops draw from; ``restore()`` puts it back.

    Random ops created per call (``ops.dropout`` makes a fresh ``Dropout``
    primitive, seeded from the table) draw the same numbers from the same
    snapshot; a primitive held by a cell (``nn.Dropout``) has its own state,
    which no snapshot covers. Taking one costs a dict copy and a 16-byte
    read of the generator, a few microseconds.
    """

    __slots__ = ("kernel_seeds", "generator")

    def __init__(self):
        self.kernel_seeds = dict(_seed_module._KERNEL_SEED)   # pylint: disable=protected-access
        with no_grad():
            self.generator = _generator_module.default_generator.get_state()

    def restore(self):
        table = _seed_module._KERNEL_SEED   # pylint: disable=protected-access
        if table != self.kernel_seeds:
            table.clear()
            table.update(self.kernel_seeds)
        with no_grad():
            _generator_module.default_generator.set_state(self.generator)


def require_mindspore():
    """Raise ImportError naming ``MIN_MINDSPORE`` when the installed MindSpore lacks what the engines use."""
    try:
        from mindspore.graph.api import _pynative_executor
        from mindspore.utils import MsDispatchMode  # noqa: F401
        _pynative_executor.new_empty_graph   # noqa: B018  (the attribute is the check)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"mindformers-ac needs MindSpore >= {MIN_MINDSPORE}, found {mindspore.__version__} "
                          f"({exc}); upgrade with: pip install 'mindspore>={MIN_MINDSPORE}'") from None


def synchronous_pynative(device=None):
    """Set this process to PyNative mode with every op launched synchronously (and to ``device``, if given).

    What every entry point that times steps calls (``mindformers-ac train`` and its
    worker processes, ``plan``, the benchmark scripts, the test suite): with
    MindSpore's default asynchronous launch, step times on CPU are bimodal.
    MindSpore 2.10 deprecates ``set_context(pynative_synchronize=True)`` and
    ``set_context(device_target=...)`` (a warning on every call) in favour of
    ``mindspore.runtime.launch_blocking()`` and ``mindspore.set_device()``; both
    were measured to give the same steady step times. The new API is used where
    the installed release has it, the old one where it does not. Process-wide:
    call it once, at the start of the entry point, before the first op.
    """
    ms = mindspore
    if device is not None:
        set_device = getattr(ms, "set_device", None)
        if set_device is not None:
            set_device(device)
        else:
            ms.set_context(device_target=device)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    launch_blocking = getattr(getattr(ms, "runtime", None), "launch_blocking", None)
    if launch_blocking is not None:
        launch_blocking()
    else:
        ms.set_context(pynative_synchronize=True)


def registered_pack_hook(cell):
    """The pack hook ``cell.register_saved_tensors_hooks`` set (``Cell._saved_tensors_pack_hook``), or None.

    MindSpore 2.10 runs it only when the cell's call takes ``Cell.__call__``'s
    slow path (forward or backward hooks, ``requires_grad``, mixed precision):
    a forward hook added to such a cell turns its saved-tensor hooks on.
    """
    return getattr(cell, "_saved_tensors_pack_hook", None)


def uses_native_recompute(cell):
    """Whether MindSpore's own ``Cell.recompute()`` was called on ``cell`` (``Cell._recompute_cell`` is set)."""
    return getattr(cell, "_recompute_cell", None) is not None


def jit_compiled(fn):
    """Whether ``fn`` (a function or a bound method) is wrapped by ``ms.jit``, any capture mode (the wrapper's
    ``__wrapped_by_jit__`` mark)."""
    return bool(getattr(getattr(fn, "__func__", fn), "__wrapped_by_jit__", False))


def tensor_tracked(t):
    """A tensor's private ``_requires_grad`` flag, or, on a release that lacks it, whether it has a
    ``_grad_node``: what ``tensors.is_tracked`` answers (swap asks it for every tensor it keeps)."""
    flag = getattr(t, "_requires_grad", None)
    return flag if isinstance(flag, bool) else getattr(t, "_grad_node", None) is not None


def cell_hook_dicts(cell_attrs):
    """``(main, extras)`` of a cell's lazily created hook dicts in its ``vars()`` (``_lazy_forward_hook`` ...):
    each main dict maps a hook id to its function; an id removed from one goes from ``extras`` too (the
    with-kwargs and always-called flags of that hook)."""
    main = [cell_attrs[name] for name in ("_lazy_forward_pre_hook", "_lazy_forward_hook", "_lazy_backward_pre_hook",
                                          "_lazy_backward_hook") if cell_attrs.get(name)]
    extras = [cell_attrs[name] for name in ("_lazy_forward_pre_hook_with_kwargs", "_lazy_forward_hook_with_kwargs",
                                            "_lazy_forward_hook_always_called") if cell_attrs.get(name)]
    return main, extras
