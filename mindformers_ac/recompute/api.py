"""Policy-driven activation recompute for MindSpore PyNative (HyperParallel's checkpoint API).

``checkpoint(fn, *args)`` runs ``fn`` so that only what a policy says is kept for backward; everything else is
rebuilt, on the first unpack in backward, by running ``fn`` again on its saved inputs, bitwise equal to a run
without recompute. What stays alive between forward and backward (the region's inputs, what the policy keeps,
Dropout masks and copies of written tensors) is counted in ``RecomputeStats`` (an outer saved-tensor hook does not
see inside a region). Every guarantee (random ops, writes: rules W1-W7, inputs tracked as in forward), and every
failure raised instead (``RecomputeError`` in backward, TypeError / ValueError for bad arguments, naming the fix),
is in docs/exactness.md.
"""
import dataclasses
import functools
import re

from mindspore import nn

from ..checkpoint_policy import CheckpointPolicy, check_policy_fn
from ..config import RecomputeConfig
from ..construct_patch import (
    ConstructPatch,
    find_patch,
    mark_wrapped_function,
    refuse_wrapped_function,
    wrapped_function_info,
)
from ..errors import quote
from ..mindspore_compat import uses_native_recompute
from ..swap.api import ManagerSwapExecutor
from ..tensors import root_cell_of
from .keep_sites import decides_by_site
from .markers import check_context_fn, is_in_recompute
from .op_slot import install_dropout_slots
from .path_choice import PathChecks, run_checkpoint, run_region
from .rules.safety_net import SampleIndex
from .side_effects import RebindSlots
from .stats import RecomputeStats
from .tracking import PathTracker

__all__ = ["checkpoint", "checkpoint_wrapper", "exclude_policy", "get_checkpoint_stats", "is_checkpoint_wrapped",
           "is_in_recompute", "unwrap"]


# -- PyTorch's and HyperParallel's checkpoint keywords, and the checks of a checkpoint's arguments ----------
# What each keyword means here, and why True / "none" / False ask for no less exactness: docs/exactness.md,
# "The checkpoint API's keywords". A bad value is a ValueError naming the option, as HyperParallel's tests expect.
_DETERMINISM_CHECKS = ("default", "none")
TORCH_OPTIONS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop")


class CheckpointOptions:
    """PyTorch's checkpoint keywords, checked (see the comment above); only ``debug`` and ``early_stop`` change what
    a region does."""

    __slots__ = ("debug", "early_stop")

    def __init__(self, where, use_reentrant=None, preserve_rng_state=True, determinism_check="default",
                 debug=False, early_stop=True):
        if use_reentrant is not None and not isinstance(use_reentrant, bool):
            raise ValueError(f"{where}: use_reentrant must be False (or left out), got {quote(use_reentrant)}")
        if use_reentrant:
            raise ValueError(f"{where}: use_reentrant=True is not supported: this checkpoint is non-reentrant "
                             "(it saves with saved-tensor hooks and re-runs the function in backward, as "
                             "PyTorch's use_reentrant=False). Pass use_reentrant=False or leave it out.")
        for name, value in (("preserve_rng_state", preserve_rng_state), ("debug", debug),
                            ("early_stop", early_stop)):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {name} must be True or False, got {type(value).__name__} "
                                 f"{quote(value)}")
        if not isinstance(determinism_check, str) or determinism_check not in _DETERMINISM_CHECKS:
            raise ValueError(f"{where}: determinism_check must be one of {', '.join(map(repr, _DETERMINISM_CHECKS))}, "
                             f"got {quote(determinism_check)}")
        self.debug, self.early_stop = debug, early_stop


def _strings(arg, items):
    """``exclude_policy``'s argument ``arg`` as a tuple of strings; a TypeError names it and the bad item."""
    if isinstance(items, (str, bytes)):
        raise TypeError(f"exclude_policy({arg}=...) takes a list of strings, not a string: "
                        f"write {arg}=[{quote(items)}]")
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"exclude_policy({arg}=...) takes a list of strings, got {type(items).__name__} "
                        f"{quote(items)}") from None
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"exclude_policy({arg}=...): item {i} must be a string (an op name"
                            f"{'' if arg == 'names' else ' regex'}), got {type(item).__name__} {quote(item)}")
    return items

