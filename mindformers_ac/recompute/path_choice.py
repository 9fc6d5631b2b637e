"""Which way into the engine a wrapped call takes: the light path, or the op-intercepting region.

A call goes light only after the first call of its *call signature* ran intercepted and showed it safe (what the
signature holds and what going light requires: docs/exactness.md, "The light path"). That checking call's ``Region``
hands what it observes to a ``CheckRecorder``; after its recompute the recorder fills the signature's ``PathCheck``,
which the light path only reads, from one mark, ``Region.intercept`` (see ``CheckRecorder.finish``).

Nothing is raised here. A refused signature stays intercepted; a checking call whose region died without a recompute
is checked again by the next call; past ``PathChecks.MAX_KEYS`` signatures per wrapper, new ones stay intercepted.
The counters a light call can't measure (``ops_forward``, ``ops_rerun``, ``rerun_by_op``, ``dropped_bytes``) are its
checking call's.
"""
import collections
import enum
import logging
import weakref

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor

from ..mindspore_compat import pynative_executor as _executor
from ..precision import cell_precision
from ..tensors import is_tracked, tensors_equal
from . import messages
from . import region as intercepting  # looked up per call: a subclass put there is the one that runs
from .dispatch import REBUILD, SAVE
from .keep_sites import NoSite, find_site, install_site, region_cells
from .light import LightRegion
from .rules.safety_net import SampleIndex
from .state import ENGINE, RECOMPUTE, REPLAY

logger = logging.getLogger("mindformers_ac")


class PathCheck:
    """What the first (intercepted) call of one call signature showed about the region (filled by its
    ``CheckRecorder``; the light path only reads it): ``ok``, None until that call's recompute finished, then whether
    later calls with this signature may take the light path, and what the light path reports in its place."""

    __slots__ = ("fwd", "keys", "ok", "op_names", "op_paths", "n_rerun", "rerun_counts",
                 "n_dropouts", "dropped", "param_ptrs", "params", "buffers", "probe_index", "keep_proxies", "n_kept_ops",
                 "n_kept", "checks", "saved_outputs", "kept_arg_plans", "region_path", "output_op", "_owner")

    def __init__(self):
        self.fwd, self.keys = [], []  # (shape, dtype) and (op index, pack number) of each forward save, in order
        self.ok = None
        self.op_names, self.op_paths = [], {}
        self.n_rerun = self.n_dropouts = self.dropped = 0
        self.rerun_counts = collections.Counter()
        self.param_ptrs = frozenset()
        self.params = ()              # the root's Parameters, whose rebinding in forward is watched
        self.buffers = ()             # the root's non-trainable Parameters, guarded around light re-runs
        self.probe_index = SampleIndex()   # output shape -> the coordinates a safety_net.Sample gathers
        self.region_path = self.output_op = ""   # the region's cell path and its output's op, for messages
        self.keep_proxies = frozenset()   # the OpSlots whose calls a light run keeps (keep_sites)
        self.n_kept_ops = 0           # ops those calls ran in the checking call (kept, not re-run)
        self.n_kept = None            # kept calls of the first light forward; a later one that differs checks again
        self.checks = None            # the PathChecks holding this check (its installed keep sites)
        self.saved_outputs = {}       # output position -> light positions of its saves (held, not rebuilt: W6)
        self.kept_arg_plans = {}      # kept call number -> (saves' metas, argument position per save): K1
        self._owner = None            # weak reference to the checking call's region

    def abandoned(self):
        """A checking call whose region died without a recompute (a forward without backward)."""
        return self.ok is None and (self._owner is None or self._owner() is None)

    def describe_save(self, i):
        """``op #3 MatMulExt (in 'mlp'), its saved tensor #0`` for forward save ``i``, as the checking call numbered
        it."""
        key = self.keys[i] if i < len(self.keys) else None
        if key is None:
            return f"saved tensor #{i}"
        idx, k = key
        return f"op #{idx} {messages.describe_op(self.op_names, self.op_paths, idx)}, its saved tensor #{k}"


