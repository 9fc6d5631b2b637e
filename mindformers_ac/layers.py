"""Find a model's transformer layer list and the global ids of its layers.

MindFormers' ``TransformerBlock`` keeps its layers in ``layers`` and, under
pipeline parallelism, holds only ``layer_start``..``layer_end`` of
``config.num_layers`` layers. Other models call the list ``decoder.layers``,
``model.layers``, ``blocks`` or ``h``. Config layer ids are always global.

A multi-token-prediction block (MindFormers' ``mtp_block``, DeepSeek-V3 MTP:
it runs after the decoder, on the last pipeline stage) extends the id space:
MTP layer ``i`` (the i-th cell of the block's layer list) is global layer
``num_layers + i``, after every decoder layer, in forward and in backward order.
"""
from dataclasses import dataclass, field

from mindspore import nn

from .config import check_int
from .errors import ConfigError
from .limits import MAX_LAYERS

CANDIDATE_PATHS = ("layers", "decoder.layers", "model.layers", "model.decoder.layers",
                   "transformer.layers", "transformer.h", "language_model.layers",
                   "encoder.layers", "blocks", "h")
LIST_NAMES = ("layers", "blocks", "h")


@dataclass
class LayerStack:
    """The model's layers on this stage: ``cells[k]`` has global id ``offset + k``; MTP layer ``k``
    (``mtp_cells[k]``) has global id ``num_layers + k``.

    ``num_layers`` counts the decoder layers of the whole model (every stage);
    ``num_mtp_layers`` the MTP layers, also when this stage holds none of them
    (``config.mtp_num_layers`` on a stage without ``mtp_block``), so that
    ``total_layers`` and the bounds of every layer id are the same on every stage.
    """

    cells: list
    path: str
    owner: object
    offset: int
    num_layers: int
    mtp_cells: list = field(default_factory=list)
    mtp_path: str = ""
    mtp_block: object = None
    num_mtp_layers: int = 0
    offset_known: bool = True   # the offset came from ``layer_start`` or ``layer_offset=``, not assumed 0

    @property
    def stage_end(self):
        """One past the last global id on this stage (its MTP layers included)."""
        return self.num_layers + len(self.mtp_cells) if self.mtp_cells else self.offset + len(self.cells)

    @property
    def holds_every_layer(self):
        return self.offset == 0 and len(self.cells) == self.num_layers

    @property
    def total_layers(self):
        return self.num_layers + self.num_mtp_layers

    @property
    def layer_ids(self):
        return list(range(self.offset, self.offset + len(self.cells))) + \
            list(range(self.num_layers, self.num_layers + len(self.mtp_cells)))

    def cell(self, layer_id):
        if layer_id >= self.num_layers:
            return self.mtp_cells[layer_id - self.num_layers]
        return self.cells[layer_id - self.offset]

    def holds(self, layer_id):
        return self.offset <= layer_id < self.offset + len(self.cells) or \
            self.num_layers <= layer_id < self.num_layers + len(self.mtp_cells)

    def is_mtp(self, layer_id):
        return layer_id >= self.num_layers


def _resolve(model, path):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _is_layer_list(obj):
    return isinstance(obj, (nn.CellList, nn.SequentialCell, list, tuple)) and len(obj) > 0 \
        and all(isinstance(c, nn.Cell) for c in obj)


def _search(model):
    for path in CANDIDATE_PATHS:
        if _is_layer_list(_resolve(model, path)):
            return path
    for path, cell in model.cells_and_names():
        if path and path.rsplit(".", 1)[-1] in LIST_NAMES and _is_layer_list(cell):
            return path
    return None


