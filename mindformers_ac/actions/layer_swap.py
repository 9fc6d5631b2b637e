"""Layer swap: everything a layer saves for backward goes to host memory (``swap.layer_swap``), and
comes back when layer ``i + default_prefetch`` starts its backward."""
import logging

from ..swap import install_layer_swap
from .base import SWAPPED, Action, ListFragment, Target, place
from .swap_section import prefetch_cell, prefetch_part, prefetch_trigger_of, section_entries, settings_line, swap_engine

logger = logging.getLogger("mindformers_ac")


class LayerSwap(Action):
    name = "layer swap"
    config_field = "swap.layer_swap"
    swaps = True

    def __init__(self, prefetch_layer, next_microbatch=False):
        # next_microbatch: a pipeline stage's last layer, fetched back by an earlier layer's backward of the
        # next microbatch (``swap_section.prefetch_trigger_of``)
        self.prefetch_layer, self.next_microbatch = prefetch_layer, next_microbatch

    @classmethod
    def plan(cls, planning):
        """Every ``layer_swap`` entry (all of them, where MindFormers applies the first); a layer can't also
        be recomputed (``base.OVERLAPS``)."""
        for k, entry in section_entries(planning, "layer_swap"):
            field_path = f"swap.layer_swap[{k}].layers"
            for i in planning.layer_ids(entry.layers, field_path):
                if i not in planning.plans:   # another stage's layer
                    continue
                trigger = prefetch_trigger_of(planning, i, field_path)
                if place(planning, i, _target(i), field_path):   # else listed twice
                    planning.plans[i].actions.append(cls(trigger, trigger < i))

    def targets(self, lp):
        return [_target(lp.layer_id)]

    def facts(self):
        return {"layer_swap": True, "prefetch_layer": self.prefetch_layer}

    def describe(self):
        return ["layer swap", prefetch_part(self)]

    def table_cells(self, plan):
        return {"swap": "layer", "prefetch at": prefetch_cell(plan, self)}

    def summary(self, plan):
        return self.name, f"prefetch {plan.config.swap.default_prefetch}"

    def yaml_lists(self):
        return [ListFragment("layer_swap")]

    @classmethod
    def table_notes(cls, plan):
        return [settings_line(plan)]

    @classmethod
    def install_all(cls, state, items, model):
        """One installation per call the layers run in (the model's; the MTP block's)."""
        plan, engine = state.plan, swap_engine(state, model)
        by_id = [state.layer_cells.get(i) for i in range(plan.total_layers)]
        layer_ids = [lp.layer_id for lp, _ in items]
        for top in dict.fromkeys(engine.top(plan, model, i) for i in layer_ids):
            ids = [i for i in layer_ids if engine.top(plan, model, i) is top]
            triggers = {lp.layer_id: a.prefetch_layer for lp, a in items if a.next_microbatch}
            inst = install_layer_swap(by_id, ids, executor=engine.executor, model=top, params=engine.params,
                                      triggers=triggers, settings=engine.settings)
            state.add_undo(inst.remove)
        for lp, action in items:
            logger.debug("Set layer swap at layer %s, prefetched when layer %s starts backward",
                         lp.label, plan.layer_label(action.prefetch_layer))


def _target(layer_id):
    return Target("", "", SWAPPED, True, f"layer swap of layer {layer_id}")
