"""The keywords PyTorch's and HyperParallel's ``checkpoint`` take, and the checks of a checkpoint's arguments.

Code ported from PyTorch passes ``use_reentrant=False`` on every call, and
HyperParallel's tests pass ``preserve_rng_state``, ``determinism_check``,
``debug`` and ``early_stop``. ``checkpoint`` and ``checkpoint_wrapper`` take
them by name (they are not handed to the user's function; every other
keyword of ``checkpoint`` is). What each means here:

* ``use_reentrant``: False (or None) is what this engine is (non-reentrant:
  saved-tensor hooks and a re-run in backward); True is a ValueError.
* ``preserve_rng_state``: True (the default) is what the engine always does,
  more strictly than PyTorch: a random op is never drawn again in the re-run
  (its output, or Dropout's mask, is kept) and the seed state is set back for
  the re-run and restored after it. False asks for less and gets the same
  exact gradients.
* ``determinism_check``: ``"default"`` (the engine checks that the re-run
  saves what the forward saved, shapes and dtypes, and takes the same code
  path) or ``"none"``. The checks can't be turned off: a re-run that diverged
  would hand backward wrong tensors, so ``"none"`` keeps them.
* ``debug``: True records both runs' ops (name, cell path, the Python line
  that ran it) and a diverging re-run's error shows them side by side
  (``debug_log``); the region then takes the intercepting path. For finding
  a bug: it costs a frame walk per op.
* ``early_stop``: True (PyTorch's default): a re-run on the intercepting
  path stops once the last op that left a dropped tensor has run (its
  trailing ops and code are not run again; ``RecomputeStats.early_stops``
  counts it); False runs the whole function. The light path always runs the
  whole function (its output probe checks the re-run's output), and so does a
  call that checks its signature for it, a layer group member, a region with
  nested regions or inner gradients, and a re-run whose stop would unwind a
  mixed-precision cell call (``Region.may_stop``).

A value of the wrong type or outside these is a ValueError naming the option
(HyperParallel's tests expect ValueError for ``use_reentrant=True``,
``early_stop=1``, ``preserve_rng_state=1``, ``determinism_check="invalid"``).
"""
import re

from ..checkpoint_policy import check_policy_fn
from ..errors import quote

_DETERMINISM_CHECKS = ("default", "none")
TORCH_OPTIONS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop")


class CheckpointOptions:
    """PyTorch's checkpoint keywords, checked (see the module docstring)."""

    __slots__ = ("preserve_rng_state", "determinism_check", "debug", "early_stop")

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
        self.preserve_rng_state, self.determinism_check = preserve_rng_state, determinism_check
        self.debug, self.early_stop = debug, early_stop


def take_options(where, kwargs):
    """Pop PyTorch's checkpoint keywords from ``kwargs`` (the rest go to the user's function) and check them."""
    found = {name: kwargs.pop(name) for name in TORCH_OPTIONS if name in kwargs}
    return CheckpointOptions(where, **found)


def check_exclude_args(names, path_patterns, base_policy):
    """``exclude_policy``'s arguments: lists of strings (and valid regexes), a callable base policy.

    Returns ``(names, compiled patterns)`` as tuples. TypeError / ValueError name the argument and the
    bad item.
    """
    checked = []
    for arg, items in (("names", names), ("path_patterns", path_patterns)):
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
        checked.append(items)
    names, path_patterns = checked
    compiled = []
    for p in path_patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ValueError(f"exclude_policy(path_patterns=...): {quote(p)} is not a valid regex ({exc})") from None
    check_policy_fn("exclude_policy", base_policy, arg="base_policy")
    return names, tuple(compiled)
