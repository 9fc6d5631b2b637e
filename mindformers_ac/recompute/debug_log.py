"""``checkpoint(..., debug=True)``: the forward's and the re-run's op logs, side by side, in a divergence error.

Per op the intercepting path dispatches: ``#index name (cell path)`` and the Python line of the model code that ran
it (from ``traceback.extract_stack``: the only stack read of the package, by request,
``tests/test_layout.py::test_no_frame_walking_in_the_package``). A stack summary per op: for finding a bug, not
for training.
"""
import contextlib
import functools
import os
import traceback

import mindspore

# where the frames between the model's line and the op come from (by file: a stack summary has no module names)
_SKIPPED = (os.path.dirname(mindspore.__file__) + os.sep,
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,   # mindformers_ac
            contextlib.__file__, functools.__file__)
_DEPTH = 200   # innermost frames summarised per op: the engine's and MindSpore's own calls fit many times over
_WINDOW = 40   # rows shown around the first difference of a long log


class DebugLog:
    """The op logs of one region call: its forward's and its re-run's."""

    __slots__ = ("forward_ops", "rerun_ops")

    def __init__(self):
        self.forward_ops, self.rerun_ops = [], []

    def note(self, rerun, idx, name, path):
        """Op ``idx`` of the forward, or (``rerun``) of the re-run, with the line of model code that ran it."""
        line = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(traceback.extract_stack(
            limit=_DEPTH)) if not f.filename.startswith(_SKIPPED)), "?")
        (self.rerun_ops if rerun else self.forward_ops).append(f"#{idx} {name}{f' ({path})' if path else ''} {line}")

    def side_by_side(self):
        """Both logs in two columns, ``<<`` on the first row where they differ (as ops, lines aside)."""
        fwd, rer = self.forward_ops, self.rerun_ops
        n = max(len(fwd), len(rer))
        first = next((i for i in range(n) if i >= len(fwd) or i >= len(rer)
                      or fwd[i].rsplit(" ", 1)[0] != rer[i].rsplit(" ", 1)[0]), None)
        lo, hi = 0, n
        if n > 2 * _WINDOW:
            centre = first if first is not None else n - 1
            lo, hi = max(0, centre - _WINDOW), min(n, centre + _WINDOW)
        width = max([len("forward")] + [len(s) for s in fwd[lo:hi]])
        rows = [f"  {'forward':<{width}} | re-run"]
        if lo:
            rows.append(f"  ... {lo} rows above")
        for i in range(lo, hi):
            left = fwd[i] if i < len(fwd) else ""
            right = rer[i] if i < len(rer) else "(not run)"
            rows.append(f"  {left:<{width}} | {right}{'   << first difference' if i == first else ''}")
        if hi < n:
            rows.append(f"  ... {n - hi} rows below")
        return "debug=True: the forward's and the re-run's ops (#index name (cell path) file:line)\n" + \
            "\n".join(rows)