class CheckRecorder:
    """Records the checking call of one signature for the light path, apart from the region's per-op decisions and
    replay: the region hands it observations, ``finish`` fills ``check`` from them."""

    __slots__ = ("check", "fwd", "rec", "keys", "sites", "cells", "cell_dropouts")

    def __init__(self, check):
        self.check = check
        self.fwd, self.rec, self.keys = [], [], []   # saves of forward / re-run ((shape, dtype)), forward keys
        self.sites = {}             # with a site policy: op index -> keep_sites.Site / NoSite it ran under
        self.cells = None           # (id -> cell, id -> path) of the root's cells, for find_site
        self.cell_dropouts = set()  # op indices of Dropouts an nn.Dropout's slot ran and the region rebuilds

    def attach(self, region):
        self.check._owner = weakref.ref(region)   # pylint: disable=protected-access

    def note_forward(self, t, key):
        self.fwd.append((tuple(t.shape), t.dtype))
        self.keys.append(key)

    def note_recompute(self, t):
        self.rec.append((tuple(t.shape), t.dtype))

    def note_site(self, run, idx, name, args, kept):
        """Under which keep site op ``idx`` runs (looked up in full for a kept op)."""
        if self.cells is None:
            self.cells = region_cells(run.region.root)
        self.sites[idx] = find_site(run, name, args, *self.cells, resolve=kept)

    def note_cell_dropout(self, region, idx):
        """Op ``idx`` is an nn.Dropout kernel call the region rebuilds: the light path's dropout slot keeps its mask
        bits too, so it does not keep the signature intercepted."""
        self.cell_dropouts.add(idx)
        region.light_reproduces(("op", idx))

    def check_replay(self, run, idx, func, args, kwargs, out):
        """In the re-run: does random op ``idx``, run again from the forward's random state, draw what the forward
        drew? (``ops.dropout`` and other functional random ops make a fresh primitive seeded from MindSpore's seed
        table, which the re-run starts from as the forward did; whether the backend's kernel then repeats its draw
        is measured, not assumed.) The run's result is ours, not the region's: its saves are not filed and its
        output is discarded."""
        if idx in self.cell_dropouts or (args and args[0] is run.region.random.ops[idx]):
            # A primitive a cell holds (nn.Dropout's, or one stored on any cell) draws from its own state,
            # which no RandomState covers: its early launches may repeat, later ones do not.
            return
        run.in_hook = run.noting_replay = True
        try:
            again = func(*args, **kwargs)
            run.noting_replay = False
            if tensors_equal(out, again):
                run.region.light_reproduces(("op", idx))   # a light re-run draws it again from the same state
        except Exception:   # noqa: BLE001  (a kernel that can't be run again simply does not replay)
            pass
        finally:
            run.in_hook = run.noting_replay = False

    def finish(self, region):
        """After the checking call's recompute: may this signature take the light path? Fills ``check``."""
        check, decisions, kept = self.check, region.decisions, region.kept.policy_saves
        # nn.Dropout kernels the light path's dropout slots handle (mask bits): not re-run ops.
        cell_dropouts = {i for i in self.cell_dropouts if decisions.get(i) == REBUILD}
        # a kept op's saves are numbered apart by a light run (its slot's call)
        check.fwd = [m for m, key in zip(self.fwd, self.keys) if key is None or key[0] not in kept]
        check.keys = [key for key in self.keys if key is None or key[0] not in kept]
        if check.fwd != self.rec:
            region.align.keeps_intercepted("saves", "its recompute saved other tensors than its forward")
        proxies, kept_ops = set(), set()
        if kept and all(isinstance(k, tuple) and k[0] == "op" and k[1] in kept for k in region.intercept):
            # only the policy's kept ops stand in the way: keep them at their sites instead (keep_sites). The slot of
            # every kept op whose site ran kept ops only gets the keep role; a kept op without one keeps the signature
            # intercepted (its reason says why).
            for idx in sorted(kept):
                site = self.sites.get(idx)
                if site is None or idx in region.random.ops or decisions.get(idx) != SAVE:
                    continue
                others = [region.op_names[i] for i, s in self.sites.items() if s.key == site.key and i not in kept]
                if isinstance(site, NoSite):
                    why = site.why
                elif others:
                    why = f"{site.description} also runs {others[0]}, which is recomputed"
                else:
                    proxy = install_site(site, check.checks.installed)
                    if proxy is not None:
                        proxies.add(proxy)
                        kept_ops.add(idx)
                        region.light_reproduces(("op", idx))
                        continue
                    why = f"{site.description} can't hold a proxy for {region.op_names[idx]}"
                region.kept.reasons[("op", idx)] = f"op #{idx} {region.describe_op(idx)} is kept, but {why}"
            check.keep_proxies, check.n_kept_ops = frozenset(proxies), len(kept_ops)
        self.sites = self.cells = None   # they hold the checking call's primitives and cells
        # One mark, the reasons of every rule that made a per-op decision or found what a light re-run can't
        # reproduce (``Region.intercept``), taken back for one it does reproduce (``light_reproduces``); a new
        # kind of decision is covered without an edit here. Writes in forward only, to buffers, that no
        # re-run op reads, leave no mark: a light re-run writes nothing either (BufferGuard checks it does not).
        reasons = region.intercept
        check.ok = not reasons
        if not check.ok:
            logger.debug("recompute: a call signature stays intercepted: %s", "; ".join(reasons.values()))
            region.stats.note_intercepted(reasons.values())
        check.params, check.buffers = region.writes.params, region.writes.buffers
        position = {key: i for i, key in enumerate(check.keys)}   # a light forward numbers its saves so
        check.saved_outputs = {j: tuple(position[k] for k in keys if k in position)
                               for j, keys in region.writes.saved_outputs.items()}
        check.region_path, check.output_op = region.cell_path(), region.net.describe_output_op()
        check.op_names, check.op_paths = list(region.op_names), dict(region.op_paths)
        check.rerun_counts = collections.Counter(n for i, n in enumerate(check.op_names)
                                                 if i not in cell_dropouts and i not in kept_ops)
        check.n_rerun = sum(check.rerun_counts.values())
        check.n_dropouts = len(cell_dropouts)
        check.dropped = region.bytes.dropped_total
        check.param_ptrs = frozenset(region.writes.param_ptrs)
        check._owner = None   # pylint: disable=protected-access


