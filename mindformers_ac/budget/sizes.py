"""Memory sizes as users write them (``96MiB``, ``2GiB``, ``0.5x``) and as reports print them.

``parse_budget`` reads ``plan --budget``, ``train --budget`` and the config's
``memory_budget.activations``; it needs no model, so a malformed budget fails
before anything is profiled or installed.
"""
import regex

from ..errors import ConfigError
from ..tensors import MiB

_SIZE = regex.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", regex.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
_MIN_BUDGET = 2 ** 10   # bytes: a smaller --budget is a slip (0.5 for 0.5x), not a size anyone plans for
_SIZE_FORMS = "bytes (1048576), a size with a unit (512MiB, 3GiB, 100KiB, 1.5GB) or a fraction " \
              "of the baseline's peak (0.4x)"


def parse_budget(text, baseline_bytes, field="--budget"):
    """Budget text -> bytes. ``0.4x`` is a fraction of ``baseline_bytes``; errors name ``field``.

    Units: B, KiB, MiB, GiB, TiB (powers of 1024), KB, MB, GB, TB (powers of
    1000), case-insensitive; no unit means bytes. Raises
    ``ConfigError(field, ...)`` naming the accepted forms for anything else,
    for a budget that is not positive, and for a size that no user means as a
    byte count: under 1 KiB (no layer's activations fit; ``0.5`` was meant as
    ``0.5x``, and the message says so) or a fraction of a byte. The text alone
    decides, so ``plan`` calls this before it profiles anything.
    """
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or (unit not in _UNITS and unit != "x"):
        raise ConfigError(field, f"expected {_SIZE_FORMS}; got {text!r}")
    value = float(match.group(1))
    if value <= 0:
        raise ConfigError(field, f"must be positive, got {text!r}")
    if unit == "x":
        return int(value * baseline_bytes)
    size = value * _UNITS[unit]
    if size < _MIN_BUDGET or _UNITS[unit] == 1 and not value.is_integer():
        number = match.group(1)
        what = (f"reads as {size:g} bytes, less than 1 KiB: no model's activations fit in that" if size < _MIN_BUDGET
                else f"reads as {size:g} bytes, not a whole number of bytes")
        meant = (f"did you mean {number}x, a fraction of the baseline's peak?" if value < 1
                 else f"give a size with a unit ({number}MiB, {number}GiB) or a fraction of the baseline's peak "
                      f"(0.5x)")
        raise ConfigError(field, f"{text.strip()!r} {what}; {meant}")
    return int(size)


def format_bytes(n):
    if n >= 2 ** 30:
        return f"{n / 2 ** 30:.2f} GiB"
    return f"{n / MiB:.2f} MiB" if n >= MiB else f"{n / 2 ** 10:.2f} KiB"
