"""Op swap: what the modules ``swap.op_swap`` names save for backward goes to host memory, and comes back
when layer ``i + default_prefetch`` starts its backward."""
import logging

from ..errors import ConfigError
from ..matching import drop_covered
from ..swap import install_op_swap
from ..whitelist import is_under
from .base import Action, ListFragment
from .swap_section import prefetch_cell, prefetch_part, prefetch_trigger_of, section_entries, settings_line, swap_engine

logger = logging.getLogger("mindformers_ac")


class OpSwap(Action):
    """``paths``: the module paths of one layer that are swapped (entries in ``LayerPlan.targets``)."""

    name = "op swap"
    swaps = True

    def __init__(self, prefetch_layer, paths=(), next_microbatch=False):
        self.prefetch_layer, self.paths, self.next_microbatch = prefetch_layer, tuple(paths), next_microbatch

    @classmethod
    def plan(cls, planning):
        """Modules only (an op or a method is warned about and left out); none in a layer swapped whole, and
        none that is, holds or lies in a recompute target."""
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
        if entries and lp.layer_swap:
            planning.warn(f"{field_path}: layer {layer_id} is swapped whole by layer_swap; "
                          f"the op swap of {', '.join(e.path for e in entries)} is covered")
            return
        for entry in entries:
            if entry.is_op or entry.is_method:
                what = "an operation" if entry.is_op else "a method"
                planning.warn(f"{field_path}: {entry.path} in layer {layer_id} is {what}; op_swap "
                              f"swaps what a module saves, name its module instead (not effective)")
                continue
            if lp.full_recompute:
                raise ConfigError(field_path, f"{entry.path} in layer {layer_id} lies in a fully "
                                              f"recomputed layer; recompute and swap can't share a module")
            clash = [t for t in lp.recompute + lp.recompute_comm
                     if is_under(entry.path, t) or is_under(t, entry.path)]
            if clash:
                raise ConfigError(field_path, f"{entry.path} in layer {layer_id} overlaps the recompute "
                                              f"target {clash[0]} (same module, parent or child); "
                                              f"recompute and swap can't share a module")
            if entry.path not in lp.op_swap:
                action = next((a for a in lp.actions if isinstance(a, cls)), None)
                if action is None:
                    trigger = prefetch_trigger_of(planning, layer_id, f"{field_path}.layers")
                    action = cls(trigger, next_microbatch=trigger < layer_id)
                    lp.actions.append(action)
                action.paths += (entry.path,)
                lp.targets[entry.path] = entry

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
                               model=engine.top(plan, model, lp.layer_id), min_bytes=engine.min_bytes,
                               params=engine.params)
        state.add_undo(inst.remove)
        logger.debug("Set op swap at layer %s: %s, prefetched when layer %s starts backward",
                     lp.label, ", ".join(self.paths), plan.layer_label(self.prefetch_layer))
