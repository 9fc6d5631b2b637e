"""Op dispatch inside a region run: number every op, apply the region's decision before it runs.

How a region works (see ``checkpoint`` for the user contract):

* Forward: the region's function runs under a ``MsDispatchMode`` that numbers
  every op and asks the region, *before* the op runs (legacy ops such as
  LayerNorm or Dropout pack their saved tensors inside the call), whether to
  keep it, and under ``saved_tensors_hooks`` whose pack replaces every tensor
  saved by a recomputed op with a ``Token`` (op index, pack number) that does
  not hold the tensor (it records the tensor's shape and dtype). An op that
  writes parameters is shown to the region first (``Region.guard_writes``:
  copies of what it writes, or its output kept).
* Backward: the first unpack of a token re-runs the function on the saved
  inputs, in a throw-away graph, under the same numbering; the recompute pack
  hook files each regenerated tensor under its key and the token takes it.
  Kept ops are not run again: their cached outputs are returned in place; ops
  that write run on copies (``Region.rerun_args``). The region then checks
  that every dropped tensor came back alike (``Region.check_recompute``).

The dispatch only numbers ops and asks its region (``Region.decide``,
``cache_output``, ``cached_output``, ...); the region owns every decision.
"""
from mindspore.utils import MsDispatchMode

from ..precision import no_casts
from .rerun import divergence_hint
from .saved import Token
from .side_effects import may_write
from .state import ENGINE, FORWARD

# Decisions recorded per op index in forward (absent = recompute).
SAVE, SWAP, REBUILD = "save", "swap", "rebuild"


# A primitive that stands in for another op names it here, e.g. an AllGather that implements an
# all-to-all where the backend has no all-to-all kernel: ``exclude_op`` and the counters see that name.
OP_NAME_ATTR = "mac_op_name"


