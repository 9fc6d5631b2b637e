"""The recompute engine's state: per thread, the stack of running region runs and the recompute depth.

``ENGINE`` is one object for the process, on purpose: ``is_in_recompute()`` and nested regions must be answerable
from any code on the thread without a handle. The per-run state inside it is thread-local; shared by every thread
are only the warn-once log (``ENGINE.warnings``: an engine warning is logged once per process and key, see
``logs.OnceLogger``) and the Dropout formula check (a fact of the installed MindSpore, cached per dtype and
keep_prob).
"""
import logging
import threading

from ..logs import OnceLogger
from . import messages
from .random_ops import DropoutFormulaCheck

# What a run of a region's function is doing.
FORWARD, RECOMPUTE, REPLAY = "forward", "recompute", "replay"


class _ThreadState(threading.local):
    def __init__(self):   # run in each thread on its first access
        self.runs = []
        self.recompute_depth = 0


class EngineState:
    def __init__(self):
        self._local = _ThreadState()
        self.warnings = OnceLogger(logging.getLogger("mindformers_ac.recompute"))
        self.dropout_formula_ok = DropoutFormulaCheck()

    def top(self):
        runs = self._local.runs
        return runs[-1] if runs else None

    def forward_runs(self):
        """The forwards running on this thread, innermost last."""
        return [run for run in self._local.runs if run.mode == FORWARD]

    def push(self, run):
        self._local.runs.append(run)

    def pop(self, run):
        runs = self._local.runs
        if not runs or runs[-1] is not run:
            raise messages.stack_corrupted()
        runs.pop()

    def in_recompute(self):
        return self._local.recompute_depth > 0

    def enter_recompute(self):
        self._local.recompute_depth += 1

    def exit_recompute(self):
        self._local.recompute_depth -= 1


ENGINE = EngineState()
