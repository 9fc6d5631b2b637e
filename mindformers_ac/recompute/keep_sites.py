"""Where an excluded op is reached, a *keep site*, so that the light path can keep it without intercepting every op
(what qualifies, and why no Python frame is read: docs/exactness.md, "The light path").

``attr``: the innermost op slot with the track role (an op attribute, or an op of a ``_comm_ops`` registry);
``item``: a Primitive held in a dict attribute or by a dict-held cell. The site's ``OpSlot`` gets the keep role
(``LightRegion.keep_call``) from ``path_choice.CheckRecorder``.
"""
import collections

from mindspore import nn
from mindspore.ops import Primitive

from .dispatch import OP_NAME_ATTR
from .op_slot import OpSlot, release, slot_at

_NO_SLOT = ("it is not called through an op attribute of the region's cells (a function called by its global "
            "name, a Tensor method or an operator: no slot can hold a proxy for it)")


def decides_by_site(policy_fn):
    """Whether ``policy_fn`` says its answers depend on the op's name and place only (``exclude_policy``'s do): its
    kept ops may then be installed at their keep sites."""
    return getattr(policy_fn, "decides_by_site", False) is True


# One place an excluded op is reached (see the module docstring); ``key`` identifies it.
Site = collections.namedtuple("Site", "kind key cell where callee description")

# An op reached where no proxy can stand; ``why`` says where, for ``intercept_reasons``. ``held``: the object whose
# ``id`` is in ``key``, kept alive until the check ends, so that no object made later in the same forward (a primitive
# built on first use) takes its address and its key.
NoSite = collections.namedtuple("NoSite", "key why held")


def region_cells(root):
    """``(id -> cell, id -> path)`` of the cells a region rooted at ``root`` runs: its sub-cells, and cells held in
    dict attributes (MindFormers' ``_comm_ops`` slots, which the cell tree does not list)."""
    cells, paths = {}, {}
    todo = [("", root)] if root is not None else []
    while todo:
        prefix, top = todo.pop()
        for name, cell in top.cells_and_names():
            if id(cell) in cells:
                continue
            path = f"{prefix}.{name}" if prefix and name else (prefix or name)
            cells[id(cell)], paths[id(cell)] = cell, path
            for attr, value in vars(cell).items():
                if isinstance(value, dict):
                    todo.extend((f"{path + '.' if path else ''}{attr}[{k!r}]", v) for k, v in value.items()
                                if isinstance(v, nn.Cell))
    return cells, paths


def _held_primitives(cells, paths):
    """``(cell, (attr, key or None), primitive, description)`` of every Primitive the region holds outside its cell
    tree's op attributes: in a dict attribute of a region cell (``_prims["AllGather"]``), or as an attribute of a
    cell held in a dict (a ``_comm_ops`` slot's collective). An ``OpSlot`` standing there counts as its Primitive."""
    held = []
    for cell_id, cell in cells.items():
        prefix = paths[cell_id] + "." if paths[cell_id] else ""
        for attr, value in vars(cell).items():
            if isinstance(value, dict):
                held.extend((cell, (attr, k), _inner(v), f"{prefix}{attr}[{k!r}]") for k, v in value.items()
                            if isinstance(_inner(v), Primitive))
            elif "[" in paths[cell_id] and isinstance(_inner(value), Primitive) and not attr.startswith("_"):
                held.append((cell, (attr, None), _inner(value), f"{prefix}{attr}"))
    return held


def _inner(value):
    return value.mac_inner if isinstance(value, OpSlot) else value


def find_site(run, name, args, cells, paths, resolve):
    """The ``Site`` (or ``NoSite``) of op ``name`` being dispatched now in ``run``: the innermost op attribute slot
    running (``run.attrs``), else the held Primitive (``_held_primitives``; ``cells`` / ``paths``: ``id`` -> cell /
    its path) it ran: the one a legacy op was dispatched with, or else the only one of the op's name (a pyboost op is
    dispatched without its Primitive). Without ``resolve`` only the key is sure: enough to tell which site a
    recomputed op runs under.
    """
    if run.attrs:
        slot, path = run.attrs[-1]
        return Site("attr", ("slot", id(slot)), None, slot, None, f"attribute {path}")
    prim = args[0] if args and isinstance(args[0], Primitive) else None
    key = ("none",) if prim is None else ("prim", id(prim))
    if not resolve:
        return NoSite(key, "", prim)
    held = _held_primitives(cells, paths)
    found = [h for h in held if h[2] is prim] if prim is not None else \
        [h for h in held if (getattr(h[2], OP_NAME_ATTR, None) or h[2].name) == name]
    if len(found) != 1:
        why = _NO_SLOT if not found else f"{len(found)} primitives named {name} are held by the region's cells"
        return NoSite(key, why, prim)
    cell, where, prim, description = found[0]
    return Site("item", ("prim", id(prim)), cell, where, prim, description)


def install_site(site, installed):
    """Give the ``OpSlot`` at ``site`` the keep role; returns it, or None when the site can't take it now.

    ``installed``: site key -> (slot, undo) of the wrapper, shared by its signatures.
    """
    held = installed.get(site.key)
    if held is not None:
        return held[0]
    if site.kind == "attr":
        slot, holder, key = site.where, None, None
    else:
        attr, k = site.where
        holder, key = (site.cell, attr) if k is None else (vars(site.cell).get(attr), k)
        table = vars(holder) if k is None else holder
        if not isinstance(table, dict) or _inner(table.get(key)) is not site.callee:
            return None
        slot = slot_at(holder, key)
    if slot.mac_keep is not None:   # kept for another wrapper's signature already
        installed[site.key] = (slot, None)
        return slot
    slot.mac_keep = site.description

    def undo(slot=slot, holder=holder, key=key):
        slot.mac_keep = None
        if holder is not None:
            release(holder, key, slot)
    installed[site.key] = (slot, undo)
    return slot
