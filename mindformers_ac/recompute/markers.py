"""What model code may ask a recompute: whether this is the re-run, and what its own forward left for it.

Two markers answer: ours, ``is_in_recompute()`` (true while a region of this engine re-runs or replays a forward on
this thread), and MindFormers' (``MINDFORMERS_MARKER_MODULE``), true inside the context of its
``recompute_context_fn``, which ``apply_ac`` passes to every region when that module is loaded
(``default_context_fn``). ``save_for_recompute`` / ``get_recompute_metadata`` have MindFormers' semantics; each run
reads the metadata from its start (docs/exactness.md, "Model code that asks the recompute marker", rule W7).
"""
import collections
import importlib
import importlib.util
import logging
import sys

from . import messages
from .state import ENGINE, FORWARD

logger = logging.getLogger("mindformers_ac")

MINDFORMERS_MARKER_MODULE = "mindformers.pynative.distributed.activation_checkpoint"


def is_in_recompute():
    """True only while a backward-time recompute re-runs a forward (per thread)."""
    if not ENGINE.in_recompute():
        return False
    run = ENGINE.top()
    if run is not None:   # the running re-run's code asked: from here it may skip one-shot side effects
        run.asked_marker = True
    return True


def save_for_recompute(key, value):
    """Queue ``value`` under ``key`` for the re-run of the region whose forward is running.

    Returns True when it was saved, False outside a region's forward (no region, or inside a re-run: a re-run
    consumes, it does not save).
    """
    run = ENGINE.top()
    if run is None or run.mode != FORWARD:
        return False
    if run.region.metadata is None:
        run.region.metadata = collections.defaultdict(list)
    run.region.metadata[key].append(value)
    return True


def get_recompute_metadata(key):
    """The next value the forward of the running re-run saved under ``key``; None outside a re-run.

    Raises ``RecomputeError`` when the forward saved nothing (more) under ``key``: repeating the host work silently
    would hide a key or ordering bug in the model.
    """
    run = ENGINE.top()
    if run is None or run.mode == FORWARD or not ENGINE.in_recompute():
        return None
    run.asked_marker = True
    values = run.region.metadata.get(key, ()) if run.region.metadata is not None else ()
    i = run.metadata_read.get(key, 0)
    if i >= len(values):
        raise messages.no_metadata(key)
    run.metadata_read[key] = i + 1
    return values[i]


def default_context_fn():
    """MindFormers' ``recompute_context_fn`` when MindFormers' marker module is loaded or importable, else None.

    Loaded: a MindFormers model imported it for its ``is_in_recompute()``. Importable only: it is imported here; any
    failure to import it (a MindFormers built for another MindSpore) means no bridge, logged at debug level.
    """
    module = sys.modules.get(MINDFORMERS_MARKER_MODULE)
    if module is None:
        try:
            if importlib.util.find_spec("mindformers") is None:
                return None
            module = importlib.import_module(MINDFORMERS_MARKER_MODULE)
        except Exception as exc:   # noqa: BLE001  (an unusable MindFormers: no bridge, not an error)
            logger.debug("MindFormers' recompute marker not bridged: %s: %s", type(exc).__name__, exc)
            return None
    fn = getattr(module, "recompute_context_fn", None)
    return fn if callable(fn) else None


def resolve_context_fn(context_fn):
    """``apply_ac``'s ``context_fn``: None -> ``default_context_fn()``, False -> none, else the callable."""
    if context_fn is False:
        return None
    if context_fn is None:
        return default_context_fn()
    check_context_fn(context_fn)
    return context_fn


def check_context_fn(context_fn):
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"context_fn must be a callable returning (forward_ctx, recompute_ctx), "
                        f"got {type(context_fn).__name__}")


def context_pair(context_fn):
    """Call ``context_fn`` and check it returned two context managers; TypeError naming it otherwise."""
    pair = context_fn()
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in pair)):
        name = getattr(context_fn, "__qualname__", type(context_fn).__name__)
        raise TypeError(f"context_fn {name} must return a pair (forward_ctx, recompute_ctx) of context "
                        f"managers, got {type(pair).__name__}"
                        + (f" of {len(pair)}" if isinstance(pair, (tuple, list)) else ""))
    return pair
