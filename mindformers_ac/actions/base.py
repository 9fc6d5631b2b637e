"""The contract every action of a plan keeps: one class per thing the plan does to one layer.

An action is planned from its config section (``plan``), described in the plan's table, its
``summary`` and ``describe`` (so ``explain``, ``apply_ac``'s log and ``train``'s per-layer table say
the same), installed by ``apply_ac`` (``install_all``; every undo goes to the ``AcState``) and written
back as YAML (``yaml_lists``: its share of the per-layer lists ``config.with_layer_lists`` replaces).

It also says what it acts on: ``targets`` (the cells of the layer it patches, each a ``Target``), which
``model_checks`` passes through every check (jit, ``Cell.recompute()``, the user's wrappers, shared
cells), and which ``place`` compares with the targets of the actions planned before it by one table
(``OVERLAPS``: covered, or refused and why; ``check_overlaps`` applies the refusals once more when every
action is planned). ``facts`` is its share of the ``LayerPlan`` attributes (``plan.LAYER_FACTS``: ``full_recompute``,
``op_swap`` ..., read back by ``tests/test_actions.py``).

``plan.LayerPlan`` holds a layer's actions; ``plan.py``, ``apply.py`` and ``model_checks.py`` loop over
them and know no action by name (``tests/test_layout.py`` checks it), so a new action is its own module
plus a line in ``actions/__init__.py``'s registry (and its config field). The budget's solver builds
the actions it chooses between (full and select recompute, layer swap) by name: a new action is not a
budget option until it is added there.
"""
import logging
from typing import NamedTuple

from ..errors import ConfigError
from ..whitelist import is_under

logger = logging.getLogger("mindformers_ac")

RECOMPUTED, SWAPPED = "recompute", "swap"   # what an action does to the tensors its targets save


class ListFragment(NamedTuple):
    """One action's share of a per-layer list of the config (an argument of ``config.with_layer_lists``).

    ``paths`` empty: the layer's id goes into the list ``arg`` (``full``, ``layer_swap``); else each path
    is mapped to the layers that name it (``select_module``, ``op_swap`` ...). ``names``: op names that
    hold for every layer (``exclude_op``'s list form).
    """

    arg: str
    paths: tuple = ()
    names: tuple = ()


class Target(NamedTuple):
    """One thing of a layer an action acts on.

    ``path``: what the config names (``''`` the whole layer, else a module, op or method path);
    ``cell_path``: the cell the installer patches (the module itself, or the cell holding the op or method;
    ``''`` the layer); ``effect``: ``RECOMPUTED`` or ``SWAPPED``; ``region``: everything that runs inside the
    cell (or method) is acted on (``False``: one op's output); ``text``: the action on it, for messages
    (``"select recompute of 'mlp' in layer 3"``).
    """

    path: str
    cell_path: str
    effect: str
    region: bool
    text: str

    @property
    def recomputes(self):
        return self.effect == RECOMPUTED

    def overlaps(self, other):
        """Same path, or one inside the other (``''``, the layer, holds every path)."""
        return _within(self.path, other.path) or _within(other.path, self.path)

    def covers(self, other):
        """``other`` is acted on by this target already: the same path, or inside this region."""
        return other.path == self.path or (self.region and _within(other.path, self.path))


def _within(path, root):
    return root == "" or is_under(path, root)


class Overlap(NamedTuple):
    """What happens when a target overlaps a target of the same layer planned before it."""

    refused: bool    # True: ConfigError on the new target's field; False: the new target is dropped if covered
    reason: str      # why (refused), or what is said when it is dropped (covered)
    warn: bool = False   # a covered target is a warning of the plan (else logged at info level)


_SHARED = ("recompute and swap can't share a module (a saved tensor is either rebuilt in backward or fetched back "
           "from host, not both): leave it out of one of the two sections")

# (effect planned before, effect of the new target) -> the rule; the one place where actions meet.
OVERLAPS = {
    (RECOMPUTED, SWAPPED): Overlap(True, _SHARED),
    (SWAPPED, RECOMPUTED): Overlap(True, _SHARED),
    (RECOMPUTED, RECOMPUTED): Overlap(False, "recomputed with that region"),
    (SWAPPED, SWAPPED): Overlap(False, "swapped with it; not effective on its own", warn=True),
}