def op_name_of(op, args=()):
    """Name of a dispatched op (``op.name`` is a str, or a method on some op kinds).

    A legacy op is dispatched with its primitive as ``args[0]``; a str
    ``mac_op_name`` attribute on that primitive is the name instead.
    """
    alias = getattr(args[0], OP_NAME_ATTR, None) if args else None
    if isinstance(alias, str):
        return alias
    name = getattr(op, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else type(op).__name__


class RegionRun:
    """One execution (forward, recompute, or replay) of a region's function."""

    def __init__(self, region, mode):
        self.region, self.mode = region, mode
        self.op_idx = -1
        self.inside = []       # op indices whose call is in progress (legacy ops pack inside)
        self.last = None       # index of the op that returned last (pyboost ops pack after)
        self.npacks = {}       # op index -> packs so far
        self.path = []         # [(name, cell)] of sub-cells entered, maintained by PathTracker
        self.attrs = []        # op attribute paths being called, maintained by AttrProxy
        self.child_idx = 0     # nested regions met so far
        self.in_hook = False   # our own code running ops (swap offload): not part of the region
        self.pending = []      # (token, tensor) packed inside a Dropout call, resolved when it returns
        self.written = {}      # recompute/replay: data_ptr of a tensor the region writes -> this run's copy

    def dropout_call(self, prim, x):
        """A ``DropoutProxy`` call (an ``nn.Dropout`` cell's kernel): run it, note it for the light path.

        The Dropout op itself goes through the dispatch as usual; a Dropout
        the region rebuilds from its mask and that was the only op of this
        call can be handled by the light path's proxy in later calls.
        """
        if self.mode != FORWARD or self.in_hook:
            return prim(x)
        start = self.op_idx
        out = prim(x)
        if self.op_idx == start + 1 and self.region.decisions.get(self.op_idx) == REBUILD:
            self.region.cell_dropouts.add(self.op_idx)
        return out

    def cell_path(self):
        return self.path[-1][0] if self.path else ""

    def cell(self):
        return self.path[-1][1] if self.path else self.region.root

    def current_op(self):
        return self.inside[-1] if self.inside else self.last

    def next_key(self):
        idx = self.current_op()
        if idx is None:
            return None
        k = self.npacks.get(idx, 0)
        self.npacks[idx] = k + 1
        return idx, k

    # -- forward pack: decide what the region keeps ---------------------------------
    def pack_forward(self, t):
        region = self.region
        if self.in_hook:
            return t
        key = self.next_key()   # first: the recompute numbers every pack, weights included
        decision = region.decisions.get(key[0]) if key is not None else SAVE
        if region.profile is not None and decision != REBUILD:   # a light run numbers Dropout packs apart
            region.profile.note_forward(t, key)
        ptr = t.data_ptr()
        if ptr in region.param_ptrs:
            return t
        if decision == SAVE or (ptr in region.input_ptrs and not region.swap_inputs):
            region.account_kept(t)
            return t
        if decision == SWAP:
            return region.offload(self, t)
        token = Token(region, key)
        region.token_meta[key] = (tuple(t.shape), t.dtype)   # checked against the recompute's
        if key[0] not in region.op_paths:
            region.op_paths[key[0]] = self.cell_path()
        if decision == REBUILD:
            self.pending.append((token, t))   # settled when the Dropout returns (finish_dropout)
        else:
            region.account_dropped(t)
        return token

    # -- recompute pack: file regenerated tensors under their forward keys ---------
    def pack_recompute(self, t):
        if self.in_hook:
            return None
        key = self.next_key()
        if self.region.profile is not None and (key is None or self.region.decisions.get(key[0]) != REBUILD):
            self.region.profile.note_recompute(t)   # as in forward: a light run numbers Dropout packs apart
        if key is not None and key in self.region.token_meta:
            self.region.recomputed[key] = t
        return None


class RegionDispatch(MsDispatchMode):
    """Numbers ops of one run and applies the region's keep/recompute decisions."""

    def __init__(self, run):
        super().__init__()
        self.run = run

    def __ms_dispatch__(self, func, args, kwargs=None):
        run = self.run
        kwargs = kwargs or {}
        # Ops of a nested region, or run by our own hooks, belong to nobody here; skipping
        # them in forward and recompute alike keeps the numbering aligned.
        if run.in_hook or ENGINE.top() is not run:
            return func(*args, **kwargs)
        run.op_idx += 1
        idx = run.op_idx
        if run.mode == FORWARD:
            return self._forward_op(run, idx, func, args, kwargs)
        return self._recompute_op(run, idx, func, args, kwargs)

    @staticmethod
    def _call(run, idx, func, args, kwargs):
        run.inside.append(idx)
        try:
            return func(*args, **kwargs)
        finally:
            run.inside.pop()
            run.last = idx

    def _forward_op(self, run, idx, func, args, kwargs):
        region = run.region
        name = op_name_of(func, args)
        region.op_names.append(name)
        region.stats.ops_forward += 1
        decision = region.decide(run, idx, name, func, args, kwargs)
        if may_write(name, args):   # before the call: the op writes during it
            region.may_write_seen = True
            decision = region.guard_writes(run, idx, name, args, decision)
        if decision is not None:
            region.decisions[idx] = decision   # before the call: legacy ops pack inside it
        out = self._call(run, idx, func, args, kwargs)
        region.note_outputs(idx, out)
        if decision == REBUILD:
            region.finish_dropout(run, idx, args, out)
        elif decision in (SAVE, SWAP):
            region.cache_output(run, idx, out)
        return out

    def _recompute_op(self, run, idx, func, args, kwargs):
        region = run.region
        name = op_name_of(func, args)
        if idx >= len(region.op_names) or region.op_names[idx] != name:
            path = run.cell_path()
            raise RuntimeError(
                f"mindformers_ac: recompute diverged from forward at op #{idx}: forward ran "
                f"{region.describe_op(idx)}, recompute runs {name}{f' (in {path!r})' if path else ''}. A "
                "checkpointed region must take the same code path when run again (no branching on global "
                "state, step counters or is_in_recompute() that changes ops)."
                + divergence_hint(region.op_names[idx] if idx < len(region.op_names) else "", name))
        if region.policy_fn is not None:
            region.ask_policy(run, idx, name, func, args, kwargs)   # lets the policy observe the re-run
        decision = region.decisions.get(idx)
        if decision is None:
            region.stats.count_rerun(name)
            if region.written:
                served = region.rerun_args(run, idx, name, args)
                if served is not args:
                    # The op's inputs were cast already (mixed precision casts before dispatch); the copies
                    # that stand in for the Parameters it writes must stay uncast, as those Parameters were.
                    with no_casts():
                        return self._call(run, idx, func, served, kwargs)
            return self._call(run, idx, func, args, kwargs)
        region.stats.ops_reused += 1
        run.last = idx
        if decision == REBUILD:
            return region.rebuild_dropout(run, idx, args)
        return region.cached_output(idx)
