"""Select recompute: the modules, methods and ops ``recompute.select_module`` names in a layer.

A module's construct, or a method of a module (shadowed on that instance), runs as a region; an op
(an op attribute, a ``_comm_ops`` slot, or a module with no parameters and no sub-cells, such as an
``nn.SiLU`` activation) has its output recomputed, as ``OutputRecompute`` does.
"""
import logging

from ..config import RecomputeMode
from ..construct_patch import drop_on_copy, hold_copy_hook, release_copy_hook
from ..errors import item_field
from ..matching import drop_covered
from ..recompute import checkpoint_wrapper, unwrap
from ..whitelist import METHOD_WRAPPER_MARK, as_op_target, sub_cell
from .base import RECOMPUTED, ListFragment, Target, place
from .output import install_op_output
from .region import RegionAction, install_region, plan_keep, region_options

logger = logging.getLogger("mindformers_ac")


class SelectRecompute(RegionAction):
    """``paths``: the layer's select targets, in the layer's tree order (their entries are in
    ``LayerPlan.targets``)."""

    name = "select recompute"
    config_field = "recompute.select_module"

    def __init__(self, paths, keep=(), keep_by_path=False):
        super().__init__(keep, keep_by_path)
        self.paths = tuple(paths)

    @classmethod
    def plan(cls, planning):
        """The select patterns on every layer not fully recomputed; then ``exclude_op`` over every region of
        the recompute section (this is its last action); then a target cell that computes like a function
        becomes an op target, unless ``exclude_op`` keeps ops of it (then it stays a region)."""
        rc = planning.config.recompute
        if not rc.enabled:
            return
        if rc.mode != RecomputeMode.SELECT:
            if rc.select_module:
                planning.warn("recompute.select_module is ignored when recompute.mode is full")
        else:
            chosen = {}
            for pattern, specs in rc.select_module.items():
                field_path = item_field("recompute.select_module", pattern)
                for i, entries in planning.match(field_path, pattern, specs).items():
                    placed = [e for e in entries if place(planning, i, _target(e, i), field_path)]
                    if placed:   # on a fully recomputed layer none is: its region covers them
                        chosen.setdefault(i, []).extend(placed)
            for i, entries in chosen.items():
                order = {e.path: k for k, e in enumerate(planning.inventory(i))}
                kept = drop_covered(sorted(entries, key=lambda e: order[e.path]))
                lp = planning.plans[i]
                lp.actions.append(cls(e.path for e in kept))
                lp.targets.update({e.path: e for e in kept})
        plan_keep(planning)
        for i, lp in planning.plans.items():
            for action in lp.actions:
                if isinstance(action, cls) and not action.keep:
                    layer = planning.stack.cell(i)
                    lp.targets.update({p: as_op_target(lp.targets[p], layer) for p in action.paths})

    def targets(self, lp):
        return [_target(lp.targets[p], lp.layer_id) for p in self.paths]

    def facts(self):
        return {**super().facts(), "recompute": self.paths}

    def describe(self):
        return ["recompute " + ", ".join(self.paths)] + self.keep_parts()

    def table_cells(self, plan):
        return {"recompute": ", ".join(self.paths), **self.keep_cells()}

    def summary(self, plan):
        return self.name, "; ".join(x for x in (", ".join(self.paths), self.keep_detail()) if x)

    def yaml_lists(self):
        return [ListFragment("select_module", paths=self.paths)] + self.keep_lists()

    def install(self, state, lp, layer, model):
        stats = state.stats_for(lp.layer_id)
        for path in self.paths:
            entry = lp.targets[path]
            if entry.is_op:
                install_op_output(state, lp, layer, entry, stats)
            elif entry.is_method:
                # the region is rooted at the method's cell: exclude paths are relative to it
                _install_method(state, layer, entry, self.policy_for(state, entry.owner_path), stats)
            else:
                install_region(state, sub_cell(layer, path), self.policy_for(state, path), stats)
        logger.debug("Set select recompute at layer %s: %s", lp.label, ", ".join(self.paths))


def _target(entry, layer_id):
    """A select target: a module's or a method's region (rooted at its cell), or an op's output."""
    if entry.is_op:
        return Target(entry.path, entry.owner_path, RECOMPUTED, False,
                      f"output recompute of op '{entry.path}' in layer {layer_id}")
    what = "method " if entry.is_method else ""
    return Target(entry.path, entry.cell_path, RECOMPUTED, True,
                  f"select recompute of {what}'{entry.path}' in layer {layer_id}")


def _install_method(state, layer, entry, policy_fn, stats):
    """Shadow method ``entry.attr`` of its owner cell, on the instance, by a region that runs it."""
    owner, name = sub_cell(layer, entry.owner_path), entry.attr
    if name in vars(owner):
        raise ValueError(f"{type(owner).__name__}.{name}: the instance already has an attribute of this name "
                         f"(wrapped twice?)")
    wrapped = checkpoint_wrapper(getattr(owner, name), policy_fn=policy_fn, stats=stats, **region_options(state))
    setattr(wrapped, METHOD_WRAPPER_MARK, True)
    drop_on_copy(wrapped)   # a deep copy of the cell gets its class's method back (construct_patch._scrub)

    held = []

    def undo():
        if owner.__dict__.get(name) is wrapped:
            del owner.__dict__[name]
            unwrap(wrapped)
        if held:
            held.pop()
            release_copy_hook(owner)
    state.add_undo(undo)     # first: an interrupt in the next lines still finds its undo
    hold_copy_hook(owner)    # ... also when only the cell or its layer is copied
    held.append(True)
    object.__setattr__(owner, name, wrapped)   # an instance attribute, as MindFormers shadows a method
