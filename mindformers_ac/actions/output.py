"""Output recompute: the ops ``recompute_comm.select_module`` names (collectives, ``_comm_ops`` slots).

The op's output is not kept for backward: it is rebuilt there from the op's inputs
(``recompute.wrap_op_output``). ``SelectRecompute`` installs an op target of ``select_module`` the same
way (``install_op_output``).
"""
import logging

from ..errors import item_field
from ..recompute import wrap_op_output
from ..whitelist import sub_cell
from .base import RECOMPUTED, Action, ListFragment, Target, place

logger = logging.getLogger("mindformers_ac")


class OutputRecompute(Action):
    """``paths``: the op paths of one layer whose outputs are recomputed (entries in ``LayerPlan.targets``)."""

    name = "comm recompute"
    config_field = "recompute_comm.select_module"
    recomputes = True

    def __init__(self, paths=()):
        self.paths = tuple(paths)

    @classmethod
    def plan(cls, planning):
        """Ops only (a cell or method is warned about and left out); an op already inside a recompute
        region of its layer is recomputed with it."""
        rcc = planning.config.recompute_comm
        if not rcc.enabled:
            return
        for pattern, specs in rcc.select_module.items():
            field_path = item_field("recompute_comm.select_module", pattern)
            for i, entries in planning.match(field_path, pattern, specs).items():
                lp = planning.plans[i]
                for entry in entries:
                    if entry.is_method:
                        planning.warn(f"{field_path}: {entry.path} in layer {i} is a method, not a communication "
                                      f"operation; name the collective's op or _comm_ops slot (not effective)")
                    elif not entry.is_op:
                        planning.warn(f"{field_path}: {entry.path} in layer {i} is expected to be "
                                      f"operation but got cell, this configuration will not be effective")
                    elif place(planning, i, op_output_target(entry, i), field_path):
                        action = next((a for a in lp.actions if isinstance(a, cls)), None)
                        if action is None:
                            action = cls()
                            lp.actions.append(action)
                        action.paths += (entry.path,)
                        lp.targets[entry.path] = entry

    def targets(self, lp):
        return [op_output_target(lp.targets[p], lp.layer_id) for p in self.paths]

    def facts(self):
        return {"recompute_comm": self.paths}

    def describe(self):
        return ["comm recompute " + ", ".join(self.paths)]

    def table_cells(self, plan):
        return {"comm recompute": ", ".join(self.paths)}

    def summary(self, plan):
        return self.name, ", ".join(self.paths)

    def yaml_lists(self):
        return [ListFragment("comm_select", paths=self.paths)]

    def install(self, state, lp, layer, model):
        stats = state.stats_for(lp.layer_id)
        for path in self.paths:
            install_op_output(state, lp, layer, lp.targets[path], stats)
        logger.debug("Set comm recompute at layer %s: %s", lp.label, ", ".join(self.paths))


def op_output_target(entry, layer_id):
    """The target of an op whose output is recomputed: the op, patched on the cell that holds it."""
    return Target(entry.path, entry.owner_path, RECOMPUTED, False, f"output recompute of op '{entry.path}' in "
                                                                  f"layer {layer_id}")


def install_op_output(state, lp, layer, entry, stats):
    """The output of op ``entry`` of ``layer`` is recomputed in backward; its undo goes to ``state``. An op
    that saved nothing in its first training step is retired by the engine, and noted on ``lp`` (the plan's
    table and ``explain`` show it) with why."""
    owner = sub_cell(layer, entry.owner_path)

    def retired(why):
        lp.notes = lp.notes + (f"output recompute of op '{entry.path}' is not in effect: taken off after the "
                               f"first training step, nothing re-runs it ({why})",)
    # TODO(lead): context_fn for output recompute
    handle = wrap_op_output(owner, entry.attr, stats=stats, registry=entry.registry or None, scope=layer,
                            on_retire=retired)
    state.add_undo(handle.remove)
