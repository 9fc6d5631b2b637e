"""Layer specs: ``[0-3, 8]`` style lists of layer ids and ranges.

YAML reads ``0-3`` as the string ``"0-3"`` and ``8`` as an int, so a spec list
mixes both. The rules (from MindFormers' ``_validate_layer_specs``): each entry
is a layer id or an inclusive ``start-end`` range with ``start <= end``, the
entries are strictly ascending and do not overlap, and every id lies in
``[0, num_layers - 1]``.
"""
import regex

from .errors import ConfigError

_RANGE = regex.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def _entry_range(entry, field):
    if isinstance(entry, bool) or not isinstance(entry, (int, str)):
        raise ConfigError(field, f"expected a layer id (int) or a 'start-end' string, got "
                                 f"{type(entry).__name__} {entry!r}")
    if isinstance(entry, int):
        if entry < 0:
            raise ConfigError(field, f"layer id must be >= 0, got {entry}")
        return entry, entry
    match = _RANGE.fullmatch(entry)
    if match is None:
        raise ConfigError(field, f"expected a layer id or a 'start-end' range of non-negative "
                                 f"integers such as '0-3', got {entry!r}")
    start = int(match.group(1))
    end = int(match.group(2)) if match.group(2) is not None else start
    if start > end:
        raise ConfigError(field, f"range start must be <= end, got {entry!r}")
    return start, end


def spec_ranges(specs, field):
    """Check the shape of a spec list and return its ``(start, end)`` ranges.

    Everything that can be checked without knowing the model's layer count is
    checked here; ``parse_layer_specs`` adds the bounds.
    """
    if isinstance(specs, (str, int)) or not isinstance(specs, (list, tuple)):
        raise ConfigError(field, f"expected a list of layer ids and 'start-end' ranges such as "
                                 f"[0-3, 8], got {type(specs).__name__} {specs!r}")
    if not specs:
        raise ConfigError(field, "expected at least one layer id or range, got an empty list")
    ranges = []
    for i, entry in enumerate(specs):
        start, end = _entry_range(entry, f"{field}[{i}]")
        if ranges and start <= ranges[-1][1]:
            raise ConfigError(f"{field}[{i}]", f"entries must be strictly ascending and must not "
                                               f"overlap: {entry!r} starts at or before layer "
                                               f"{ranges[-1][1]} covered by the previous entry")
        ranges.append((start, end))
    return ranges


def parse_layer_specs(specs, num_layers, field="layers"):
    """Expand ``specs`` (e.g. ``["0-3", 8]``) into the sorted list of layer ids.

    Raises ``ConfigError`` naming the offending entry (``layers[1]``) for a wrong
    type (bool, float, negative), a malformed range (``"3-"``, ``"a-b"``,
    ``"5-2"``), entries out of order or overlapping, or an id outside
    ``[0, num_layers - 1]``. ``num_layers=None`` skips the bounds check.
    """
    ids = []
    for i, (start, end) in enumerate(spec_ranges(specs, field)):
        if num_layers is not None and end >= num_layers:
            raise ConfigError(f"{field}[{i}]", f"layer {end} is out of range: the model has "
                                               f"{num_layers} layers, valid ids are 0-{num_layers - 1}")
        ids.extend(range(start, end + 1))
    return ids


def format_layer_specs(layer_ids):
    """The inverse of ``parse_layer_specs``: ``[0, 1, 2, 3, 8] -> ['0-3', 8]``."""
    specs, ids = [], sorted(set(layer_ids))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        specs.append(ids[i] if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return specs


def swappable_layers(num_layers, prefetch):
    """Ids of the layers that can be swapped with prefetch distance ``prefetch``.

    Layer i comes back when layer ``i + prefetch`` starts its backward, so
    that layer must exist: ``i + prefetch < num_layers``. ``prefetch`` 0 (load
    on demand, no trigger) allows every layer.
    """
    return range(max(0, num_layers - prefetch)) if prefetch else range(num_layers)
