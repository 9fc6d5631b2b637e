"""The actions a plan can take on a layer, one class each (the contract is ``base.Action``).

``ACTIONS`` is the order they are planned and installed in: the recompute section first (groups after
the full recompute they are made of; select last, as it ends the section with ``exclude_op``), then
output recompute, which skips ops already inside a region, then swap, which refuses what is recomputed.

| action | config | module |
| --- | --- | --- |
| full recompute | ``recompute.full_recompute_layer`` (+ ``exclude_op``) | ``full.py`` |
| group recompute | ``recompute.group_layers`` | ``group.py`` (engine: ``recompute/chain.py``) |
| select recompute | ``recompute.select_module`` (+ ``exclude_op``) | ``select.py`` |
| output recompute | ``recompute_comm.select_module`` | ``output.py`` |
| layer swap | ``swap.layer_swap`` | ``layer_swap.py`` |
| op swap | ``swap.op_swap`` | ``op_swap.py`` |

``base.py`` holds the contract (``Action``; ``Target``, what an action acts on, which ``model_checks``
checks; ``OVERLAPS``, the one table of rules between actions), ``region.py`` what full and select share (the region, ``exclude_op``), ``swap_section.py`` what
the two swaps share (the section's rules, the executor).
"""
import regex

from ..layer_specs import format_layer_specs
from .base import Action, ListFragment, check_overlaps
from .full import FullRecompute
from .group import GroupRecompute
from .layer_swap import LayerSwap
from .op_swap import OpSwap
from .output import OutputRecompute
from .select import SelectRecompute

ACTIONS = (FullRecompute, GroupRecompute, SelectRecompute, OutputRecompute, LayerSwap, OpSwap)

# the plan's table: one row per layer, each action fills its cells (two on one layer share a cell)
TABLE_COLUMNS = ("recompute", "comm recompute", "keep (exclude_op)", "swap", "prefetch at")


def layer_lists(layer_plans):
    """The per-layer lists of ``config.with_layer_lists`` that reproduce ``layer_plans``' actions."""
    ids, by_path, names = {}, {}, {}
    for lp in layer_plans:
        for action in lp.actions:
            for fragment in action.yaml_lists():
                if fragment.names:
                    names.setdefault(fragment.arg, {}).update(dict.fromkeys(fragment.names))
                elif fragment.paths:
                    paths = by_path.setdefault(fragment.arg, {})
                    for path in fragment.paths:
                        paths.setdefault(regex.escape(path, special_only=True), []).append(lp.layer_id)
                else:
                    ids.setdefault(fragment.arg, []).append(lp.layer_id)
    lists = dict(ids)
    lists.update({arg: {path: format_layer_specs(i) for path, i in paths.items()}
                  for arg, paths in by_path.items()})
    lists.update({arg: list(found) for arg, found in names.items()})
    return lists


__all__ = ["ACTIONS", "TABLE_COLUMNS", "Action", "FullRecompute", "GroupRecompute", "LayerSwap", "ListFragment",
           "OpSwap", "OutputRecompute", "SelectRecompute", "check_overlaps", "layer_lists"]