_KIND = "checkpoint_wrapper"


def checkpoint(fn, *args, policy_fn=None, swap_inputs=False, context_fn=None, stats=None,
               swap_executor=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` keeping only what ``policy_fn`` says; rebuild the rest in backward.

    ``policy_fn(ctx, op, *op_args, **op_kwargs) -> CheckpointPolicy`` is asked for every op dispatched in ``fn``, in
    forward (the answer applied) and in the re-run; ``ctx`` is an ``OpContext``; legacy ops arrive as ``(primitive,
    name, (inputs...))``. Default: recompute every op. Random ops a second call would not repeat are kept whatever
    the policy says. MUST_SWAP hands the op's saves and output to ``swap_executor`` (``offload(tensor) -> handle``,
    ``load(handle) -> Tensor``; default ``SwapManager``'s); ``swap_inputs=True`` offloads the region's inputs too.
    ``context_fn() -> (forward_ctx, recompute_ctx)``: entered around the forward and its re-run (PyTorch's
    meaning). ``stats``: a ``RecomputeStats`` to count into. PyTorch's and HyperParallel's keywords
    (``use_reentrant=False``, ``preserve_rng_state``, ``determinism_check``, ``debug``, ``early_stop``) are taken
    here (``CheckpointOptions``); other keywords go to ``fn``. A bad argument is a TypeError / ValueError naming it.

    Without gradient recording ``fn`` just runs. Nested regions are replayed by the enclosing re-run (N1); each
    backward that reaches a region re-runs it once (R1): docs/exactness.md, "Higher-order gradients and nested
    regions".
    """
    if not callable(fn):
        raise TypeError(f"checkpoint() needs a callable, got {type(fn).__name__}")
    # PyTorch's keywords are popped: the rest go to fn
    torch_options = CheckpointOptions("checkpoint", **{n: kwargs.pop(n) for n in TORCH_OPTIONS if n in kwargs})
    options = _region_options("checkpoint", torch_options, policy_fn, stats, swap_executor, swap_inputs, context_fn)
    return run_region(fn, args, kwargs, tracker=_tracker_for(root_cell_of(fn), policy_fn), **options)


def _region_options(where, torch_options, policy_fn, stats, swap_executor, swap_inputs, context_fn, settings=None):
    """The keywords of ``checkpoint`` / ``checkpoint_wrapper`` (``where``), checked, as a region's options; the
    ``early_stop`` keyword, when False, is the field of ``settings`` (the ``recompute`` section a region reads). The
    default ``swap_executor`` is stateless: one per call is as cheap as a shared one."""
    check_policy_fn(where, policy_fn)
    check_context_fn(context_fn)
    options = dict(policy_fn=policy_fn, stats=stats if stats is not None else RecomputeStats(),
                   swap_executor=swap_executor if swap_executor is not None else ManagerSwapExecutor(),
                   swap_inputs=swap_inputs, context_fn=context_fn, probe_index=SampleIndex())
    if torch_options.debug:   # the op logs come from the intercepting path
        options["debug"] = True
    if not torch_options.early_stop:
        settings = dataclasses.replace(settings or RecomputeConfig(), early_stop=False)
    if settings is not None:
        options["settings"] = settings
    return options


def _tracker_for(root, policy_fn):
    # Cell paths and op attributes are for the policy; without one, no hooks on every sub-cell.
    return PathTracker(root) if root is not None and policy_fn is not None else None


class _WrapInfo:
    """What ``checkpoint_wrapper`` set up for a cell or function, to report and undo it."""

    __slots__ = ("original", "tracker", "stats", "options", "path_checks", "remove_proxies")

    def __init__(self, original, tracker, stats, options, path_checks=None, remove_proxies=None):
        self.original, self.tracker, self.stats, self.options = original, tracker, stats, options
        self.path_checks, self.remove_proxies = path_checks, remove_proxies   # options["rebind"]: RebindSlots

    def remove(self):
        """``unwrap``'s undo of what was installed besides the construct patch."""
        if self.path_checks is not None:   # first: the tracker's slots hold the keep sites' proxies
            self.path_checks.remove_sites()
        if self.tracker is not None:
            self.tracker.remove()
        if self.remove_proxies is not None:
            self.remove_proxies()
        self.options["rebind"].remove()


def _wrap_info(obj, required=False):
    """What ``checkpoint_wrapper`` set up for ``obj``; None, or (``required``) ValueError, when not wrapped."""
    if isinstance(obj, nn.Cell):
        patch = find_patch(obj, _KIND)
        info = patch.info if patch is not None else None
    else:
        info = wrapped_function_info(obj, _KIND)
    if info is None and required:
        raise ValueError(f"{type(obj).__name__} is not wrapped by checkpoint_wrapper")
    return info


def is_checkpoint_wrapped(cell_or_fn):
    """True if ``checkpoint_wrapper`` wrapped this cell (or returned this function)."""
    return _wrap_info(cell_or_fn) is not None


def get_checkpoint_stats(cell_or_fn):
    """The ``RecomputeStats`` a wrapped cell or function counts into."""
    return _wrap_info(cell_or_fn, required=True).stats


def checkpoint_wrapper(cell_or_fn, *, policy_fn=None, swap_inputs=False, context_fn=None, stats=None,
                       swap_executor=None, light_path=True, chain=None, use_reentrant=None, preserve_rng_state=True,
                       determinism_check="default", debug=False, early_stop=True, settings=None):
    """Make every call of a cell (or function) a ``checkpoint`` region; ``unwrap`` undoes it.

    For an ``nn.Cell`` the *instance's* ``construct`` is wrapped and the cell returned (names and the cell tree are
    unchanged); for a function a new callable is returned. Installed until ``unwrap``: a policy's path hooks on the
    sub-cells, the dropout role of each ``nn.Dropout``'s kernel slot, and the rebinding slots of the root's
    Parameters (rule W4). Wrapping twice, or a cell ``swap_wrapper`` wraps, is a ValueError. Keywords as for
    ``checkpoint``; ``stats`` defaults to a new ``RecomputeStats`` (``get_checkpoint_stats``).

    ``light_path`` (default True): without ``swap_inputs``, and with no ``policy_fn`` or one that
    ``decides_by_site`` (``exclude_policy``'s), later calls of a call signature whose first call the intercepting
    path showed safe run with saved-tensor hooks only (docs/exactness.md, "The light path"). ``chain``:
    ``(LayerChain, index)`` of a layer group member, whose first argument is rebuilt from the previous member.
    ``settings``: the ``recompute`` section (``RecomputeConfig``) the region reads (default: its defaults).
    """
    torch_options = CheckpointOptions("checkpoint_wrapper", use_reentrant, preserve_rng_state, determinism_check,
                                      debug, early_stop)
    options = _region_options("checkpoint_wrapper", torch_options, policy_fn, stats, swap_executor, swap_inputs,
                              context_fn, settings)
    if is_checkpoint_wrapped(cell_or_fn):
        raise ValueError(f"{type(cell_or_fn).__name__} is already wrapped by checkpoint_wrapper; "
                         "unwrap() it first to change its options")
    options["chain"] = chain
    light = light_path and not swap_inputs and not debug and (policy_fn is None or decides_by_site(policy_fn))
    is_cell = isinstance(cell_or_fn, nn.Cell)
    if not is_cell and not callable(cell_or_fn):
        raise TypeError(f"checkpoint_wrapper needs an nn.Cell or a callable, got {type(cell_or_fn).__name__}")
    if is_cell and uses_native_recompute(cell_or_fn):
        raise ValueError(f"{type(cell_or_fn).__name__} already uses MindSpore's Cell.recompute(); "
                         "the two recompute mechanisms can't be combined on one cell")
    if not is_cell:
        refuse_wrapped_function(cell_or_fn, _KIND)
    root = cell_or_fn if is_cell else root_cell_of(cell_or_fn)
    tracker = _tracker_for(root, policy_fn)
    options["rebind"] = rebind = RebindSlots()   # W4: put on the root's Parameters once, at the end
    checks = PathChecks() if light else None
    if not is_cell:
        @functools.wraps(cell_or_fn)
        def wrapped_fn(*args, **kwargs):
            return run_checkpoint(cell_or_fn, args, kwargs, checks, root, tracker=tracker, **options)
        mark_wrapped_function(wrapped_fn, _KIND, _WrapInfo(cell_or_fn, tracker, options["stats"], options, checks))
        rebind.cover(root.get_parameters() if root is not None else ())
        return wrapped_fn

    def around(inner, *args, **kwargs):
        return run_checkpoint(inner, args, kwargs, checks, root, tracker=tracker, **options)

    patch = ConstructPatch(root, _KIND, around, undo="unwrap()")
    patch.info = _WrapInfo(patch.inner, tracker, options["stats"], options, checks,
                           install_dropout_slots(root) if light else None)
    if tracker is not None:
        tracker.install()
    rebind.cover(root.get_parameters())
    return root


def unwrap(cell_or_fn):
    """Undo ``checkpoint_wrapper``: restore the cell's construct (returns the cell) or return the function."""
    info = _wrap_info(cell_or_fn, required=True)
    info.remove()
    if isinstance(cell_or_fn, nn.Cell):
        find_patch(cell_or_fn, _KIND).remove()
        return cell_or_fn
    return info.original


def exclude_policy(names=(), path_patterns=(), base_policy=None, path_prefix="", observer=None):
    """A ``policy_fn`` that keeps (MUST_SAVE) excluded ops and asks ``base_policy`` (default: recompute) otherwise.

    ``names``: matched case-insensitively as substrings of the op name (``"AllGather"`` matches
    ``InnerCommAllGather``). ``path_patterns``: regexes ``fullmatch``-ed against ``ctx.op_path``
    (``self_attention.core_attention.Softmax``) and ``ctx.attr_path`` (``self_attention.core_attention.softmax``),
    relative to the region root, or to ``path_prefix`` before it. ``observer(ctx)``: told every op asked about
    (``apply_ac`` finds unmatched ``exclude_op`` names with it). Marked ``decides_by_site`` (unless ``base_policy``
    isn't): its regions may keep ops at keep sites on the light path (``keep_sites``). A bad argument is a TypeError
    / ValueError naming it and the bad item.
    """
    lowered = tuple(n.lower() for n in _strings("names", names))
    compiled = []
    for p in _strings("path_patterns", path_patterns):
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ValueError(f"exclude_policy(path_patterns=...): {quote(p)} is not a valid regex ({exc})") from None
    check_policy_fn("exclude_policy", base_policy, arg="base_policy")

    def policy(ctx, op, *args, **kwargs):
        if observer is not None:
            observer(ctx)
        name = ctx.op_name.lower()
        if any(n in name for n in lowered):
            return CheckpointPolicy.MUST_SAVE
        if compiled:
            paths = [p if not path_prefix else f"{path_prefix}.{p}" for p in (ctx.op_path, ctx.attr_path)
                     if p is not None]
            if any(p.fullmatch(path) for p in compiled for path in paths):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE if base_policy is None else base_policy(ctx, op, *args, **kwargs)

    policy.exclude_names = lowered
    policy.exclude_patterns = tuple(p.pattern for p in compiled)
    # Its answers depend on the op's name and place only (and base_policy's, if that says so too): a
    # wrapper may install them where the ops are reached and take the light path (keep_sites).
    policy.decides_by_site = base_policy is None or decides_by_site(base_policy)
    return policy
