"""Re-run alignment and early stop (rules W7 and S1 of docs/exactness.md)."""
from ...mindspore_compat import pushes_cell_state
from .. import messages
from ..debug_log import DebugLog
from ..dispatch import StopRerun, arg_meta
from .base import Rule


class Alignment(Rule):
    """``arg_metas``: kept op index -> its tensor arguments' (shape, dtype), to tell it from a same-named op;
    ``fwd_npacks``: op index -> tensors it saved in forward; ``skipped``: forward ops the re-run skipped;
    ``stop_after``/``n_needed``: during a re-run that may stop early, its last op and the tensors to rebuild."""

    __slots__ = ("arg_metas", "fwd_npacks", "skipped", "early_stop", "stop_after", "n_needed", "debug_log")

    def __init__(self, region, early_stop, debug):
        super().__init__(region)
        self.arg_metas, self.fwd_npacks, self.skipped = {}, {}, set()
        self.early_stop = early_stop   # S1 (``pushes_cell_state``) is asked only of a re-run that would stop early
        self.stop_after, self.n_needed = None, 0
        self.debug_log = DebugLog() if debug else None   # checkpoint(debug=True): both runs' op logs

    def skippable(self, idx, run):
        """W7: only under the marker (its code asked, or a ``context_fn``), and only an op not kept."""
        return (run.asked_marker or self.region.context_fn is not None) and idx not in self.region.decisions

    def align(self, run, idx, name, args):
        """The forward index of the re-run's next op ``name`` (``idx``: right after the previous one): op ``idx``
        when it has that name (and, if kept, the same tensor arguments), else the next such op past skippable ones;
        ``RecomputeError`` when there is none."""
        names = self.region.op_names
        j = idx
        while j < len(names):
            if names[j] == name and (j not in self.arg_metas or self.arg_metas[j] == arg_meta(args)):
                return j
            if not self.skippable(j, run):
                break
            self.skipped.add(j)
            j += 1
        raise messages.other_op(idx, self.region.describe_op(idx), names[idx] if idx < len(names) else "", name,
                                run.cell_path(), self.region.cell_path())

    def realign(self, run, idx):
        """A re-run op ``idx`` saves a tensor, but forward op ``idx`` saved none: it is the next forward op of its
        name that saved some, past skippable ops (the re-run skipped a same-named side effect). Renumbers the run."""
        names = self.region.op_names
        if not self.skippable(idx, run):
            return
        j = idx + 1
        while j < len(names) and names[j] != names[idx] and self.skippable(j, run):
            j += 1
        if j >= len(names) or names[j] != names[idx] or not self.fwd_npacks.get(j) or j in self.region.decisions:
            return
        run.npacks[j] = run.npacks.pop(idx, 0)
        run.inside = [j if i == idx else i for i in run.inside]
        if run.last == idx:
            run.last = j
        if run.op_idx == idx:
            run.op_idx = j

    def start_rerun(self):
        """S1: the last forward op the re-run must run, or None for a whole re-run: a checking call (it compares
        whole runs), a group member feeding the next, nested regions, grad calls inside the forward, Parameters
        rebound in forward (put back when the re-run ends, after its last op's saves are handed over)."""
        region = self.region
        self.n_needed = len(region.token_meta)
        whole = (not self.early_stop or region.recorder is not None or region.feeds_next or region.children
                 or region.nesting.grad_calls() or not region.token_meta or region.replaced.before
                 # S1: a re-run stopped inside a cell call that pushes executor state would leave it pushed
                 or pushes_cell_state(region.root if region.root is not None else region.fn))
        self.stop_after = None if whole else max(idx for idx, _ in region.token_meta)

    def stop_if_done(self, run, key):
        if (self.stop_after is not None and not run.inside and len(self.region.recomputed) >= self.n_needed
                and run.npacks.get(key[0]) == self.fwd_npacks.get(key[0])):
            raise StopRerun()

    def check(self, run, stopped):
        """After a re-run: every op that left something for backward ran and saved as in forward, shapes and dtypes
        too (docs/exactness.md, "Int and bool inputs"); else ``RecomputeError`` naming the op and the region."""
        region = self.region
        n = len(region.op_names)
        missing = None if stopped else next((i for i in range(run.op_idx + 1, n) if not self.skippable(i, run)), None)
        if missing is not None:
            raise messages.missing_ops(missing, n, region.describe_op(missing), region.cell_path())
        self.skipped.update(range(run.op_idx + 1, n))
        for key, meta in region.token_meta.items():
            idx, k = key
            if region.decisions.get(idx) is not None or idx in self.skipped:
                continue   # kept or rebuilt: served otherwise; skipped: its tokens raise if asked for
            fwd, rec = self.fwd_npacks.get(idx, 0), run.npacks.get(idx, 0)
            if fwd != rec:
                raise messages.save_count_at_op(idx, region.describe_op(idx), fwd, rec, region.cell_path())
            t = region.recomputed.get(key)
            got = (tuple(t.shape), t.dtype) if t is not None else None
            if got != meta:
                raise messages.other_tensor(f"op #{idx} {region.describe_op(idx)}, its saved tensor #{k}", meta, got,
                                            region.cell_path())
