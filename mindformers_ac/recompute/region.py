"""The op-intercepting way into a region: every op numbered and decided before it runs.

What it shares with the light path is ``rerun.RegionBase``; what is its own is
the per-op decision (``decide``: a policy, random ops, ops that write) and the
per-op check of the recompute (``check_recompute``). A checking call hands what
the light path needs to its ``path_choice.CheckRecorder``. A region met inside
another's forward is its child: the parent's recompute *replays* it (same kept
outputs, same dropout masks).
"""
import contextlib

import mindspore as ms
from mindspore import Tensor, ops
from mindspore.ops import Primitive

from ..checkpoint_policy import CheckpointPolicy
from ..config import RecomputeConfig
from ..errors import RecomputeError
from ..mindspore_compat import EXECUTOR_CALLS, no_grad, pushes_cell_state, recording_backward
from ..mindspore_compat import pynative_executor as _executor
from ..precision import cell_precision, no_casts
from ..tensors import cell_path_of, detached, output_tensors, param_ptrs, root_cell_of, storage_info
from ..tensors import tensor_leaves_in_objects as tensor_leaves  # issue 49: the walk stays here for now
from . import messages
from .debug_log import DebugLog
from .dispatch import REBUILD, SAVE, SWAP, RegionDispatch, StopRerun, arg_meta, is_comm_op, tensor_args
from .keep_sites import decides_by_site
from .probe import Sample, SampleIndex, first_probed, probed
from .random_ops import dropout_input, is_unreplayable_random_op
from .rerun import (
    RegionBase,
    RegionRun,
    SwappedTensor,
    Token,
    drop_saved,
    keep_saved,
    recompute_graph,
    rerun_inputs,
    unpack_saved,
    weak_pack,
)
from .side_effects import (
    KEEP,
    StateSnapshot,
    buffers_as_before,
    choose_handling,
    first_input,
    read_slots,
    replace_at,
    slot_ptrs,
    writes_first_input,
    written_slots,
    written_tensors,
)
from .state import ENGINE, FORWARD, RECOMPUTE, REPLAY
from .tracking import OpContext


