"""Find a model's transformer layer list and the global ids of its layers.

MindFormers' ``TransformerBlock`` keeps its layers in ``layers`` and, under
pipeline parallelism, holds only ``layer_start``..``layer_end`` of
``config.num_layers`` layers. Other models call the list ``decoder.layers``,
``model.layers``, ``blocks`` or ``h``. Config layer ids are always global.
"""
from dataclasses import dataclass

from mindspore import nn

from .errors import ConfigError

CANDIDATE_PATHS = ("layers", "decoder.layers", "model.layers", "model.decoder.layers",
                   "transformer.layers", "transformer.h", "language_model.layers",
                   "encoder.layers", "blocks", "h")
LIST_NAMES = ("layers", "blocks", "h")


@dataclass
class LayerStack:
    """The model's layers on this stage: ``cells[k]`` has global id ``offset + k``."""

    cells: list
    path: str
    owner: object
    offset: int
    num_layers: int

    @property
    def layer_ids(self):
        return range(self.offset, self.offset + len(self.cells))

    def cell(self, layer_id):
        return self.cells[layer_id - self.offset]

    def holds(self, layer_id):
        return self.offset <= layer_id < self.offset + len(self.cells)


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


def _config_num_layers(*holders):
    for holder in holders:
        value = getattr(getattr(holder, "config", None), "num_layers", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def find_layer_stack(model, layers=None):
    """Locate the layer list of ``model``.

    ``layers`` may name it (``"decoder.layers"``) or be the list itself; by
    default the common paths in ``CANDIDATE_PATHS`` are tried, then any
    ``CellList`` called ``layers``/``blocks``/``h`` anywhere in the model.
    Raises ``ConfigError`` saying what was searched when nothing is found.
    """
    if not isinstance(model, nn.Cell):
        raise ConfigError("model", f"expected a mindspore.nn.Cell, got {type(model).__name__}")
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
        return LayerStack(list(layers), "<given>", None, 0, len(layers))
    else:
        raise ConfigError("layers", f"expected a path string or a list of cells, got "
                                f"{type(layers).__name__}")
    cells = list(_resolve(model, path))
    owner = _resolve(model, path.rsplit(".", 1)[0]) if "." in path else model
    offset = getattr(owner, "layer_start", None)
    offset = offset if isinstance(offset, int) and not isinstance(offset, bool) else 0
    num_layers = _config_num_layers(owner, model) or offset + len(cells)
    if offset + len(cells) > num_layers:
        raise ConfigError("model", f"{path} holds {len(cells)} layers from layer_start={offset}, "
                                f"more than config.num_layers={num_layers}")
    return LayerStack(cells, path, owner, offset, num_layers)
