"""What full and select recompute share: a recompute region, and the ops it keeps (``exclude_op``).

``recompute.exclude_op`` is not an action of its own: it changes what the recompute regions of a layer
keep. Its list form names op types for every recomputed layer; its dict form maps module or op paths
to layers. ``plan_keep`` puts it on the region actions, which turn it into the region's ``policy_fn``.
"""
import logging

import regex

from ..errors import item_field
from ..recompute import checkpoint_wrapper, exclude_policy, unwrap
from .base import Action, ListFragment

logger = logging.getLogger("mindformers_ac")

KEEP_COLUMN = "keep (exclude_op)"


class RegionAction(Action):
    """A recompute whose targets run as regions; ``keep`` (op names, or paths when ``keep_by_path``) are the
    ops whose outputs the regions keep instead of rebuilding them."""

    recomputes = True

    def __init__(self, keep=(), keep_by_path=False):
        self.keep, self.keep_by_path = tuple(keep), keep_by_path

    def facts(self):
        return {"exclude": self.keep, "exclude_by_path": self.keep_by_path}

    def keep_parts(self):
        return [f"keep {', '.join(self.keep)}"] if self.keep else []

    def keep_cells(self):
        return {KEEP_COLUMN: ", ".join(self.keep)} if self.keep else {}

    def keep_detail(self):
        return f"keeping {', '.join(self.keep)}" if self.keep else ""

    def keep_lists(self):
        if not self.keep:
            return []
        return [ListFragment("exclude_op", paths=self.keep) if self.keep_by_path
                else ListFragment("exclude_op", names=self.keep)]

    def policy_for(self, state, region_path=""):
        """The policy_fn that keeps the excluded ops inside a region rooted at ``region_path``; op names are
        watched for the model (``state.unmatched_keeps``, ``UnmatchedNames``)."""
        if not self.keep:
            return None
        if not self.keep_by_path:
            if state.unmatched_keeps is None:
                state.unmatched_keeps = UnmatchedNames(self.keep)
            return exclude_policy(names=self.keep, observer=state.unmatched_keeps)
        prefix = region_path + "." if region_path else ""
        patterns = [regex.escape(path[len(prefix):], special_only=True) + r"(\..*)?"
                    for path in self.keep if path.startswith(prefix) and path != region_path]
        return exclude_policy(path_patterns=patterns) if patterns else None


class UnmatchedNames:
    """The list-form ``exclude_op`` names no op of any region matched, each told once in a warning.

    A region's first call runs on the intercepting path, where its policy is asked about every op; the
    first re-run of the model comes after every region's first forward (the first step's backward), so
    that is when a name still unmatched is told: it keeps nothing, and its regions keep what full
    recompute keeps. Names match as ``exclude_policy``'s do (case-insensitive substrings of op names).
    """

    def __init__(self, names):
        self.names = {name.lower(): name for name in names}
        self.matched = set()
        self.told = False

    def __call__(self, ctx):
        if ctx.is_recompute:
            self.tell()
            return
        op = ctx.op_name.lower()
        self.matched.update(n for n in self.names if n not in self.matched and n in op)

    def tell(self):
        if self.told:
            return
        self.told = True
        for lowered, name in self.names.items():
            if lowered not in self.matched:
                logger.warning("recompute.exclude_op: %r matched no op of any recomputed region in the first "
                               "step (names match the dispatched op's name, case-insensitively: MatMul, "
                               "Softmax ...), so it keeps nothing", name)


def region_options(state):
    """What every region ``apply_ac`` installs is given besides its policy: the context and the ``recompute``
    section itself (a setting of it the engine reads needs nothing here)."""
    return dict(context_fn=state.context_fn, settings=state.config.recompute)


def install_region(state, cell, policy_fn, stats, chain=None):
    """``cell``'s construct becomes a recompute region; its undo goes to ``state``."""
    checkpoint_wrapper(cell, policy_fn=policy_fn, stats=stats, chain=chain, **region_options(state))
    state.add_undo(lambda: unwrap(cell))


def plan_keep(planning):
    """``recompute.exclude_op`` onto the region actions planned so far (the recompute section's last step)."""
    exclude_op = planning.config.recompute.exclude_op
    if not exclude_op:
        return
    regions = {i: [a for a in lp.actions if isinstance(a, RegionAction)] for i, lp in planning.plans.items()}
    regions = {i: actions for i, actions in regions.items() if actions}
    if not isinstance(exclude_op, dict):
        names = tuple(dict.fromkeys(str(name) for name in exclude_op))
        for actions in regions.values():
            for action in actions:
                action.keep = names
        return
    for pattern, specs in exclude_op.items():
        field_path = item_field("recompute.exclude_op", pattern)
        for i, entries in planning.match(field_path, pattern, specs).items():
            methods = [e.path for e in entries if e.is_method]
            if methods:
                planning.warn(f"{field_path}: {', '.join(methods)} in layer {i} "
                              f"{'is a method' if len(methods) == 1 else 'are methods'}; exclude_op keeps "
                              f"what ops and modules compute, name the module or the ops the method calls "
                              f"instead (not effective)")
                entries = [e for e in entries if not e.is_method]
            if entries and i not in regions:
                planning.warn(f"{field_path}: layer {i} is not recomputed, "
                              f"so excluding {', '.join(e.path for e in entries)} has no effect")
            elif entries:
                for action in regions[i]:
                    action.keep = action.keep + tuple(e.path for e in entries if e.path not in action.keep)
                    action.keep_by_path = True
