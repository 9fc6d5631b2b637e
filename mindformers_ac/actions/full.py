"""Full recompute: the whole layer is one region (``recompute.full_recompute_layer``)."""
import logging

from .base import RECOMPUTED, ListFragment, Target
from .region import RegionAction, install_region

logger = logging.getLogger("mindformers_ac")


class FullRecompute(RegionAction):
    """The layer keeps its inputs only (and the ops ``exclude_op`` keeps); backward re-runs it."""

    name = "full recompute"
    config_field = "recompute.full_recompute_layer"

    @classmethod
    def plan(cls, planning):
        rc = planning.config.recompute
        if not rc.enabled:
            if rc.exclude_op:
                planning.warn("recompute.exclude_op has no effect when recompute.mode is None")
            return
        if rc.full_recompute_layer is None:
            return
        for i in planning.layer_ids(rc.full_recompute_layer, "recompute.full_recompute_layer"):
            if i in planning.plans:
                planning.plans[i].actions.append(cls())

    def targets(self, lp):
        return [Target("", "", RECOMPUTED, True, f"full recompute of layer {lp.layer_id}")]

    def facts(self):
        return {**super().facts(), "full_recompute": True}

    def describe(self):
        return ["full recompute"] + self.keep_parts()

    def table_cells(self, plan):
        return {"recompute": "full", **self.keep_cells()}

    def summary(self, plan):
        return self.name, self.keep_detail()

    def yaml_lists(self):
        return [ListFragment("full")] + self.keep_lists()

    def install(self, state, lp, layer, model):
        install_region(state, layer, self.policy_for(state), state.stats_for(lp.layer_id))
        logger.debug("Set full recompute at layer %s%s", lp.label,
                     f", keeping {', '.join(self.keep)}" if self.keep else "")