class Region(RegionBase):
    """One call on the op-intercepting path, from its forward to the end of its backward. ``recorder``: a
    ``path_choice.CheckRecorder`` when this call is the first of its call signature, handed what the region
    observes and, after the recompute, the region itself (which builds none of the light path's data)."""

    def __init__(self, fn, *, policy_fn, stats, swap_executor, swap_inputs, context_fn, tracker, root=None,
                 recorder=None, chain=None, debug=False, settings=None):
        # the recompute section apply_ac was given (defaults without one; the checkpoint API's ``early_stop``
        # keyword is its field): a setting the region reads is read here, with nothing in between to hand it over
        self.settings = settings if settings is not None else RecomputeConfig()
        if root is None:
            root = tracker.root if tracker is not None else root_cell_of(fn)
        # Rule S1 of docs/exactness.md: a re-run stopped inside a cell call that pushes executor state would
        # leave it pushed (MindSpore pops it only on return): decided once, when the region is made
        self.early_stop = self.settings.early_stop and not pushes_cell_state(root if root is not None else fn)
        named = list(root.parameters_and_names()) if root is not None else []
        params = [p for _, p in named]
        self.param_names = frozenset(name for name, _ in named)   # to tell a replaced Parameter from a new one
        ptrs = param_ptrs(params)
        self.params = tuple(params)
        self.buffers = tuple(p for p in params if not p.requires_grad)   # the root's non-trainable Parameters
        super().__init__(fn, stats, context_fn, ptrs, self.params, chain)
        self.policy_fn = policy_fn
        self.swap_executor = swap_executor
        self.swap_inputs = swap_inputs
        self.tracker = tracker
        self.root = root
        self.param_ptrs = ptrs
        self.input_ptrs = set()
        self.decisions = {}       # op index -> SAVE / SWAP / REBUILD (absent: recompute)
        self.arg_metas = {}       # op index of a decided op -> its tensor arguments' (shape, dtype)
        self.op_names = []        # forward op names, to detect a diverging recompute
        self.op_paths = {}        # op index -> cell path, for ops that left tokens (for messages)
        self.fwd_npacks = {}      # op index -> tensors it saved in forward
        self.cache = {}           # op index -> kept output (tensors or SwappedTensor)
        self.dropouts = {}        # op index -> DropoutRecord
        self.snapshots = {}       # op index -> StateSnapshot of a side-effect op's written tensors
        self.written = {}         # data_ptr -> (op index, StateSnapshot or None, slot) of its first write
        self.kept_ptrs = {}       # storage pointer of a kept (SAVE) output -> (op index, output position)
        self.kept_args = {}       # policy-kept op index -> {data_ptr of a tensor argument: its position}
        self.arg_saves = {}       # key of a kept op's save that is one of its arguments -> that position (K1)
        self.writes_arg = set()   # kept ops that wrote their first argument in forward (replay_write)
        self.token_meta = {}      # key of a saved tensor dropped in forward -> its (shape, dtype)
        # (storage, producing op) -> bytes of every tensor saved in forward: whether an output was saved (rule
        # W6), and what the region's forward saved in all (rule K2); the producer tells a storage from a later
        # one at the same address (freed saves' addresses are reused)
        self.packed = {}
        self.recomputed = {}      # key -> regenerated tensor, filled by the recompute
        self.skipped = set()      # forward op indices the recompute skipped under the marker (skippable)
        # Why this call's signature must stay on the intercepting path: whoever makes a per-op decision, or
        # finds a fact the light path can't reproduce, says so here (``keep_intercepted``); ``CheckRecorder``
        # reads only this. key -> reason, for the debug log.
        self.intercept = {}
        # A policy deciding by the op's name and place only (exclude_policy) may be installed at the ops'
        # keep sites (keep_sites, path_choice.CheckRecorder); any other decides per call.
        self.site_policy = policy_fn is not None and decides_by_site(policy_fn)
        if policy_fn is not None and not self.site_policy:
            self.keep_intercepted("policy", "a policy_fn that decides per op call (not by the op's name and place)")
        self.policy_saves = {}        # op index the policy keeps -> its policy (MUST_SAVE / PREFER_SAVE)
        if swap_inputs:
            self.keep_intercepted("swap_inputs", "its inputs are swapped")
        self.recorder = recorder
        if recorder is not None:
            recorder.attach(self)
        elif self.intercept:   # never checked: say why once per call (a per-call policy, swapped inputs)
            stats.note_intercepted(self.intercept.values())
        self.may_write_seen = False   # an op that may write tensors ran in forward
        self.random_ops = {}          # op index of a random op kept (or rebuilt) -> its primitive, or None
        self._swap_holders = {}   # (op index, ptr) -> SwappedTensor: one offload per storage and op
        self.debug_log = DebugLog() if debug else None   # checkpoint(debug=True): both runs' op logs
        self.stop_after = None    # during a re-run that may stop early: the last op it must run
        self.n_needed = 0         # ... and how many dropped tensors it must rebuild
        # the safety net (probe): samples of the forward's output and of its last dropped tensor, which the
        # re-run must reproduce bitwise; the index cache is the signature's (a checking call's) or its own
        self.samples = self.last_drop = None
        self.cut_samples = {}     # (kept op index, before / after) -> (key, Sample) of the last drop
        self.cut_pending = None   # (kept op index, "after") until the next op: its packs are made by then
        self.sample_index = recorder.check.probe_index if recorder is not None else SampleIndex()

    # -- swap -------------------------------------------------------------------
    def offload(self, run, t, key=None):
        ptr = t.data_ptr()
        key = key if key is not None else (run.current_op(), ptr)
        holder = self._swap_holders.get(key)
        if holder is None:
            with run.engine_ops():   # the executor may run ops: they are not part of the region
                holder = SwappedTensor(self.swap_executor, t)
            self._swap_holders[key] = holder
            self.bytes.swap(t)
        return holder

    # -- decisions --------------------------------------------------------------
    def ask_policy(self, run, idx, name, func, args, kwargs):
        ctx = OpContext(name, run.cell_path(), run.mode != FORWARD, idx, run.cell(),
                        run.attrs[-1][1] if run.attrs else None)
        with run.engine_ops():   # a policy that runs ops must not shift the numbering
            policy = self.policy_fn(ctx, func, *args, **kwargs)
        if not isinstance(policy, CheckpointPolicy):
            raise messages.bad_policy(policy, ctx.op_path)
        return policy

    def decide(self, run, idx, name, func, args, kwargs):
        """Decision for op ``idx`` in forward; random ops are kept whatever the policy says."""
        policy = self.ask_policy(run, idx, name, func, args, kwargs) if self.policy_fn is not None else None
        if self.site_policy and self.recorder is not None:
            self.recorder.note_site(run, idx, name, args, policy is not None and not policy.recomputes)
        if is_unreplayable_random_op(name, args):
            self.random_ops[idx] = args[0] if args and isinstance(args[0], Primitive) else None
            if name == "Dropout" and dropout_input(args)[0] is not None:
                return REBUILD
            return SAVE
        if policy is None or policy.recomputes:
            return None
        if policy is CheckpointPolicy.MUST_SWAP:
            if self.swap_executor is not None:
                return SWAP
            ENGINE.warnings.warning("must_swap", messages.MUST_SWAP_WITHOUT_EXECUTOR)
        self.policy_saves[idx] = policy
        return SAVE

    # -- ops that write parameters (see side_effects) -----------------------------
    def guard_writes(self, run, idx, name, args, decision):
        """Called in forward, before op ``idx`` runs, for an op that may write tensors.

        Returns the op's decision: unchanged for a kept op (it is not run
        again), else None after a snapshot of what it writes, or SAVE when the
        written tensors are too large to copy. Every write is recorded so the
        recompute can serve reads of those tensors.
        """
        slots = written_slots(name, args, self.param_ptrs)
        if not slots:
            return decision
        snapshot = None
        if decision is None and choose_handling(args, slots) != KEEP:
            with run.engine_ops(), no_casts():   # the copies are ours: they must not shift the op numbering
                snapshot = StateSnapshot(args, slots)
            self.snapshots[idx] = snapshot
            self.bytes.keep_bytes(("state", idx), snapshot.nbytes)
        elif decision is None:
            decision = SAVE
            ENGINE.warnings.warning(("keep_side_effect", name), messages.KEEP_SIDE_EFFECT, name)
        buffers = {p.data_ptr() for p in self.buffers}
        for k, ptr in enumerate(slot_ptrs(args, slots)):
            self.written.setdefault(ptr, (idx, snapshot, k))
            if ptr not in buffers:
                self.keep_intercepted(("writes", ptr), f"op #{idx} {name} writes a tensor that is not one of the "
                                                        f"cell's non-trainable Parameters")
        return decision

    def guard_write_targets(self, run, idx, name, args):
        """Called in forward before an op that may write (rule W1): each tensor it writes that the re-run
        must see as it is now gets a private copy first. A region input (``protect_input``): the re-run
        starts from it. A kept op's output (``protect_kept``): the re-run gets it back as the kept op
        returned it, and the writer writes it again. Either keeps the region off the light path."""
        if not self.input_ptrs and not self.kept_ptrs:
            return
        for t in written_tensors(name, args):
            ptr = t.data_ptr()
            if ptr in self.input_ptrs or ptr in self.kept_ptrs:
                with run.engine_ops():   # the copy is ours: it must not shift the op numbering
                    if ptr in self.kept_ptrs:
                        self.protect_kept(ptr, idx, name)
                    elif self.protect_input(ptr):
                        self.keep_intercepted("writes_input", "an op writes one of its inputs in place")

    def protect_kept(self, ptr, idx, name):
        """Op ``idx`` is about to write the output that kept op ``kept`` returned at ``ptr``: keep a copy of
        it as it is now, for the re-run."""
        kept, j = self.kept_ptrs.pop(ptr)
        out = self.cache[kept]
        single = isinstance(out, Tensor)
        with no_grad(), no_casts():
            copy = ops.deepcopy(out if single else out[j])
        self.cache[kept] = copy if single else type(out)((*out[:j], copy, *out[j + 1:]))
        self.bytes.keep(copy)
        self.keep_intercepted(("writes_kept", kept), f"op #{idx} {name} writes the kept output of op #{kept} "
                                                     f"{self.op_names[kept]} in place")

    def rerun_args(self, run, idx, name, args):
        """Arguments for re-running op ``idx`` in a region that writes tensors.

        A side-effect op gets fresh copies of what it wrote (the real tensors
        were written once, in forward); an op reading such a tensor gets the
        run's copy (as it was at that point of the forward). A read of a tensor
        whose writer kept its output instead, before that write, can't be
        served: ``RecomputeError`` naming both ops.
        """
        with run.engine_ops(), no_casts():   # copies are ours, not ops of the region
            return self._rerun_args(run, idx, name, args)

    def _rerun_args(self, run, idx, name, args):
        snapshot = self.snapshots.get(idx)
        if snapshot is not None:
            return snapshot.args_for_rerun(args, run.written)
        served = {}
        for pos, ptr, t in read_slots(args, self.written):
            first, snap, k = self.written[ptr]
            if snap is not None and (t.shape, t.dtype) != (snap.copies[k].shape, snap.copies[k].dtype):
                continue   # another tensor at an address the written one had (found by program_generator)
            self.keep_intercepted("rerun_reads_written", f"re-run op #{idx} {name} reads a tensor the region writes")
            if ptr not in run.written:
                if snap is None:
                    if idx < first:
                        raise messages.read_before_kept_write(idx, name, run.cell_path(), first,
                                                              self.describe_op(first))
                    continue   # after the write: the real tensor holds the written value
                run.written[ptr] = snap.fresh(k)
            served[pos] = run.written[ptr]
        return replace_at(args, served) if served else args

    # -- aligning a re-run that skips ops ---------------------------------------------
    def skippable(self, idx, run):
        """May ``run`` skip forward op ``idx``? Only under the marker (its code asked it, or the region has
        a ``context_fn``), and only an op whose output is not kept: rule W7 of docs/exactness.md (what a
        skipped op saved is not rebuilt; its tokens raise if the backward ever reaches them)."""
        return (run.asked_marker or self.context_fn is not None) and idx not in self.decisions

    def align(self, run, idx, name, args):
        """The forward index of the re-run's next op ``name`` (``idx``: right after the previous one).

        The forward's op ``idx`` when it has that name (and, for a kept op,
        the same tensor arguments); else the next op of that name past ops
        the re-run may skip (``skippable``). ``RecomputeError`` when there is
        none: the re-run runs another op than its forward.
        """
        names = self.op_names
        j = idx
        while j < len(names):
            if names[j] == name and (j not in self.arg_metas or self.arg_metas[j] == arg_meta(args)):
                return j
            if not self.skippable(j, run):
                break
            self.skipped.add(j)
            j += 1
        raise messages.other_op(idx, self.describe_op(idx), names[idx] if idx < len(names) else "", name,
                                run.cell_path())

    def realign(self, run, idx):
        """A re-run op numbered ``idx`` saves a tensor, but forward op ``idx`` saved none: it is the next
        forward op of its name that saved some, past skippable ops (the re-run skipped a same-named side
        effect). Renumbers the run and returns the new index, or ``idx`` when there is no such op."""
        names = self.op_names
        if not self.skippable(idx, run):
            return idx
        j = idx + 1
        while j < len(names) and names[j] != names[idx] and self.skippable(j, run):
            j += 1
        if j >= len(names) or names[j] != names[idx] or not self.fwd_npacks.get(j) or j in self.decisions:
            return idx
        run.npacks[j] = run.npacks.pop(idx, 0)
        run.inside = [j if i == idx else i for i in run.inside]
        if run.last == idx:
            run.last = j
        if run.op_idx == idx:
            run.op_idx = j
        return j

    # -- divergence checks -------------------------------------------------------
    def describe_op(self, idx):
        """``Name (in 'cell.path')`` of forward op ``idx``, for messages."""
        return messages.describe_op(self.op_names, self.op_paths, idx)

    def stop_point(self):
        """``early_stop``: the last forward op the re-run must run (the last that left a dropped tensor), or
        None when the re-run must run whole: a first call checking its signature for the light path (it
        compares whole runs), a group member whose re-run output the next member needs, nested regions,
        gradients computed inside the forward, a root whose cells push executor state (``early_stop``, S1),
        Parameters rebound in forward (their values are put back when the re-run ends, which a stopped one
        reaches before its last op's saves are handed over)."""
        if (not self.early_stop or self.recorder is not None or self.feeds_next or self.children
                or "inner_grad" in self.intercept or not self.token_meta or self.replaced.before):
            return None
        return max(idx for idx, _ in self.token_meta)

    def check_recompute(self, run, stopped=False):
        """After a recompute: raise ``RecomputeError`` naming the op and what differed unless it ran every op,
        each re-run op that left tokens saved as many tensors as in forward, and each dropped tensor came back
        with its shape and dtype (else the tokens would take the wrong tensors: docs/exactness.md, "Int and
        bool inputs")."""
        n = len(self.op_names)
        missing = None if stopped else next((i for i in range(run.op_idx + 1, n) if not self.skippable(i, run)),
                                            None)
        if missing is not None:
            raise messages.missing_ops(missing, n, self.describe_op(missing))
        self.skipped.update(range(run.op_idx + 1, n))
        for key, meta in self.token_meta.items():
            idx, k = key
            if self.decisions.get(idx) is not None or idx in self.skipped:
                continue   # kept or rebuilt: served otherwise; skipped: its tokens raise if asked for
            fwd, rec = self.fwd_npacks.get(idx, 0), run.npacks.get(idx, 0)
            if fwd != rec:
                raise messages.save_count_at_op(idx, self.describe_op(idx), fwd, rec)
            t = self.recomputed.get(key)
            got = (tuple(t.shape), t.dtype) if t is not None else None
            if got != meta:
                raise messages.other_tensor(f"op #{idx} {self.describe_op(idx)}, its saved tensor #{k}", meta, got)

    # -- the safety net (probe) ------------------------------------------------
    def take_samples(self, run, out):
        """At the end of the forward: sample its output and the last tensor it dropped since the last kept op
        (the last op a re-run that stops early reaches), for ``check_values``."""
        if self.cut_pending is not None:
            self.sample_at_kept(run, self.cut_pending)
        t = first_probed(out)
        self.samples = (Sample(t, self.sample_index), self.bytes.producer.get(storage_info(t)[0]) if t is not None
                        else None, self.sample_last_drop())

    def sample_last_drop(self):
        """``(key, Sample)`` of the last tensor dropped since the previous call, or None; forgets it."""
        drop, self.last_drop = self.last_drop, None
        return (drop[0], Sample(drop[1], self.sample_index)) if drop is not None else None

    def sample_at_kept(self, run, point):
        """In forward, at a kept op (``point``: ``(index, "before")`` or ``(index, "after")`` its call): sample
        the last tensor dropped since the previous sample, which may be the arguments it saved (rule K1). A
        kept op hands the re-run its forward's output, so a divergence before it may not reach the region's
        output; the re-run compares at the same point (``check_at_kept``)."""
        self.cut_pending = None
        if self.last_drop is not None:
            with run.engine_ops():
                self.cut_samples[point] = self.sample_last_drop()

    def check_at_kept(self, run, point):
        """In the re-run, at the kept op's ``point``: the tensor sampled there in forward is rebuilt bitwise."""
        cut = self.cut_samples.get(point)
        if cut is None:
            return
        key, sample = cut
        with run.engine_ops():
            same = sample.matches(self.recomputed.get(key))
        if not same:
            raise messages.other_values(self.cell_path(), f"op #{key[0]} {self.describe_op(key[0])}, its saved "
                                                          f"tensor #{key[1]}")

    def check_values(self, out, stopped):
        """After the re-run, before any tensor it rebuilt leaves the region: the sampled tensors hold the
        forward's values bitwise, else ``RecomputeError`` naming the region and the op (docs/exactness.md,
        "The safety net"): a pattern no rule knows fails on its first backward."""
        at_output, _, last = self.samples
        if last is not None and not last[1].matches(self.recomputed.get(last[0])):
            idx, k = last[0]
            raise messages.other_values(self.cell_path(), f"op #{idx} {self.describe_op(idx)}, its saved "
                                                          f"tensor #{k}")
        if not stopped and not at_output.matches(first_probed(out)):
            raise messages.other_values(self.cell_path(), self.describe_output_op())

    def describe_output_op(self):
        """``op #7 Add (in 'mlp'), the region's output``: the op that made the sampled output, for messages."""
        idx = self.samples[1] if self.samples is not None else None
        if idx is None:
            return "the region's output"
        return f"op #{idx} {messages.describe_op(self.op_names, self.op_paths, idx)}, the region's output"

    def cell_path(self):
        """The region's cell path in its model (or its function's name), for messages."""
        return cell_path_of(self.root) if self.root is not None else self.describe_root()

    # -- kept outputs -----------------------------------------------------------
    def cache_output(self, run, idx, out, name, args):
        if self.decisions[idx] == SWAP:
            self.cache[idx] = tuple(self.offload(run, t) if isinstance(t, Tensor) else t
                                    for t in output_tensors(out)), isinstance(out, (tuple, list))
            return
        for j, t in enumerate(output_tensors(out)):
            if isinstance(t, Tensor):
                self.bytes.keep(t)
                self.kept_ptrs.setdefault(t.data_ptr(), (idx, j))   # a later write copies it first (W2)
        self.cache[idx] = out
        if writes_first_input(name, args) and first_input(args).data_ptr() not in self.param_ptrs:
            # A kept op that wrote its argument (all_reduce(t), t.copy_(...)): the re-run writes the kept
            # value into its own argument, which the code after it reads (rule W3).
            self.writes_arg.add(idx)
            self.keep_intercepted(("kept_writer", idx), f"op #{idx} {name} is kept and writes its argument "
                                                        f"in place")

    def release_unread_kept(self):
        """Rule K2 of docs/exactness.md, at the end of the forward: unread PREFER_SAVE ops are re-run instead,
        largest first, while the region keeps more than its forward saved; a collective (``is_comm_op``) or
        a writer (W3) stays kept. MUST_SAVE (``exclude_op``) is kept whatever it costs: what the region
        then keeps beyond its forward's saves is reported (``RecomputeStats.kept_over_bytes``, a warning)."""
        kept, budget = sum(self.bytes.kept.values()), sum(self.packed.values())
        unread = []
        for idx, policy in self.policy_saves.items():
            out = self.cache.get(idx)
            if out is None or policy is not CheckpointPolicy.PREFER_SAVE or idx in self.writes_arg \
                    or is_comm_op(self.op_names[idx]) or self.decisions.get(idx) != SAVE:
                continue
            tensors = [t for t in output_tensors(out) if isinstance(t, Tensor)]
            if not any((storage_info(t)[0], idx) in self.packed for t in tensors):
                unread.append((sum(storage_info(t)[1] for t in tensors), idx, tensors))
        for nbytes, idx, tensors in sorted(unread, key=lambda u: (-u[0], u[1])):
            if kept <= budget:
                break
            del self.cache[idx], self.decisions[idx], self.policy_saves[idx]
            self.kept_args.pop(idx, None)
            self.light_reproduces(("op", idx))
            for t in tensors:
                self.bytes.unkeep(t)
                self.kept_ptrs.pop(t.data_ptr(), None)
            kept -= nbytes
            self.stats.unread_kept += 1
        if kept > budget and self.policy_saves:
            self.stats.note_kept_over(kept - budget)
            ENGINE.warnings.warning(("kept_over", id(self.stats)), messages.KEPT_OVER, self.cell_path(),
                                    kept - budget)

    def note_kept_args(self, idx, args):
        """Before policy-kept op ``idx`` runs: where its tensor arguments live, so that what it saves of them
        is left to the re-run of the ops before it (rule K1), not kept beside its output."""
        self.kept_args[idx] = {t.data_ptr(): i for i, t in enumerate(tensor_args(args))
                               if t.data_ptr() not in self.param_ptrs}

    def serve_kept_args(self, idx, args):
        """In the re-run, at kept op ``idx``: its saved arguments are the re-run's (rule K1)."""
        tensors = tensor_args(args)
        for key, i in self.arg_saves.items():
            if key[0] == idx and key in self.token_meta:
                self.recomputed[key] = tensors[i]

    def replay_write(self, run, idx, args, out):
        """The re-run's kept op ``idx`` that wrote its first argument in forward: the kept value written into
        the re-run's argument, which stands for the op's output as in forward."""
        target = first_input(args)
        with run.engine_ops(), no_grad(), no_casts():
            target.copy_(out if isinstance(out, Tensor) else out[0])
        return target if isinstance(out, Tensor) else type(out)((target, *out[1:]))

    def cached_output(self, idx):
        out = self.cache[idx]
        if self.decisions[idx] != SWAP:
            return out
        items, is_seq = out
        items = tuple(t.load() if isinstance(t, SwappedTensor) else t for t in items)
        return items if is_seq else items[0]

    def finish_dropout(self, run, idx, args, out):
        """After Dropout op ``idx`` ran: its mask as bits, its packed outputs left for the rebuild.

        What it packed that is not one of its outputs, or everything when its
        output can't be rebuilt bitwise (then its outputs are kept and it is
        not run again), is handed to its token as it is.
        """
        pending, run.pending = run.pending, []
        x, keep_prob = dropout_input(args)
        record, where = self.keep_dropout(idx, x, out, keep_prob, [t for _, t in pending])
        name = self.op_names[idx]
        for (token, t), j in zip(pending, where):
            if j is None:
                token.tensor = t
                self.token_meta.pop(token.key, None)
            else:
                record.pack_outputs.append((token.key[1], j))
                self.bytes.drop(t)
        if record.kept is not None:
            self.record_decision(idx, SAVE)
            self.cache_output(run, idx, out, name, args)
        else:
            self.dropouts[idx] = record

    def dropout_call(self, run, prim, x):
        """An ``nn.Dropout`` cell's kernel call through its slot's dropout role: the op goes through the
        dispatch as usual; one the region rebuilds from its mask, the only op of this call, is noted for the
        path check (the light path's dropout slot takes it in later calls)."""
        if run.mode != FORWARD or run.in_hook:
            return prim(x)
        start = run.op_idx
        run.in_cell_dropout = True
        try:
            out = prim(x)
        finally:
            run.in_cell_dropout = False
        if run.op_idx == start + 1 and self.decisions.get(run.op_idx) == REBUILD and self.recorder is not None:
            self.recorder.note_cell_dropout(self, run.op_idx)
        return out

    def rebuild_dropout(self, run, idx, args):
        record = self.dropouts[idx]
        with run.engine_ops():   # the rebuild's own ops save nothing for this region
            out = record.rebuild(dropout_input(args)[0])
        if run.mode == RECOMPUTE:
            for k, j in record.pack_outputs:
                if (idx, k) in self.token_meta:
                    self.recomputed[(idx, k)] = out[j]
        return out

    # -- saved tensors ------------------------------------------------------------
    def pack_forward(self, run, t):
        """Forward pack hook: what the autograd graph keeps for ``t`` (itself, a swap holder or a Token)."""
        if run.in_hook:
            return t
        key = run.next_key()   # first: the recompute numbers every pack, weights included
        if EXECUTOR_CALLS.grad_calls() > run.grad_calls:
            return self.inner_grad_save(t)
        decision = self.decisions.get(key[0]) if key is not None else SAVE
        if self.recorder is not None and not (decision == REBUILD and run.in_cell_dropout):
            # as a light run numbers them: an nn.Dropout's apart, a functional dropout's as any op's (a kept
            # op's are filtered out when the check ends: whether it stays kept is known then, rule K2)
            self.recorder.note_forward(t, key)
        ptr = t.data_ptr()
        if ptr in self.param_ptrs:
            return t
        base, nbytes = storage_info(t)
        self.packed[(base, self.bytes.producer.get(base))] = nbytes
        if decision == SAVE and key is not None and ptr in self.kept_args.get(key[0], ()) \
                and ptr not in self.input_ptrs:
            # K1: a kept op keeps its outputs; an argument it saved is the re-run's (serve_kept_args)
            self.arg_saves[key] = self.kept_args[key[0]][ptr]
            decision = None
        elif decision == SAVE or (ptr in self.input_ptrs and not self.swap_inputs):
            self.bytes.keep(t)
            if decision == SAVE:
                # An alias cut from autograd: an op that saves its own output (Softmax, Exp) and gets the
                # tensor itself back closes a loop inside MindSpore (its node -> the saved tensor -> that node)
                # that only its backward breaks; a forward whose backward never runs kept its model for good.
                with run.engine_ops():
                    return detached(t)
            return t
        elif decision == SWAP:
            return self.offload(run, t)
        token = Token(self, key)
        self.token_meta[key] = (tuple(t.shape), t.dtype)   # checked against the recompute's
        if key[0] not in self.op_paths:
            self.op_paths[key[0]] = run.cell_path()
        if decision == REBUILD:
            run.pending.append((token, t))   # settled when the Dropout returns (finish_dropout)
        else:
            self.bytes.drop(t)
            if probed(t):
                self.last_drop = (key, t)   # held until the next kept op or the forward's end, then sampled
        return token

    def pack_recompute(self, run, t):
        """Recompute pack hook: file each regenerated tensor under its forward key; the graph keeps nothing."""
        if run.in_hook:
            if run.noting_replay:   # a random op run again by its replay check: saves as a light re-run's would
                self.recorder.note_recompute(t)
            return None
        idx = run.current_op()
        if idx is not None and not self.fwd_npacks.get(idx) and idx not in self.decisions:
            self.realign(run, idx)
        key = run.next_key()
        if EXECUTOR_CALLS.grad_calls() > run.grad_calls:
            return t   # as in forward (inner_grad_save)
        if self.recorder is not None and (key is None or (self.decisions.get(key[0]) != REBUILD
                                                            and key[0] not in self.policy_saves)):
            # as in forward: a light run numbers Dropout packs apart and runs no kept op (a legacy op handed
            # its kept output here is still recorded, with its inputs)
            self.recorder.note_recompute(t)
        if key is not None and key in self.token_meta:
            self.recomputed[key] = t
            if (self.stop_after is not None and not run.inside and len(self.recomputed) >= self.n_needed
                    and run.npacks.get(key[0]) == self.fwd_npacks.get(key[0])):
                # the last dropped tensor is rebuilt, after its op returned and made all its saves (early_stop)
                raise StopRerun()
        return None

    @staticmethod
    def pack_replay(_region, run, t):
        """Replay pack hook: the replay graph is never backpropagated, so it keeps nothing, but for a save made
        inside a grad call that the enclosing re-run's function makes (``c(grad(c(f)))``): that call's
        backward, run inside the re-run, reads it (rule N1)."""
        return t if EXECUTOR_CALLS.grad_calls() > run.grad_calls else None

    def inner_grad_save(self, t):
        """A save made inside a grad call that the region's function makes (gradients computed inside a
        forward, PyTorch's nested-checkpoint ``g``): it belongs to that call's graph, whose backward runs
        before this forward ends, so it is kept as it is (the graph frees it with itself); the re-run's
        inner grad call saves its own (``pack_recompute``). Such a region stays on this path."""
        self.keep_intercepted("inner_grad", "its function computes gradients inside its forward")
        return t

    # -- the light path's one mark (see path_choice) ------------------------------
    def keep_intercepted(self, key, reason):
        """A decision or fact of this call the light path can't reproduce: its signature stays intercepted."""
        self.intercept.setdefault(key, reason)

    def light_reproduces(self, key):
        """Decision ``key`` turned out to be one the light path reproduces itself (an nn.Dropout's mask bits,
        a random op that draws again from the forward's state): it no longer keeps the signature intercepted."""
        self.intercept.pop(key, None)

    def record_decision(self, idx, decision):
        """Op ``idx`` is kept, swapped or rebuilt instead of run again: a per-op decision."""
        self.decisions[idx] = decision
        self.keep_intercepted(("op", idx), f"op #{idx} {self.op_names[idx]} is {decision}d, not run again")

    # -- runs -------------------------------------------------------------------
    def _tracking(self):
        return self.tracker.active() if self.tracker is not None else contextlib.nullcontext()

    def run_forward(self, args, kwargs):
        with EXECUTOR_CALLS.counting():   # grad calls of its own (inner_grad_save)
            return self._run_forward(args, kwargs)

    def _run_forward(self, args, kwargs):
        run = RegionRun(self, FORWARD, self.tracker)
        self.precision = cell_precision(self.root)
        self.stats.intercepted_calls += 1
        ENGINE.push(run)
        try:
            self.start_forward()
            if self.swap_inputs and self.swap_executor is None:
                ENGINE.warnings.warning("swap_inputs", messages.SWAP_INPUTS_WITHOUT_EXECUTOR)
            offload = (lambda t, ptr: self.offload(run, t, key=("input", ptr))) \
                if self.swap_inputs and self.swap_executor is not None else None
            self.input_ptrs = set(self.save_inputs(args, kwargs, offload, chained=self.link_chain(args, kwargs)))
            with self.run_context(FORWARD), self._tracking(), RegionDispatch(run), \
                    ms.saved_tensors_hooks(weak_pack(run, Region.pack_forward, keep_saved), unpack_saved), \
                    self.replaced.watch(run.engine_ops, (args, kwargs), self.param_moved):
                out = self.fn(*args, **kwargs)
            with run.engine_ops():   # on the run, so that no enclosing region numbers the sample's op
                self.take_samples(run, out)
            self.refuse_replaced_parameters()
            self.finish_forward(run, args, kwargs, out)   # its own ops: not an enclosing region's (N1)
        finally:
            ENGINE.pop(run)
        return out

    def finish_forward(self, run, args, kwargs, out):
        """What the end of the forward keeps, while ``run`` is still on the ENGINE stack: an enclosing
        region's dispatch then does not number the ops it runs (the ``_Held`` view of a saved output),
        which its re-run, replaying this region, would not run (rule N1 of docs/exactness.md)."""
        producer = self.bytes.producer
        self.saved_outputs = tuple(j for j, t in enumerate(tensor_leaves(out))
                                   if (storage_info(t)[0], producer.get(storage_info(t)[0])) in self.packed)
        self.stamp(args, kwargs, out, self.saved_outputs)   # first: a held output counts against K2's bound
        self.release_unread_kept()
        self.packed = None
        self.keep_replaced()
        self.finish_chain(out)
        self.fwd_npacks = run.npacks
        self._swap_holders = None
        self.stats.open_region(self, self.bytes.close())

    def param_moved(self, old, new):
        """A Parameter was rebound in forward: its old storage pointers are no weight's any more."""
        self.param_ptrs.difference_update(old - new)
        self.param_ptrs.update(new)

    def refuse_replaced_parameters(self):
        """After the forward: ``RecomputeError`` when it replaced one of the root's Parameters by a new object
        (``self.g = Parameter(...)``): the re-run would read the new one, and nothing holds the old one's
        value for it (rule W4 covers ``set_data`` and ``assign_value``, which keep the object)."""
        if self.root is None:
            return
        before = {id(p) for p in self.params}
        for name, p in self.root.parameters_and_names():
            if id(p) not in before and name in self.param_names:   # a new name (built on first use) is read as is
                raise messages.parameter_replaced(self.cell_path(), name)

    def replay(self, args, kwargs, grad_calls):
        """Run again inside a parent's recompute, with this region's kept outputs and masks. ``grad_calls``:
        the grad calls running when the enclosing re-run started (``pack_replay``)."""
        run = RegionRun(self, REPLAY, self.tracker)
        run.grad_calls = grad_calls
        ENGINE.push(run)
        try:
            with self.run_context(REPLAY), self._tracking(), RegionDispatch(run), \
                    ms.saved_tensors_hooks(weak_pack(run, Region.pack_replay), keep_saved):
                return self.fn(*args, **kwargs)
        finally:
            ENGINE.pop(run)

    def _recompute(self):
        try:
            self._rerun()
        except RecomputeError as exc:
            if self.debug_log is None:
                raise
            raise RecomputeError(f"{exc}\n{self.debug_log.side_by_side()}") from exc

    def _rerun(self):
        run = RegionRun(self, RECOMPUTE, self.tracker)
        self.recomputed = {}   # this backward's (R1)
        args, kwargs = self.load_inputs()
        # its own grad calls need a top cell of their own (see recompute_graph), but not in a backward recorded
        # for a higher-order one: that would replace the top cell being recorded ("Can not find top cell")
        outputs = [] if "inner_grad" in self.intercept and not recording_backward() else None
        with EXECUTOR_CALLS.counting(), self.replaced.rerun_from(), buffers_as_before(self.snapshots.values()), \
                recompute_graph(run, self.precision, self.random_state, outputs), \
                self.run_context(RECOMPUTE), self._tracking(), RegionDispatch(run), \
                ms.saved_tensors_hooks(weak_pack(run, Region.pack_recompute, drop_saved), keep_saved):
            with run.engine_ops():   # the inputs' views are ours, not ops of the region
                args, kwargs = rerun_inputs(args, kwargs)
            self.stop_after = self.stop_point()
            self.n_needed = len(self.token_meta)
            stopped = False
            try:
                out = self.fn(*args, **kwargs)
            except StopRerun:
                out, stopped = None, True
            finally:
                self.stop_after = None
            if outputs is not None:
                outputs.append(out)
        self.check_recompute(run, stopped)
        self.check_values(out, stopped)
        if stopped:
            self.stats.early_stops += 1
        else:
            self.keep_rerun_output(out)
        if self.recorder is not None:   # this call checked its signature for the light path
            recorder, self.recorder = self.recorder, None
            recorder.finish(self)


def run_region(fn, args, kwargs, **options):
    """Entry point of ``checkpoint``: forward a new region, replay a nested one, or run plainly."""
    top = ENGINE.top()
    if top is not None and top.mode in (RECOMPUTE, REPLAY):
        child = top.region.next_child(top)
        ENGINE.enter_recompute()
        try:
            return child.replay(args, kwargs, top.grad_calls)
        finally:
            ENGINE.exit_recompute()
    if top is None and not _executor.requires_grad():
        return fn(*args, **kwargs)   # no graph is recorded: nothing would be saved
    region = Region(fn, **options)
    if top is not None:
        top.region.children.append(region)
        if isinstance(top.region, Region):
            top.region.keep_intercepted("nested", "a recomputed region runs inside it")
    return region.run_forward(args, kwargs)
