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
* ``grad_forward_running``: whether a grad call's forward is on the Python
  stack (``mindspore.ops.composite.base._pynative_func_grad_forward``, the
  forward half of ``ms.grad`` / ``value_and_grad`` / ``GradOperation`` /
  ``vjp``): what tells a higher-order backward from a first-order one;
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

``synchronous_pynative`` picks, per release, the API that sets synchronous
PyNative execution.
"""
import importlib
import sys

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


_grad_module = importlib.import_module("mindspore.ops.composite.base")
try:   # the forward and backward halves of every PyNative grad call (ms.grad, value_and_grad, GradOperation, vjp)
    _GRAD_FORWARD_CODE = _grad_module._pynative_func_grad_forward.__code__   # pylint: disable=protected-access
    _GRAD_CODES = (_GRAD_FORWARD_CODE, _grad_module._pynative_func_grad_backward.__code__)   # pylint: disable=protected-access
except AttributeError:   # another release: grad_forward_running() then answers from the executor's flag alone
    _GRAD_FORWARD_CODE, _GRAD_CODES = None, ()


def grad_forward_running():
    """True while a MindSpore grad call is running its forward on this thread (it is recording a graph).

    A backward that runs while a grad's forward is in progress below it on
    the Python stack is being recorded for that grad: a higher-order
    gradient. The executor's ``requires_grad()`` alone can't tell: a grad
    call whose function raised leaves MindSpore's grad flag set (2.10's
    ``_pynative_func_grad_forward`` has no ``finally``), so every later
    first-order backward would look recorded. Walks the frames up to the
    thread's bottom (a few dozen in a training step: microseconds); called
    once per recompute, not per op. On a release without that function it
    falls back to ``requires_grad()``.
    """
    code = _GRAD_FORWARD_CODE
    if code is None:
        return pynative_executor.requires_grad()
    frame = sys._getframe(1)   # pylint: disable=protected-access
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def grad_call_inside(stop_codes):
    """True when a MindSpore grad call (its forward or its backward half) runs between the caller and the
    nearest frame running one of ``stop_codes`` (a tuple of code objects) on this thread's Python stack.

    A region's pack hook asks it with the region's run methods as ``stop_codes``: a tensor saved inside a
    grad call that the region's own function makes (PyTorch's nested-checkpoint ``g``: gradients computed
    inside a forward) belongs to that call's graph, whose backward runs before the region's run ends.
    Walks the frames up to the region's run, comparing code objects by identity (``in`` on a set would
    hash each code object: tens of microseconds per call); about 1 us at a model's usual depth. False on
    a release without those functions.
    """
    if not _GRAD_CODES:
        return False
    forward, backward = _GRAD_CODES
    frame = sys._getframe(1)   # pylint: disable=protected-access
    while frame is not None:
        code = frame.f_code
        if code is forward or code is backward:
            return True
        for stop in stop_codes:
            if code is stop:
                return False
        frame = frame.f_back
    return False


def unwinding_leaves_cell_state(stop_code):
    """True when an exception raised here would unwind a ``Cell.__call__`` that leaves executor state behind.

    MindSpore 2.10's ``Cell.__call__`` pushes a cell's mixed-precision type
    (``to_float``, amp O2/O3), starts a top cell's graph (``requires_grad``) or
    sets the dynamic-shape flag before ``construct`` and undoes it only when
    ``construct`` returns (``_call_post_process``, no ``finally``): a raise
    through such a call leaves the type pushed and later ops cast. Walks the
    frames up to the one running ``stop_code``; asked once per early stop.
    """
    frame = sys._getframe(1)   # pylint: disable=protected-access
    while frame is not None and frame.f_code is not stop_code:
        owner = frame.f_locals.get("self")
        if isinstance(owner, mindspore.nn.Cell) and (
                owner.mixed_precision_type is not None or owner.requires_grad
                or getattr(owner, "_dynamic_shape_inputs", None) is not None):   # pylint: disable=protected-access
            return True
        frame = frame.f_back
    return False


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


def tensor_grad_flags(t):
    """``(requires_grad, has_grad_node)`` from a tensor's private ``_requires_grad`` (a bool, or None when a
    release lacks it) and ``_grad_node``: what ``tensors.is_tracked`` decides from."""
    flag = getattr(t, "_requires_grad", None)
    return (flag if isinstance(flag, bool) else None), getattr(t, "_grad_node", None) is not None


def cell_hook_dicts(cell_attrs):
    """``(main, extras)`` of a cell's lazily created hook dicts in its ``vars()`` (``_lazy_forward_hook`` ...):
    each main dict maps a hook id to its function; an id removed from one goes from ``extras`` too (the
    with-kwargs and always-called flags of that hook)."""
    main = [cell_attrs[name] for name in ("_lazy_forward_pre_hook", "_lazy_forward_hook", "_lazy_backward_pre_hook",
                                          "_lazy_backward_hook") if cell_attrs.get(name)]
    extras = [cell_attrs[name] for name in ("_lazy_forward_pre_hook_with_kwargs", "_lazy_forward_hook_with_kwargs",
                                            "_lazy_forward_hook_always_called") if cell_attrs.get(name)]
    return main, extras
