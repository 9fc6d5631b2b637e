"""Full-match path patterns against a layer's whitelist, safely.

Patterns come from user YAML, so a pathological one (``(a+)+$``) must not hang
training start-up: every match runs with a timeout and a pattern that exceeds
it is rejected with a ``ConfigError`` that names the field.
"""
import regex

from .errors import ConfigError
from .whitelist import is_under

MATCH_TIMEOUT_S = 0.5


def fullmatch(pattern, path, field):
    try:
        return regex.fullmatch(pattern, path, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        raise ConfigError(field, f"pattern {pattern!r} took more than {MATCH_TIMEOUT_S}s to match "
                                 f"{path!r} (catastrophic backtracking); simplify the regex") from None


def match_entries(pattern, entries, field):
    """The whitelist entries whose path ``pattern`` fully matches."""
    return [entry for entry in entries if fullmatch(pattern, entry.path, field)]


def drop_covered(entries):
    """Remove entries that lie inside another entry: a chosen parent covers its children."""
    paths = [entry.path for entry in entries]
    kept, seen = [], set()
    for entry in entries:
        if entry.path in seen:
            continue
        if any(other != entry.path and is_under(entry.path, other) for other in paths):
            continue
        seen.add(entry.path)
        kept.append(entry)
    return kept
