"""Layer specs: ``[0-3, 8]`` style lists of layer ids and ranges.

YAML reads ``0-3`` as the string ``"0-3"`` and ``8`` as an int, so a spec list
mixes both. The rules (from MindFormers' ``_validate_layer_specs``): each entry
is a layer id or an inclusive ``start-end`` range with ``start <= end``, the
entries are strictly ascending and do not overlap, and every id lies in
``[0, num_layers - 1]``.

Specs are untrusted: ranges stay ``(start, end)`` pairs until they have been
checked against their bound (``num_layers``, or ``MAX_LAYERS`` when the model
is not known yet), so ``"0-999999999999"`` is an error, never a huge list.
"""
import bisect

import regex

from .errors import ConfigError, quote
from .limits import MAX_LAYERS

# ASCII digits only: ``\d`` would also take Arabic-Indic or fullwidth digits.
_RANGE = regex.compile(r"[ \t]*([0-9]+)[ \t]*(?:-[ \t]*([0-9]+)[ \t]*)?")
# Longer strings are never valid ranges; the cap keeps int() of their digits cheap.
_MAX_RANGE_CHARS = 64


def _check_id(layer, entry, field):
    if layer >= MAX_LAYERS:
        raise ConfigError(field, f"layer id {layer} in {quote(entry)} is beyond the supported maximum "
                                 f"{MAX_LAYERS - 1} (a model has at most {MAX_LAYERS} layers)")


def _entry_range(entry, field):
    if isinstance(entry, bool) or not isinstance(entry, (int, str)):
        raise ConfigError(field, f"expected a layer id (int) or a 'start-end' string, got "
                                 f"{type(entry).__name__} {quote(entry)}")
    if isinstance(entry, int):
        if entry < 0:
            raise ConfigError(field, f"layer id must be >= 0, got {quote(entry)}")
        _check_id(entry, entry, field)
        return int(entry), int(entry)
    match = _RANGE.fullmatch(entry) if len(entry) <= _MAX_RANGE_CHARS else None
    if match is None:
        raise ConfigError(field, f"expected a layer id or a 'start-end' range of non-negative "
                                 f"integers (ASCII digits) such as '0-3', got {quote(entry)}")
    start = int(match.group(1))
    end = int(match.group(2)) if match.group(2) is not None else start
    if start > end:
        raise ConfigError(field, f"range start must be <= end, got {quote(entry)}")
    _check_id(end, entry, field)
    return start, end


def spec_ranges(specs, field):
    """Check the shape of a spec list and return its ``(start, end)`` ranges.

    Everything that can be checked without knowing the model's layer count is
    checked here, including ids below ``MAX_LAYERS``; ``parse_layer_specs`` adds
    the model's bound. Nothing is expanded.
    """
    if isinstance(specs, (str, int)) or not isinstance(specs, (list, tuple)):
        raise ConfigError(field, f"expected a list of layer ids and 'start-end' ranges such as "
                                 f"[0-3, 8], got {type(specs).__name__} {quote(specs)}")
    if not specs:
        raise ConfigError(field, "expected at least one layer id or range, got an empty list")
    ranges = []
    for i, entry in enumerate(specs):
        start, end = _entry_range(entry, f"{field}[{i}]")
        if ranges and start <= ranges[-1][1]:
            raise ConfigError(f"{field}[{i}]", f"entries must be strictly ascending and must not "
                                               f"overlap: {quote(entry)} starts at or before layer "
                                               f"{ranges[-1][1]} covered by the previous entry")
        ranges.append((start, end))
    return ranges


def check_bounds(ranges, num_layers, field):
    """Raise ``ConfigError`` naming ``field[i]`` for the first range that ends at or past ``num_layers``."""
    for i, (_, end) in enumerate(ranges):
        if end >= num_layers:
            raise ConfigError(f"{field}[{i}]", f"layer {end} is out of range: the model has "
                                               f"{num_layers} layers, valid ids are 0-{num_layers - 1}")


def parse_layer_specs(specs, num_layers, field="layers"):
    """Expand ``specs`` (e.g. ``["0-3", 8]``) into the sorted list of layer ids.

    Raises ``ConfigError`` naming the offending entry (``layers[1]``) for a wrong
    type (bool, float, negative), a malformed range (``"3-"``, ``"a-b"``,
    ``"5-2"``, non-ASCII digits), entries out of order or overlapping, or an id
    outside ``[0, num_layers - 1]``. ``num_layers=None`` checks ids against
    ``MAX_LAYERS`` only. Every bound is checked before anything is expanded, so
    the result has at most ``MAX_LAYERS`` ids.
    """
    ranges = spec_ranges(specs, field)
    if num_layers is not None:
        check_bounds(ranges, num_layers, field)
    return [layer for start, end in ranges for layer in range(start, end + 1)]


class RangeSet:
    """Disjoint ``(start, end)`` layer ranges, each with an owner, kept as ranges (never expanded)."""

    def __init__(self):
        self.starts, self.ends, self.owners = [], [], []

    def first_overlap(self, ranges):
        """``(layer, owner)`` for the first layer of ``ranges`` already in the set, else ``None``."""
        for start, end in ranges:
            k = bisect.bisect_left(self.ends, start)
            if k < len(self.ends) and self.starts[k] <= end:
                return max(start, self.starts[k]), self.owners[k]
        return None

    def add(self, ranges, owner):
        """Add ``ranges``, which must not overlap the set (check with ``first_overlap``)."""
        for start, end in ranges:
            k = bisect.bisect_left(self.ends, start)
            self.starts.insert(k, start)
            self.ends.insert(k, end)
            self.owners.insert(k, owner)


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


def prefetch_trigger_id(layer_id, prefetch):
    """The layer whose backward start fetches swapped layer ``layer_id`` back: layer ``i + prefetch`` (the one
    place the trigger is computed; ``trigger_within`` is its one bound)."""
    return layer_id + prefetch


def trigger_within(layer_id, prefetch, end):
    """Whether layer ``layer_id``'s prefetch trigger is a layer below ``end`` (the model's layer count, or a
    pipeline stage's end): ``i + prefetch < end``."""
    return prefetch_trigger_id(layer_id, prefetch) < end


def swappable_layers(num_layers, prefetch):
    """Ids of the layers that can be swapped with prefetch distance ``prefetch``: those whose trigger
    exists (``trigger_within``). ``prefetch`` 0 (load on demand, no trigger) allows every layer."""
    return [i for i in range(num_layers) if not prefetch or trigger_within(i, prefetch, num_layers)]
