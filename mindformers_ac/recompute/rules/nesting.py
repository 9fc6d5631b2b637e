"""Nested regions and grad calls inside a forward (docs/exactness.md, "Higher-order gradients and nested regions")."""
from ...mindspore_compat import EXECUTOR_CALLS, recording_backward
from ..dispatch import RegionDispatch
from ..rerun import RegionRun, saved_hooks
from ..state import ENGINE, REPLAY
from .base import Rule


class Nesting(Rule):
    """Marks a region whose forward holds a child region or makes grad calls of its own."""

    __slots__ = ()

    def note_child(self):
        self.keeps_intercepted("nested", "a recomputed region runs inside it")

    def inner_grad_save(self, t):
        """A save inside a grad call the region's function makes (gradients inside a forward): that call's backward
        runs before this forward ends, so it is kept as it is; the re-run's call saves its own."""
        self.keeps_intercepted("inner_grad", "its function computes gradients inside its forward")
        return t

    def grad_calls(self):
        return "inner_grad" in self.reasons

    def rerun_outputs(self):
        """``recompute_graph``'s ``outputs``: a list when the re-run's own grad calls need a top cell of their own,
        None otherwise and in a backward recorded for a higher-order one (a new top cell would replace the one being
        recorded: "Can not find top cell")."""
        return [] if self.grad_calls() and not recording_backward() else None

    def replay(self, args, kwargs, grad_calls):
        """Run the region again inside a parent's recompute, with its kept outputs and masks. ``grad_calls``: the
        grad calls running when the enclosing re-run started (``pack_replay``)."""
        region = self.region
        run = RegionRun(region, REPLAY, region.tracker)
        run.grad_calls = grad_calls
        ENGINE.push(run)
        try:
            with region.run_context(REPLAY), region.tracking(), RegionDispatch(run), \
                    saved_hooks(run, Nesting.pack_replay):
                return region.fn(*args, **kwargs)
        finally:
            ENGINE.pop(run)

    @staticmethod
    def pack_replay(_region, run, t):
        """Replay pack hook: the replay graph is never backpropagated, so it keeps nothing, but a save inside a grad
        call the enclosing re-run's function makes (``c(grad(c(f)))``), whose backward reads it (N1)."""
        return t if EXECUTOR_CALLS.grad_calls() > run.grad_calls else None
