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
* ``EXECUTOR_CALLS`` (``ExecutorCalls``): from ``import mindformers_ac`` on, counters at
  MindSpore's grad-call entry points (``mindspore.ops.composite.base``'s
  ``_pynative_func_grad_forward`` / ``_backward``, the two halves of
  ``ms.grad`` / ``value_and_grad`` / ``GradOperation`` / ``vjp``) and at the
  executor's ``set_mixed_precision_type`` / ``set_cell_use_dynamic_shape_process``:
  what tells a higher-order backward from a first-order one, a save inside a
  grad call the region's own function makes, and whether an early stop would
  leave a cell's executor state behind, from what runs now (no Python frame
  is read);
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


# ``tensor_version(t)``: MindSpore's in-place version counter of ``t`` (shared with its views; see
# ``tensor_stamp``). An attrgetter, not a function: swap reads it twice per saved tensor (rule W6s).
tensor_version = operator.attrgetter("_version")


_GRAD_ENTRY_MODULES = ("mindspore.ops.composite.base",   # GradOperation, ms.grad, value_and_grad
                       "mindspore.ops.function.grad.grad_func")   # vjp (it imported both names)


class ExecutorCalls:
    """What MindSpore's executor is doing on this thread, counted at its Python entry points.

    Installed once, by ``import mindformers_ac`` (``install()``), and kept
    for the process: wrappers kept in ``try``/``finally`` count, per thread:

    * ``grad_forward``: grad calls running their forward half
      (``mindspore.ops.composite.base._pynative_func_grad_forward``, the
      forward of ``ms.grad`` / ``value_and_grad`` / ``GradOperation`` /
      ``vjp``, and the same name in ``grad_func``);
    * ``grad_calls``: grad calls running either half (``..._grad_backward``
      too);
    * ``cell_state()``: mixed-precision types pushed on the executor
      (``set_mixed_precision_type``, what ``Cell.__call__`` does for
      ``to_float`` / amp O2-O3) and the dynamic-shape flag
      (``set_cell_use_dynamic_shape_process``).

    MindSpore 2.10 undoes none of these on an exception (no ``finally``): a
    grad call whose function raised leaves its grad flag set for the rest of
    the process, and a raise through a cell call leaves its type pushed. The
    counters are what is running now, so they stay right after such a
    failure; nothing here repairs the executor itself (docs/exactness.md,
    "Higher-order gradients", says why).

    Why at import and not with the first wrapper: counters installed later
    can't tell a grad call that started before them from a flag a failed
    call left set (MindSpore 2.10 has no state that tells them apart), and
    ``checkpoint()`` is first called inside a grad call. The wrappers only
    count; MindSpore's functions run unchanged inside them. A grad call
    running while the package is imported is not counted:
    ``grad_forward_running()`` answers from the executor's flag until the
    next grad call this thread starts outside any counted one. No Python
    frame is read.
    """

    def __init__(self):
        self._local = threading.local()
        self._lock = threading.Lock()
        self._installed = False

    def _state(self):
        local = self._local
        if not hasattr(local, "grad_forward"):
            local.grad_forward = local.grad_calls = local.precision_pushes = 0
            local.dynamic_shape = False
            local.unseen = False   # install() sets it on the importing thread: a grad call may run there
        return local

    # -- what the engine asks ------------------------------------------------------------------
    def grad_forward_running(self):
        """True while a MindSpore grad call is running its forward on this thread (recording a graph).

        A backward that runs meanwhile is being recorded for that grad: a
        higher-order gradient. The executor's ``requires_grad()`` alone can't
        tell: a grad call whose function raised leaves it set."""
        local = self._state()
        return local.grad_forward > 0 or (local.unseen and pynative_executor.requires_grad())

    def grad_calls(self):
        """How many grad calls (either half) run on this thread: a region's run notes it when it starts,
        and a save made while more run is made inside a grad call of the region's own function."""
        return self._state().grad_calls

    def cell_state(self):
        """``(mixed-precision types pushed, dynamic-shape flag)`` on this thread: what a raise through a
        ``Cell.__call__`` would leave behind if it changed since a point the caller noted."""
        local = self._state()
        return local.precision_pushes, local.dynamic_shape

    # -- installing ----------------------------------------------------------------------------
    def install(self):
        """Wrap MindSpore's entry points, once per process (``import mindformers_ac`` calls it)."""
        with self._lock:
            if self._installed:
                return
            self._install()
            self._installed = True
            self._state().unseen = bool(pynative_executor.requires_grad())

    def _install(self):
        for name in _GRAD_ENTRY_MODULES:
            module = importlib.import_module(name)
            forward = getattr(module, "_pynative_func_grad_forward", None)
            backward = getattr(module, "_pynative_func_grad_backward", None)
            if forward is not None:
                setattr(module, "_pynative_func_grad_forward", self._counted_forward(forward))
            if backward is not None:
                setattr(module, "_pynative_func_grad_backward", self._counted_backward(backward))
        executor = pynative_executor
        setattr(executor, "set_mixed_precision_type",
                    self._counted_precision(type(executor).set_mixed_precision_type.__get__(executor)))
        setattr(executor, "set_cell_use_dynamic_shape_process",
                    self._noted_dynamic_shape(type(executor).set_cell_use_dynamic_shape_process.__get__(executor)))

    def _counted_forward(self, original):
        state = self._state

        @functools.wraps(original)
        def grad_forward(fn, *args, **kwargs):
            local = state()
            if not local.grad_forward:
                local.unseen = False   # an outermost counted grad call: nothing uncounted runs below it
            local.grad_forward += 1
            local.grad_calls += 1
            try:
                return original(fn, *args, **kwargs)
            finally:
                local.grad_forward -= 1
                local.grad_calls -= 1
        return grad_forward

    def _counted_backward(self, original):
        state = self._state

        @functools.wraps(original)
        def grad_backward(*args, **kwargs):
            local = state()
            local.grad_calls += 1
            try:
                return original(*args, **kwargs)
            finally:
                local.grad_calls -= 1
        return grad_backward

    def _counted_precision(self, original):
        state = self._state

        @functools.wraps(original)
        def set_mixed_precision_type(mixed_precision_type, is_push=True):
            out = original(mixed_precision_type, is_push)
            state().precision_pushes += 1 if is_push else -1
            return out
        return set_mixed_precision_type

    def _noted_dynamic_shape(self, original):
        state = self._state

        @functools.wraps(original)
        def set_cell_use_dynamic_shape_process(flag):
            out = original(flag)
            state().dynamic_shape = bool(flag)
            return out
        return set_cell_use_dynamic_shape_process


EXECUTOR_CALLS = ExecutorCalls()
"""The process's one ``ExecutorCalls``: MindSpore's entry points are process-wide, so is what wraps them
(installed by ``mindformers_ac/__init__.py``)."""


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
