"""Full-match path patterns against a layer's whitelist, safely.

Patterns come from user YAML, so they are bounded twice:

* at compile time (``check_pattern``): at most ``MAX_PATTERN_CHARS`` characters
  and counted repetitions whose bounds multiply to at most
  ``MAX_REPEAT_PRODUCT``, because ``regex`` expands ``{m,n}`` when compiling;
* at match time (``MatchBudget``): all matches of one planning pass share one
  time budget, so a catastrophic pattern (``(a|aa)+b``) fails once, after
  ``MATCH_BUDGET_S`` in total, not after a timeout per path.

Exceeding either is a ``ConfigError`` that names the pattern's field.
"""
import time

import regex

from .errors import ConfigError, clip, quote, type_name
from .limits import MATCH_BUDGET_S, MAX_PATTERN_CHARS, MAX_REPEAT_PRODUCT
from .whitelist import is_under

# Every brace group of digits counts, wherever it is (inside a class, after an
# escape): over-counting only rejects patterns no layer path needs, while
# parsing the pattern exactly would mean re-implementing regex's grammar.
_COUNTED_REPEAT = regex.compile(r"\{\s*([0-9]*)\s*(?:,\s*([0-9]*)\s*)?\}")


def check_pattern(pattern, field):
    """Check a ``select_module`` / ``exclude_op`` / ``op_name`` regex and return it compiled.

    Raises ``ConfigError`` naming ``field`` when ``pattern`` is not a non-empty
    string, is longer than ``MAX_PATTERN_CHARS``, has counted repetitions whose
    bounds multiply past ``MAX_REPEAT_PRODUCT``, or does not compile.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(field, f"expected a non-empty regex string, got {type_name(pattern)} {quote(pattern)}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ConfigError(field, f"pattern is {len(pattern)} characters long, more than the limit of "
                                 f"{MAX_PATTERN_CHARS}: {quote(pattern)}")
    product = 1
    for match in _COUNTED_REPEAT.finditer(pattern):
        digits = [d for d in match.groups() if d]
        if digits:
            product *= max(1, *(int(d) if len(d) <= 9 else MAX_REPEAT_PRODUCT + 1 for d in digits))
        if product > MAX_REPEAT_PRODUCT:
            raise ConfigError(field, f"counted repetitions ({{m,n}}) in {quote(pattern)} multiply to more "
                                     f"than the limit of {MAX_REPEAT_PRODUCT} (regex expands them when "
                                     f"compiling); use + or * instead")
    try:
        return regex.compile(pattern)
    except (regex.error, ValueError, OverflowError, RecursionError) as exc:
        raise ConfigError(field, f"invalid regex {quote(pattern)}: {clip(exc)}") from None


class MatchBudget:
    """One budget of matching time shared by every match of a planning pass.

    Only the time spent inside matches counts (not building whitelists between
    them). Each match runs with what is left as its ``regex`` timeout, which
    ``regex`` measures in CPU time; when the budget is spent, the match in
    progress raises ``ConfigError`` naming its field. Create one per pass.
    """

    def __init__(self, seconds=MATCH_BUDGET_S):
        self.seconds = seconds
        self.spent = 0.0

    def fullmatch(self, compiled, path, field):
        start = time.monotonic()
        try:
            if self.spent >= self.seconds:
                raise TimeoutError
            return compiled.fullmatch(path, timeout=self.seconds - self.spent) is not None
        except TimeoutError:
            raise ConfigError(field, f"pattern matching took more than the {self.seconds:g}s budget "
                                     f"of this plan, stopped while matching {quote(compiled.pattern)} "
                                     f"against {quote(path)} (catastrophic backtracking?); simplify "
                                     f"the regex") from None
        finally:
            self.spent += time.monotonic() - start


def match_entries(pattern, entries, field, budget=None):
    """The whitelist entries whose path ``pattern`` fully matches, within ``budget``."""
    compiled, budget = check_pattern(pattern, field), budget or MatchBudget()
    return [entry for entry in entries if budget.fullmatch(compiled, entry.path, field)]


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
