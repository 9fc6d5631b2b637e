"""Op swap: what the modules ``swap.op_swap`` names save for backward goes to host memory, and comes back
when layer ``i + default_prefetch`` starts its backward."""
import logging

from ..matching import drop_covered
from ..swap import install_op_swap
from .base import SWAPPED, Action, ListFragment, Target, place
from .swap_section import prefetch_cell, prefetch_part, prefetch_trigger_of, section_entries, settings_line, swap_engine

logger = logging.getLogger("mindformers_ac")


class OpSwap(Action):
    """``paths``: the module paths of one layer that are swapped (entries in ``LayerPlan.targets``)."""

    name = "op swap"
    config_field = "swap.op_swap"
    swaps = True

    def __init__(self, prefetch_layer, paths=(), next_microbatch=False):
        self.prefetch_layer, self.paths, self.next_microbatch = prefetch_layer, tuple(paths), next_microbatch

    @classmethod
    def plan(cls, planning):
        """Modules only (an op or a method is warned about and left out); one in a layer swapped whole is
        covered, one that is, holds or lies in a recompute target refused (``base.OVERLAPS``)."""
        for k, entry in section_entries(planning, "op_swap"):
            field_path = f"swap.op_swap[{k}]"
            for i in planning.layer_ids(entry.layers, f"{field_path}.layers"):
                if i in planning.plans:   # another stage's layers are that stage's to check
                    prefetch_trigger_of(planning, i, f"{field_path}.layers")
            for i, entries in planning.match(f"{field_path}.op_name", entry.op_name, entry.layers).items():
                cls.add(planning, i, drop_covered(entries), field_path)

    @classmethod
    def add(cls, planning, layer_id, entries, field_path):
        lp = planning.plans[layer_id]
        for entry in entries:
            if entry.is_op or entry.is_method:
                what = "an operation" if entry.is_op else "a method"
                planning.warn(f"{field_path}: {entry.path} in layer {layer_id} is {what}; op_swap "
                              f"swaps what a module saves, name its module instead (not effective)")
                continue
            if place(planning, layer_id, _target(entry.path, layer_id), field_path):
                action = next((a for a in lp.actions if isinstance(a, cls)), None)
                if action is None:
                    trigger = prefetch_trigger_of(planning, layer_id, f"{field_path}.layers")
                    action = cls(trigger, next_microbatch=trigger < layer_id)
                    lp.actions.append(action)
                action.paths += (entry.path,)
                lp.targets[entry.path] = entry

    def targets(self, lp):
        return [_target(path, lp.layer_id) for path in self.paths]

    def facts(self):
        return {"op_swap": self.paths, "prefetch_layer": self.prefetch_layer}

    def describe(self):
        return ["swap " + ", ".join(self.paths), prefetch_part(self)]

    def table_cells(self, plan):
        return {"swap": ", ".join(self.paths), "prefetch at": prefetch_cell(plan, self)}

    def summary(self, plan):
        return self.name, f"{', '.join(self.paths)}; prefetch {plan.config.swap.default_prefetch}"

    def yaml_lists(self):
        return [ListFragment("op_swap", paths=self.paths)]

    @classmethod
    def table_notes(cls, plan):
        return [settings_line(plan)]

    def install(self, state, lp, layer, model):
        plan = state.plan
        engine = swap_engine(state, model)
        inst = install_op_swap(layer, list(self.paths), layer_id=lp.layer_id,
                               prefetch_layer=state.layer_cells[self.prefetch_layer], executor=engine.executor,
                               model=engine.top(plan, model, lp.layer_id), params=engine.params,
                               settings=engine.settings)
        state.add_undo(inst.remove)
        logger.debug("Set op swap at layer %s: %s, prefetched when layer %s starts backward",
                     lp.label, ", ".join(self.paths), plan.layer_label(self.prefetch_layer))


def _target(path, layer_id):
    return Target(path, path, SWAPPED, True, f"op swap of '{path}' in layer {layer_id}")
