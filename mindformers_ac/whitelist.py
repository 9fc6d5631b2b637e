"""What ``select_module`` patterns can name inside one transformer layer.

A layer's whitelist is every sub-cell path (``self_attention``,
``self_attention.core_attention``, ``mlp.linear_fc1`` ...) and every op path:
callables assigned to a cell instance (Python or ``mint``/``ops`` functions,
``Primitive`` instances, other callable objects) and the slots of a cell's
``_comm_ops`` registry, where tensor-parallel layers register their
collectives (an entry is the op itself, or MindFormers' ``{'fn': op,
'domain': d}`` under a dotted name such as ``output.allreduce``:
``registry_slot``). Then every method path: public methods that the cell's own
classes define (``self_attention.get_query_key_value_tensors``), as
MindFormers' whitelist walker lists them, so a ``select_module`` pattern can
name a method. Methods of MindSpore's classes (``construct``, ``nn.Cell``'s
API, ``nn.Dense.extend_repr`` ...) are not listed, nor names starting with
``_``, nor a name the instance overrides (an instance attribute wins, as in
MindFormers). Settable properties, which MindFormers also lists, are not: a
wrapper installed through a setter can't be told apart from the cell's own
state in a copy, nor reliably taken back. The order is the cell tree's, then
attribute order, then the class's definition order, so it is the same on
every call.
"""
import inspect
from dataclasses import dataclass

from mindspore import Tensor, nn

COMM_OPS_REGISTRY = "_comm_ops"


@dataclass(frozen=True)
class WhitelistEntry:
    """One nameable thing in a layer: ``kind`` is ``"cell"``, ``"op"`` or ``"method"``."""

    path: str
    kind: str
    owner_path: str  # path of the cell that holds it ('' for the layer itself)
    attr: str        # attribute (or registry slot) name on the owner
    registry: str = ""  # '' for an attribute, else the registry's attribute name

    @property
    def is_op(self):
        return self.kind == "op"

    @property
    def is_method(self):
        return self.kind == "method"

    @property
    def cell_path(self):
        """The path of the cell this entry is, or of the cell that holds it (an op's or a method's owner)."""
        return self.path if self.kind == "cell" else self.owner_path


def _join(prefix, name):
    return f"{prefix}.{name}" if prefix else name


def _is_op(cell, name, value):
    if name.startswith("_") or hasattr(type(cell), name):
        return False
    if isinstance(value, (nn.Cell, Tensor, type)):
        return False
    return callable(value)


def registry_slot(registry, name):
    """``(holder, key)`` of the op a registry slot runs: MindFormers' ``register_comm_op`` entries are
    ``{'fn': op, 'domain': d}`` dicts (``_call_comm_op`` calls ``entry['fn']``), other registries hold the
    op itself."""
    entry = registry[name]
    if isinstance(entry, dict) and "fn" in entry:
        return entry, "fn"
    return registry, name


def unusable_registry_op(cell, name, registry=COMM_OPS_REGISTRY):
    """Why ``cell.<registry>[name]`` can't be acted on as an op (a text), or None when it can."""
    table = vars(cell)[registry]
    holder, key = registry_slot(table, name)
    op = holder[key]
    if callable(op):
        return None
    where = f"{registry}[{name!r}]" + ("" if holder is table else f"[{key!r}]")
    return (f"{where} of {type(cell).__name__} is {type(op).__name__}, expected a callable op or a "
            f"{{'fn': callable, 'domain': ...}} entry as MindFormers' register_comm_op makes")


def cell_op_entries(cell, path):
    """Op entries directly on ``cell`` (attributes, then ``_comm_ops`` slots)."""
    entries = [WhitelistEntry(_join(path, name), "op", path, name)
               for name, value in vars(cell).items() if _is_op(cell, name, value)]
    registry = vars(cell).get(COMM_OPS_REGISTRY)
    if isinstance(registry, dict):
        entries += [WhitelistEntry(_join(path, name), "op", path, name, COMM_OPS_REGISTRY)
                    for name in registry]
    return entries


# Set on the instance-level wrapper apply_ac installs for a method target: the name still counts as the
# class's method (the instance attribute is ours, not the model's override).
METHOD_WRAPPER_MARK = "mac_method_wrapper"


def _mindspore_class(cls):
    return (getattr(cls, "__module__", "") or "").split(".")[0] == "mindspore"


def class_method_names(cell):
    """Public methods (functions, static and class methods) defined by ``cell``'s own classes, in MRO
    order then definition order; classes of MindSpore (``nn.Cell``, ``nn.Dense`` ...) are skipped."""
    names = []
    for cls in type(cell).__mro__:
        if cls is nn.Cell or cls is object:
            break
        if _mindspore_class(cls):
            continue
        for name, descriptor in vars(cls).items():
            if name.startswith("_") or name == "construct" or name in names:
                continue
            if inspect.isfunction(descriptor) or isinstance(descriptor, (staticmethod, classmethod)):
                names.append(name)
    return names


def cell_method_entries(cell, path):
    """Method entries of ``cell`` (see ``class_method_names``), minus names the instance overrides
    (an instance attribute, or a child cell of that name)."""
    own, children = vars(cell), cell.name_cells()
    return [WhitelistEntry(_join(path, name), "method", path, name) for name in class_method_names(cell)
            if name not in children and (name not in own or getattr(own[name], METHOD_WRAPPER_MARK, False))]


def as_op_target(entry, layer):
    """``entry`` as an op target when it names a Cell with no parameters and no sub-cells (``nn.SiLU`` as a
    layer's ``activation_func``), else ``entry``.

    Such a cell computes like a function in its place: recomputed as a region it would keep its input
    besides what its consumers keep of its output (a SwiGLU gate, a view of the fc1 output, is copied:
    more than without AC); recomputed as an op, its output is dropped for its consumers too.
    """
    if entry.kind != "cell":
        return entry
    cell = sub_cell(layer, entry.path)
    if cell.name_cells() or next(iter(cell.get_parameters()), None) is not None:
        return entry
    return WhitelistEntry(entry.path, "op", entry.owner_path, entry.attr)


def layer_inventory(layer):
    """Every ``WhitelistEntry`` of ``layer`` in deterministic tree order."""
    entries = []
    for path, cell in layer.cells_and_names():
        if path:
            name = path.rsplit(".", 1)[-1]
            owner = path.rsplit(".", 1)[0] if "." in path else ""
            entries.append(WhitelistEntry(path, "cell", owner, name))
        entries.extend(cell_op_entries(cell, path))
        entries.extend(cell_method_entries(cell, path))
    return entries


def get_single_layer_whitelist(layer):
    """Every cell path, op path and method path inside ``layer`` (see the module docstring)."""
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