def _config_int(name, *holders):
    for holder in holders:
        value = getattr(getattr(holder, "config", None), name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _config_num_layers(*holders):
    return _config_int("num_layers", *holders)


def _mtp_layers(mtp_block):
    """``(path, cells)`` of an MTP block's layer list: the block itself when it is one, else
    ``mtp_block.layers`` (or another list ``find_layer_stack`` would find)."""
    if _is_layer_list(mtp_block):
        return "mtp_block", list(mtp_block)
    if isinstance(mtp_block, nn.Cell):
        path = _search(mtp_block)
        if path is not None:
            return f"mtp_block.{path}", list(_resolve(mtp_block, path))
    what = f"a {type(mtp_block).__name__} cell with no non-empty layer list" if isinstance(mtp_block, nn.Cell) \
        else type(mtp_block).__name__
    raise ConfigError("mtp_block", f"expected the multi-token-prediction block: a cell holding its layer list "
                                   f"(mtp_block.layers, a CellList) or that list itself, got {what}")


def _add_mtp(stack, model, mtp_block):
    """Extend ``stack`` with the MTP layers (ids ``num_layers + i``); checks that they may be here."""
    configured = _config_int("mtp_num_layers", stack.owner, model)
    configured = configured if configured is not None and configured > 0 else 0
    if mtp_block is None:
        stack.num_mtp_layers = configured
        return stack
    path, cells = _mtp_layers(mtp_block)
    if configured and configured != len(cells):
        raise ConfigError("mtp_block", f"{path} holds {len(cells)} layers, but config.mtp_num_layers is "
                                       f"{configured}; pass the model's own MTP block")
    end = stack.offset + len(stack.cells)
    if end != stack.num_layers:
        raise ConfigError("mtp_block", f"MTP layers follow the last decoder layer, but this stage holds decoder "
                                       f"layers {stack.offset}-{end - 1} of {stack.num_layers}: pass mtp_block "
                                       f"only on the last pipeline stage")
    decoder = {id(c) for c in stack.cells}
    if any(id(c) in decoder for c in cells):
        raise ConfigError("mtp_block", f"{path} holds cells of the decoder's layer list '{stack.path}'; pass the "
                                       f"MTP block (e.g. model.mtp), not the decoder")
    stack.mtp_cells, stack.mtp_path, stack.mtp_block, stack.num_mtp_layers = cells, path, mtp_block, len(cells)
    return stack


def find_layer_stack(model, layers=None, mtp_block=None, layer_offset=None, num_layers=None):
    """Locate the layer list of ``model``.

    ``layers`` may name it (``"decoder.layers"``) or be the list itself; by
    default the common paths in ``CANDIDATE_PATHS`` are tried, then any
    ``CellList`` called ``layers``/``blocks``/``h`` anywhere in the model.
    Raises ``ConfigError`` saying what was searched when nothing is found.

    A pipeline stage's first global id is the list owner's ``layer_start``
    (MindFormers' ``TransformerBlock``), else ``layer_offset``; the whole
    model's layer count is ``config.num_layers``, else ``num_layers``, else
    the stage's end. Where both are given they must agree.
    """
    if not isinstance(model, nn.Cell):
        raise ConfigError("model", f"expected a mindspore.nn.Cell, got {type(model).__name__}")
    if layer_offset is not None:
        check_int(layer_offset, "layer_offset", 0, MAX_LAYERS - 1, " (the global id of the stage's first layer)")
    if num_layers is not None:
        check_int(num_layers, "num_layers", 1, MAX_LAYERS, " (the decoder layers of the whole model)")
    if layers is None:
        path = _search(model)
        if path is None:
            raise ConfigError("model", f"no transformer layer list found in "
                                    f"{type(model).__name__}; searched {', '.join(CANDIDATE_PATHS)} "
                                    f"and any CellList named {'/'.join(LIST_NAMES)}. Pass "
                                    f"layers='path.to.layers' to name it")
    elif isinstance(layers, str):
        path = layers
        if not _is_layer_list(_resolve(model, path)):
            raise ConfigError("layers", f"'{path}' is not a non-empty list of cells in "
                                    f"{type(model).__name__}")
    elif _is_layer_list(layers):
        return _stage(list(layers), "<given>", None, layer_offset, num_layers, (), model, mtp_block)
    else:
        raise ConfigError("layers", f"expected a path string or a list of cells, got "
                                f"{type(layers).__name__}")
    cells = list(_resolve(model, path))
    owner = _resolve(model, path.rsplit(".", 1)[0]) if "." in path else model
    return _stage(cells, path, owner, layer_offset, num_layers, (owner, model), model, mtp_block)


def _stage(cells, path, owner, layer_offset, num_layers, holders, model, mtp_block):
    start = getattr(owner, "layer_start", None)
    start = start if isinstance(start, int) and not isinstance(start, bool) else None
    if start is not None and layer_offset is not None and start != layer_offset:
        raise ConfigError("layer_offset", f"{path} says layer_start={start}, and apply_ac got layer_offset="
                                          f"{layer_offset}: pass the stage's own first layer id, or leave "
                                          f"layer_offset out")
    offset = start if start is not None else layer_offset
    configured = _config_num_layers(*holders) if holders else None
    if configured is not None and num_layers is not None and configured != num_layers:
        raise ConfigError("num_layers", f"config.num_layers is {configured}, and apply_ac got num_layers="
                                        f"{num_layers}: leave num_layers out")
    total = configured or num_layers or (offset or 0) + len(cells)
    if (offset or 0) + len(cells) > total:
        raise ConfigError("model", f"{path} holds {len(cells)} layers from layer {offset or 0}, "
                                   f"more than the model's {total} layers")
    stack = LayerStack(cells, path, owner, offset or 0, total, offset_known=offset is not None)
    return _add_mtp(stack, model, mtp_block)
