"""What ``select_module`` patterns can name inside one transformer layer.

A layer's whitelist is every sub-cell path (``self_attention``,
``self_attention.core_attention``, ``mlp.linear_fc1`` ...) and every op path:
callables assigned to a cell instance (Python or ``mint``/``ops`` functions,
``Primitive`` instances, other callable objects) and the slots of a cell's
``_comm_ops`` registry, where tensor-parallel layers register their
collectives. Methods of the cell's class (``construct``, inherited ``nn.Cell``
methods) are not ops. The order is the cell tree's, then attribute order, so
it is the same on every call.
"""
from dataclasses import dataclass

from mindspore import Tensor, nn

COMM_OPS_REGISTRY = "_comm_ops"


@dataclass(frozen=True)
class WhitelistEntry:
    """One nameable thing in a layer: ``kind`` is ``"cell"`` or ``"op"``."""

    path: str
    kind: str
    owner_path: str  # path of the cell that holds it ('' for the layer itself)
    attr: str        # attribute (or registry slot) name on the owner
    registry: str = ""  # '' for an attribute, else the registry's attribute name

    @property
    def is_op(self):
        return self.kind == "op"


def _join(prefix, name):
    return f"{prefix}.{name}" if prefix else name


def _is_op(cell, name, value):
    if name.startswith("_") or hasattr(type(cell), name):
        return False
    if isinstance(value, (nn.Cell, Tensor, type)):
        return False
    return callable(value)


def cell_op_entries(cell, path):
    """Op entries directly on ``cell`` (attributes, then ``_comm_ops`` slots)."""
    entries = [WhitelistEntry(_join(path, name), "op", path, name)
               for name, value in vars(cell).items() if _is_op(cell, name, value)]
    registry = vars(cell).get(COMM_OPS_REGISTRY)
    if isinstance(registry, dict):
        entries += [WhitelistEntry(_join(path, name), "op", path, name, COMM_OPS_REGISTRY)
                    for name in registry]
    return entries


def layer_inventory(layer):
    """Every ``WhitelistEntry`` of ``layer`` in deterministic tree order."""
    entries = []
    for path, cell in layer.cells_and_names():
        if path:
            name = path.rsplit(".", 1)[-1]
            owner = path.rsplit(".", 1)[0] if "." in path else ""
            entries.append(WhitelistEntry(path, "cell", owner, name))
        entries.extend(cell_op_entries(cell, path))
    return entries


def get_single_layer_whitelist(layer):
    """Every cell path and op path inside ``layer`` (see the module docstring)."""
    return [entry.path for entry in layer_inventory(layer)]


def is_under(path, ancestor):
    """True if ``path`` is ``ancestor`` or lies inside it (``mlp.linear_fc1`` under ``mlp``)."""
    return path == ancestor or path.startswith(ancestor + ".")


def sub_cell(layer, path):
    """The cell at dotted ``path`` inside ``layer`` (``''`` is the layer itself).

    Raises ValueError naming the missing part and the layer's sub-cell paths.
    """
    cell = layer
    for part in path.split(".") if path else ():
        child = cell.name_cells().get(part) if isinstance(cell, nn.Cell) else None
        if child is None:
            known = sorted(name for name, _ in layer.cells_and_names() if name)
            raise ValueError(f"path {path!r}: no sub-cell {part!r}; sub-cells of this layer: {known}")
        cell = child
    return cell