# Arguments keyed by value: immutable, and holding no tensor.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, enum.Enum, np.generic, ms.dtype.Type, type)


_UNSIGNED = ("an argument can't be part of a call signature without holding it (a Cell, or an object other "
             "than tensors, plain values and tuples, lists and dicts of them), so no call is checked")


class _NoSignature(Exception):
    """An argument the signature can't describe without holding it."""


def _signature(v, depth=8):
    """A hashable description of ``v`` that holds no tensor and no object of the caller."""
    if isinstance(v, Tensor):
        return Tensor, v.shape, v.dtype, is_tracked(v), isinstance(v, Parameter)
    if isinstance(v, _VALUE_TYPES):
        return type(v), v   # the type too: 1, 1.0 and True are equal keys otherwise
    if depth > 0:
        if isinstance(v, (tuple, list)):
            return type(v), tuple(_signature(x, depth - 1) for x in v)
        if isinstance(v, dict):
            return type(v), tuple((_signature(k, 0), _signature(x, depth - 1)) for k, x in v.items())
    raise _NoSignature


class PathChecks:
    """Per-wrapper cache: call signature -> ``PathCheck`` (bounded; beyond it calls stay intercepted)."""

    MAX_KEYS = 32

    def __init__(self):
        self._checks = {}
        self.installed = {}   # keep site key -> (OpSlot, undo), shared by the signatures (keep_sites)

    @staticmethod
    def key(root, args, kwargs):
        """The call signature (see the module docstring), or None when an argument can't be described without
        holding it (that call is not checked and takes the intercepting path)."""
        try:
            # The mixed-precision type changes which Casts run and what is saved (to_float after some steps).
            return (root.training if root is not None else None, cell_precision(root),
                    tuple(_signature(a) for a in args),
                    tuple((k, _signature(kwargs[k])) for k in sorted(kwargs)))
        except _NoSignature:
            return None

    def lookup(self, key):
        check = self._checks.get(key)
        if check is not None and check.abandoned():
            del self._checks[key]
            check = None
        return check

    def start(self, key):
        if len(self._checks) >= self.MAX_KEYS:
            return None
        check = self._checks[key] = PathCheck()
        check.checks = self
        return check

    def forget(self, key):
        self._checks.pop(key, None)

    def remove_sites(self):
        """Take the keep role off every installed slot (``unwrap``); the signatures are checked again."""
        for _, undo in reversed(list(self.installed.values())):
            if undo is not None:
                undo()
        self.installed.clear()
        self._checks.clear()

    def __len__(self):
        return len(self._checks)


_TOO_MANY = (f"the wrapper has checked {PathChecks.MAX_KEYS} call signatures already (a new shape or argument "
             f"value every call?); new ones stay intercepted")
_IN_CHECK = "its signature's first call is still being checked (its backward has not run yet)"


def run_checkpoint(fn, args, kwargs, checks, root, **options):
    """Entry point of a wrapped cell: the light path when its signature's check allows, else ``run_region`` (always
    for nested calls and calls without gradient recording). ``checks``: the wrapper's ``PathChecks``, or None when
    the light path is off (a policy, swapped inputs, ``light_path=False``)."""
    if checks is None or ENGINE.top() is not None or not _executor.requires_grad():
        return run_region(fn, args, kwargs, root=root, **options)
    key = checks.key(root, args, kwargs)
    check = checks.lookup(key) if key is not None else None
    if check is not None and check.ok:
        return LightRegion(fn, check, checks, key, options["stats"], options["context_fn"],
                           cell_precision(root), options.get("chain"), options.get("rebind")).run_forward(args, kwargs)
    if key is None:   # every call that stays intercepted says why (issue 42)
        options["stats"].note_intercepted((_UNSIGNED,))
    elif check is None:
        check = checks.start(key)
        if check is None:
            options["stats"].note_intercepted((_TOO_MANY,))
        else:
            options["recorder"] = CheckRecorder(check)
    elif check.ok is None:
        options["stats"].note_intercepted((_IN_CHECK,))
    return run_region(fn, args, kwargs, root=root, **options)


def run_region(fn, args, kwargs, **options):
    """Entry point of ``checkpoint``: forward a new region, replay a nested one, or run plainly."""
    top = ENGINE.top()
    if top is not None and top.mode in (RECOMPUTE, REPLAY):
        child = top.region.next_child(top)
        ENGINE.enter_recompute()
        try:
            return child.nesting.replay(args, kwargs, top.grad_calls)
        finally:
            ENGINE.exit_recompute()
    if top is None and not _executor.requires_grad():
        return fn(*args, **kwargs)   # no graph is recorded: nothing would be saved
    region = intercepting.Region(fn, **options)
    if top is not None:
        top.region.children.append(region)
        if isinstance(top.region, intercepting.Region):
            top.region.nesting.note_child()
    return region.run_forward(args, kwargs)
