"""The contract every action of a plan keeps: one class per thing the plan does to one layer.

An action is planned from its config section (``plan``), described in the plan's table, its
``summary`` and ``describe`` (so ``explain``, ``apply_ac``'s log and ``train``'s per-layer table say
the same), installed by ``apply_ac`` (``install_all``; every undo goes to the ``AcState``) and written
back as YAML (``yaml_lists``: its share of the per-layer lists ``config.with_layer_lists`` replaces).
``plan.LayerPlan`` holds a layer's actions; ``plan.py``, ``apply.py`` and the planner loop over them
and know no action by name, so a new action is its own module plus a line in ``actions/__init__.py``'s
registry (and its config field).
"""
from typing import NamedTuple


class ListFragment(NamedTuple):
    """One action's share of a per-layer list of the config (an argument of ``config.with_layer_lists``).

    ``paths`` empty: the layer's id goes into the list ``arg`` (``full``, ``layer_swap``); else each path
    is mapped to the layers that name it (``select_module``, ``op_swap`` ...). ``names``: op names that
    hold for every layer (``exclude_op``'s list form).
    """

    arg: str
    paths: tuple = ()
    names: tuple = ()


class Action:
    """One thing the plan does to one layer (``LayerPlan.actions``).

    Class attributes say what kind of thing it is, for the rules across sections: ``recomputes`` /
    ``swaps``, and ``whole_layer`` (the layer is the target, not a module of it). ``name`` is the word the
    plan's one-line summary uses.
    """

    name = ""
    recomputes = False
    swaps = False
    whole_layer = False
    prefetch_layer = None    # the layer whose backward brings this one's activations back (swap)

    def __eq__(self, other):   # plain data: equal plans compare equal (``plan_ac`` twice, sections or config=)
        return type(self) is type(other) and vars(self) == vars(other)

    __hash__ = None

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    @classmethod
    def plan(cls, planning):
        """Add this action to every layer of ``planning.plans`` its config section names, checking the
        section's rules and those against the actions already planned (``plan._PlanPass``)."""
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
