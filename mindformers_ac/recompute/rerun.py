"""Running a region's function again in backward: its inputs as they were, in a throw-away graph.

Both the op-intercepting region and the light path re-run the same way: the
saved inputs are detached and tracked exactly as in forward
(``recompute_input``), and the function runs with gradient recording on, in a
new graph that is never backpropagated (``recompute_graph``), so that its ops
save what they saved in forward and the hooks can collect it.

Mixed precision (see ``precision``): a recompute calls the region's function
from backward, outside the region cell's ``__call__`` that pushed its
mixed-precision type in forward, so ``recompute_graph`` pushes the type the
forward ran under (the region records ``cell_precision(root)`` at forward);
sub-cells called inside push their own, as in forward. The engine's own ops
in a region (saved-input copies, copies of written parameters) run under
``no_casts``.
"""
import contextlib

from mindspore import ops
from ..mindspore_compat import pynative_executor as _executor

from ..precision import under_precision
from .saved import SwappedTensor
from .state import ENGINE, FORWARD, RECOMPUTE


class SavedInput:
    """A region input kept for the recompute, and whether autograd tracked it in forward."""

    __slots__ = ("value", "tracked")

    def __init__(self, value, tracked):
        self.value, self.tracked = value, tracked


def recompute_input(a):
    """A saved input as the recompute must see it: loaded, detached, tracked exactly as in forward.

    Ops save for backward only what their *tracked* inputs' gradients need (and
    record nothing when no input is tracked), whatever the dtype: int position
    ids or a bool mask passed to the grad function are tracked, a float
    constant is not. An input tracked in only one of the two runs makes its
    consumers save a different number of tensors, and the forward's tokens
    would take the wrong ones (or none).
    """
    if not isinstance(a, SavedInput):
        return a   # not a tensor, or a Parameter: passed as is
    tracked, a = a.tracked, a.value
    if isinstance(a, SwappedTensor):
        a = a.load()
    a = ops.stop_gradient(a)
    if tracked:
        a.requires_grad_()
    return a


def refuse_higher_order():
    """Raise when this backward is itself being recorded for a gradient (grad of grad).

    The outer gradient differentiates the inner backward, which reads every
    saved tensor a second time; a recomputed tensor is handed out once, and an
    output re-run under ``no_grad`` would silently cut the second-order path.
    Inside a recompute the engine records a throw-away graph on purpose, so
    only the outermost re-run checks.
    """
    if not ENGINE.in_recompute() and _executor.requires_grad():
        raise RuntimeError(
            "mindformers_ac: higher-order gradients (a grad of a grad, e.g. ms.grad(ms.grad(f))) through a "
            "recomputed region or op are not supported: the first backward is being recorded for a second "
            "one. Leave the layers that take part out of recompute (swap is exact here), or compute the "
            "higher-order gradient without mindformers_ac.")


def divergence_hint(forward_op, recompute_op):
    """What to add to a "diverged" message when the two runs differ by an inserted Cast."""
    if "Cast" not in (forward_op, recompute_op):
        return ""
    return (" The runs differ by a Cast: the region's forward and recompute ran under different mixed-"
            "precision types. The recompute uses the region cell's own type (set by to_float / amp O2/O3 "
            "on every cell); a type set on an enclosing cell only is not seen: call to_float on the "
            "region's cell as well.")


@contextlib.contextmanager
def recompute_graph(run, precision=None):
    """Run a region's function again as ``run``: recording on, in a new graph, under the forward's
    mixed-precision type ``precision``; everything restored on every exit path."""
    grad_flag, enable_grad = _executor.grad_flag(), _executor.enable_grad()
    ENGINE.enter_recompute()
    ENGINE.push(run)
    try:
        _executor.set_grad_flag(True)
        _executor.set_enable_grad(True)
        _executor.new_empty_graph()
        try:
            with under_precision(precision):
                yield
        finally:
            _executor.end_empty_graph()
    finally:
        _executor.set_grad_flag(grad_flag)
        _executor.set_enable_grad(enable_grad)
        ENGINE.pop(run)
        ENGINE.exit_recompute()


class RerunOnce:
    """What both region kinds share: nested regions replayed in call order, one guarded recompute.

    A subclass keeps ``children`` (regions met in its forward), sets
    ``context_fn`` (``checkpoint``'s: ``() -> (forward_ctx, recompute_ctx)``, or
    None) and defines ``_recompute()``; ``recompute_once()`` runs it on the
    first unpack only and returns its result (None when it already ran).
    """

    def __init__(self):
        self.children = []
        self.done = False
        self._running = False
        self._recompute_ctx = None   # the recompute context made with this call's forward context

    def run_context(self, mode):
        """The user's context for a run in ``mode``: the forward's, or the recompute's made with it."""
        if self.context_fn is None:
            return contextlib.nullcontext()
        if mode == FORWARD:
            fwd, self._recompute_ctx = self.context_fn()
            return fwd
        if mode == RECOMPUTE and self._recompute_ctx is not None:
            ctx, self._recompute_ctx = self._recompute_ctx, None
            return ctx
        return self.context_fn()[1]

    def next_child(self, run):
        """The next nested region, in forward order, for ``run`` (a recompute or a replay)."""
        if run.child_idx >= len(self.children):
            raise RuntimeError("mindformers_ac: a checkpointed region called more nested checkpoints in its "
                               "recompute than in its forward; its code path must not change when re-run")
        child = self.children[run.child_idx]
        run.child_idx += 1
        return child

    def recompute_once(self):
        if self.done:
            return None
        if self._running:
            raise RuntimeError("mindformers_ac: a region's recompute asked for its own saved tensors")
        refuse_higher_order()
        self._running = True
        try:
            result = self._recompute()
        finally:
            self._running = False
        self.done = True
        return result