def place(planning, layer_id, target, field_path):
    """Whether ``target`` is new on layer ``layer_id``, by ``OVERLAPS`` against the targets planned there
    before it: ``False`` when one of them covers it already (said once, unless the same path was just
    named twice); ``ConfigError`` on ``field_path`` when a rule refuses the overlap."""
    lp = planning.plans[layer_id]
    planned = [(before, OVERLAPS[before.effect, target.effect]) for action in lp.actions
               for before in action.targets(lp)]
    for before, rule in planned:   # every refusal first: a covered target may still clash with another
        if rule.refused and before.overlaps(target):
            where = "layer " + str(layer_id) if target.path == "" else f"{target.path} in layer {layer_id}"
            how = " (same module, parent or child)" if target.path and before.path else ""
            raise ConfigError(field_path, f"{where} overlaps {before.text}{how}: {rule.reason}")
    for before, rule in planned:
        if not rule.refused and before.covers(target):
            if before.path != target.path:
                text = f"{field_path}: {target.path} in layer {layer_id} is covered by {before.text} ({rule.reason})"
                if rule.warn:
                    planning.warn(text)
                else:
                    logger.info(text)
            return False
    return True


def check_overlaps(lp):
    """The refusals of ``OVERLAPS`` between the targets of any two actions of ``lp``, whatever planned them:
    behind ``place``, so that an action whose ``plan`` does not place its targets is still refused (on its
    ``config_field``) where it meets another's."""
    for k, before_action in enumerate(lp.actions):
        earlier = before_action.targets(lp)
        for action in lp.actions[k + 1:]:
            for target in action.targets(lp):
                for before in earlier:
                    rule = OVERLAPS[before.effect, target.effect]
                    if rule.refused and before.overlaps(target):
                        raise ConfigError(action.config_field or type(action).__name__,
                                          f"{target.text} overlaps {before.text}: {rule.reason}")


class Action:
    """One thing the plan does to one layer (``LayerPlan.actions``).

    Class attributes say what kind of thing it is: ``recomputes`` / ``swaps`` (``LayerPlan.recomputed`` /
    ``swapped``; what it acts on, the layer or modules of it, is ``targets``). ``name`` is the word the
    plan's one-line summary uses; ``config_field`` the field that plans it, named by a refusal.
    """

    name = ""
    config_field = ""        # the config field that plans it, for errors about it
    recomputes = False
    swaps = False
    prefetch_layer = None    # the layer whose backward brings this one's activations back (swap)

    def __eq__(self, other):   # plain data: equal plans compare equal (``plan_ac`` twice, sections or config=)
        return type(self) is type(other) and vars(self) == vars(other)

    __hash__ = None

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def targets(self, lp):
        """The ``Target``s of this action on layer plan ``lp``: every cell it patches, for ``model_checks``
        and ``place`` (an action that acts on nothing of the layer is no action)."""
        raise NotImplementedError

    def facts(self):
        """This action's share of ``LayerPlan``'s attributes (``plan.LAYER_FACTS``): ``{name: value}``."""
        return {}

    @classmethod
    def plan(cls, planning):
        """Add this action to every layer of ``planning.plans`` its config section names, checking the
        section's rules (``planning`` is ``plan._PlanPass``); each target goes through ``place`` first,
        which applies ``OVERLAPS`` against the actions already planned."""
        raise NotImplementedError

    def describe(self):
        """Short texts for ``LayerPlan.describe`` (``['full recompute', 'keep AllGather']``)."""
        raise NotImplementedError

    def table_cells(self, plan):
        """``{column: text}`` of this action in the plan's table (``actions.TABLE_COLUMNS``)."""
        raise NotImplementedError

    def summary(self, plan):
        """``(action, detail)`` for the plan's one-line summary; layers with equal pairs are listed together."""
        raise NotImplementedError

    def yaml_lists(self):
        """The ``ListFragment``s that write this action back into the config."""
        raise NotImplementedError

    @classmethod
    def table_notes(cls, plan):
        """Lines under the plan's table while a layer has this action (settings of its section)."""
        return []

    @classmethod
    def install_all(cls, state, items, model):
        """Install every ``(layer_plan, action)`` of this class; each undo is added to ``state`` as soon as
        what it undoes exists, so a failure part way leaves nothing ``state.remove()`` can't take back."""
        for lp, action in items:
            action.install(state, lp, state.layer_cells[lp.layer_id], model)

    def install(self, state, lp, layer, model):
        raise NotImplementedError
