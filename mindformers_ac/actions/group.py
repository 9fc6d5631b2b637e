"""Layer groups (``recompute.group_layers: N``, MindSpeed's uniform method): runs of N consecutive
fully recomputed layers are one region each, keeping only the first layer's inputs.

Each member is recomputed as a region that holds the previous member's (``recompute.chain.LayerChain``):
in backward a member's first argument is rebuilt by re-running the members before it.
"""
import logging

from ..layer_specs import format_layer_specs
from ..recompute.chain import LayerChain
from .full import FullRecompute
from .region import install_region

logger = logging.getLogger("mindformers_ac")


class GroupRecompute(FullRecompute):
    """Full recompute of one member of a group; ``group`` is the group's layer ids, in order."""

    config_field = "recompute.group_layers"

    def __init__(self, group, keep=(), keep_by_path=False):
        super().__init__(keep, keep_by_path)
        self.group = tuple(group)

    @classmethod
    def plan(cls, planning):
        """Runs of ``group_layers`` consecutive fully recomputed ids (a gap, the end of a run or the start of
        the MTP layers cuts a group short; a group of one stays a ``FullRecompute``)."""
        size = planning.config.recompute.group_layers
        if size == 1:
            return
        full = sorted(i for i, lp in planning.plans.items()
                      if any(type(a) is FullRecompute for a in lp.actions))
        if not full:
            planning.warn("recompute.group_layers has no effect without recompute.full_recompute_layer")
            return
        runs = []
        for i in full:
            if runs and i == runs[-1][-1] + 1 and planning.is_mtp(i) == planning.is_mtp(runs[-1][-1]):
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            for k in range(0, len(run), size):
                group = tuple(run[k:k + size])
                if len(group) > 1:
                    for i in group:
                        actions = planning.plans[i].actions
                        actions[:] = [cls(group) if type(a) is FullRecompute else a for a in actions]

    def facts(self):
        return {**super().facts(), "group": self.group}

    def label(self):
        return f"group {format_layer_specs(self.group)[0]}"

    def describe(self):
        return [f"full recompute ({self.label()})"] + self.keep_parts()

    def table_cells(self, plan):
        return {**super().table_cells(plan), "recompute": f"full ({self.label()})"}

    def summary(self, plan):
        groups = list(dict.fromkeys(a.group for lp in plan.layers.values() for a in lp.actions
                                    if isinstance(a, GroupRecompute)))
        text = f"groups of {plan.config.recompute.group_layers}: " + \
            ", ".join(str(format_layer_specs(g)[0]) for g in groups)
        return self.name, "; ".join(x for x in (text, self.keep_detail()) if x)

    def install(self, state, lp, layer, model):
        chain = state.chains.setdefault(self.group[0], LayerChain(self.group))
        install_region(state, layer, self.policy_for(state), state.stats_for(lp.layer_id),
                       (chain, self.group.index(lp.layer_id)))
        logger.debug("Set full recompute at layer %s%s, in the group of layers %s", lp.label,
                     f", keeping {', '.join(self.keep)}" if self.keep else "", ", ".join(map(str, self.group)))
