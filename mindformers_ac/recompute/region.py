"""A checkpointed region: what one call of a wrapped function keeps, and how it is rebuilt.

Lifetime: a ``Region`` is created per call; the tokens left in the autograd
graph hold it, so it dies with the graph after backward (nothing global keeps
it). A region met inside another region's forward is recorded as that region's
child, so that the parent's recompute *replays* it (same kept outputs, same
dropout masks) instead of drawing new random numbers.
"""
import contextlib
import weakref

import mindspore as ms
from mindspore import Parameter, Tensor, ops
from ..mindspore_compat import pynative_executor as _executor

from ..precision import cell_precision, no_casts
from ..tensors import is_tracked, output_tensors, param_ptrs, root_cell_of, storage_info
from .dispatch import REBUILD, SAVE, SWAP, RegionDispatch, RegionRun
from .policy import CheckpointPolicy
from .random_ops import DropoutRecord, dropout_input, is_unreplayable_random_op
from .rerun import RerunOnce, SavedInput, recompute_graph, recompute_input
from .saved import SwappedTensor, drop_saved, keep_saved, unpack_saved
from .side_effects import KEEP, StateSnapshot, choose_handling, read_slots, replace_at, slot_ptrs, written_slots
from .state import ENGINE, FORWARD, RECOMPUTE, REPLAY
from .tracking import OpContext


def _meta(t):
    """What the divergence check compares of a saved tensor."""
    return tuple(t.shape), t.dtype


def _describe_meta(meta):
    return f"{meta[0]} {meta[1]}"


class Region(RerunOnce):
    """State of one checkpointed call, from its forward to the end of its backward."""

    def __init__(self, fn, *, policy_fn, stats, swap_executor, swap_inputs, context_fn, tracker, root=None,
                 profile=None):
        super().__init__()   # children: regions nested in this one's forward, in call order
        self.fn = fn
        self.policy_fn = policy_fn
        self.stats = stats
        self.swap_executor = swap_executor
        self.swap_inputs = swap_inputs
        self.context_fn = context_fn
        self.tracker = tracker
        if root is None:
            root = tracker.root if tracker is not None else root_cell_of(fn)
        self.root = root
        self.precision = None     # the mixed-precision type the forward ran under (see rerun)
        self.param_ptrs = param_ptrs(self.root.get_parameters()) if self.root is not None else set()
        self.input_ptrs = set()
        self.inputs = None
        self.decisions = {}       # op index -> SAVE / SWAP / REBUILD (absent: recompute)
        self.op_names = []        # forward op names, to detect a diverging recompute
        self.op_paths = {}        # op index -> cell path, for ops that left tokens (for messages)
        self.fwd_npacks = {}      # op index -> tensors it saved in forward
        self.cache = {}           # op index -> kept output (tensors or SwappedTensor)
        self.dropouts = {}        # op index -> DropoutRecord
        self.snapshots = {}       # op index -> StateSnapshot of a side-effect op's written tensors
        self.written = {}         # data_ptr -> (op index, StateSnapshot or None, slot) of its first write
        self.token_meta = {}      # key of a saved tensor dropped in forward -> its (shape, dtype)
        self.recomputed = {}      # key -> regenerated tensor, filled by the recompute
        # Profiling for the light path (see light.py): filled only when ``profile`` is given.
        self.profile = profile    # a LightProfile noting every save of forward and recompute
        if profile is not None:
            profile.attach(self)
        self.may_write_seen = False   # an op that may write tensors ran in forward
        self.cell_dropouts = set()    # op indices of Dropouts run by a DropoutProxy of an nn.Dropout
        self.totals = None        # (kept, dropped, swapped) bytes of the forward
        self._kept, self._swapped = {}, {}   # storage ptr -> bytes, during forward
        self._dropped = {}    # (storage ptr, producing op index) -> bytes, during forward
        self._producer = {}   # storage ptr -> index of the latest op whose output lives there
        self._swap_holders = {}   # (op index, ptr) -> SwappedTensor: one offload per storage and op

    # -- accounting -------------------------------------------------------------
    def account_kept(self, t):
        if t.data_ptr() in self.param_ptrs:
            return
        ptr, nbytes = storage_info(t)
        self._kept[ptr] = nbytes

    def note_outputs(self, idx, out):
        """Remember which op produced each output storage (see ``account_dropped``)."""
        for t in output_tensors(out):
            if isinstance(t, Tensor):
                self._producer[storage_info(t)[0]] = idx

    def account_dropped(self, t):
        # Dropped storages die during forward and their addresses are reused by later outputs:
        # keying by address alone would count two different activations once.
        ptr, nbytes = storage_info(t)
        self._dropped[(ptr, self._producer.get(ptr))] = nbytes

    def _finish_accounting(self):
        kept = sum(self._kept.values())
        dropped = sum(n for (p, _), n in self._dropped.items() if p not in self._kept)
        swapped = sum(n for p, n in self._swapped.items() if p not in self._kept)
        # Only the totals are needed from now on.
        self._kept = self._dropped = self._swapped = self._swap_holders = self._producer = None
        self.totals = (kept, dropped, swapped)
        self.stats.open_region(self, kept, dropped, swapped)

    # -- inputs -----------------------------------------------------------------
    def _save_input(self, run, a):
        if not isinstance(a, Tensor) or isinstance(a, Parameter):
            return a
        ptr = a.data_ptr()
        self.input_ptrs.add(ptr)
        tracked = is_tracked(a)
        detached = ops.stop_gradient(a)
        if self.swap_inputs and self.swap_executor is not None:
            return SavedInput(self.offload(run, detached, key=("input", ptr)), tracked)
        self.account_kept(a)
        return SavedInput(detached, tracked)

    def save_inputs(self, run, args, kwargs):
        if self.swap_inputs and self.swap_executor is None:
            ENGINE.warnings.warning(
                "swap_inputs", "checkpoint(swap_inputs=True) without a swap_executor: "
                "the region's inputs stay on the device (pass swap_executor= to offload them)")
        with no_casts():
            self.inputs = (tuple(self._save_input(run, a) for a in args),
                           {k: self._save_input(run, v) for k, v in kwargs.items()})

    def _load_inputs(self):
        """Inputs for the recompute: loaded if swapped, tracked by autograd exactly as in forward."""
        args, kwargs = self.inputs
        return tuple(recompute_input(a) for a in args), {k: recompute_input(v) for k, v in kwargs.items()}

    # -- swap -------------------------------------------------------------------
    def offload(self, run, t, key=None):
        ptr = t.data_ptr()
        key = key if key is not None else (run.current_op(), ptr)
        holder = self._swap_holders.get(key)
        if holder is None:
            run.in_hook = True   # the executor may run ops: they are not part of the region
            try:
                holder = SwappedTensor(self.swap_executor, t)
            finally:
                run.in_hook = False
            self._swap_holders[key] = holder
            sptr, nbytes = storage_info(t)
            self._swapped[sptr] = nbytes
        return holder

    # -- decisions --------------------------------------------------------------
    def ask_policy(self, run, idx, name, func, args, kwargs):
        ctx = OpContext(name, run.cell_path(), run.mode != FORWARD, idx, run.cell(),
                        run.attrs[-1] if run.attrs else None)
        run.in_hook = True   # a policy that runs ops must not shift the numbering
        try:
            policy = self.policy_fn(ctx, func, *args, **kwargs)
        finally:
            run.in_hook = False
        if not isinstance(policy, CheckpointPolicy):
            raise TypeError(f"policy_fn must return a CheckpointPolicy, got {policy!r} for op {ctx.op_path}")
        return policy

    def decide(self, run, idx, name, func, args, kwargs):
        """Decision for op ``idx`` in forward; random ops are kept whatever the policy says."""
        policy = self.ask_policy(run, idx, name, func, args, kwargs) if self.policy_fn is not None else None
        if is_unreplayable_random_op(name, args):
            if name == "Dropout" and dropout_input(args)[0] is not None:
                return REBUILD
            return SAVE
        if policy is None or policy.recomputes:
            return None
        if policy is CheckpointPolicy.MUST_SWAP:
            if self.swap_executor is not None:
                return SWAP
            ENGINE.warnings.warning(
                "must_swap", "policy_fn returned MUST_SWAP but checkpoint() got no "
                "swap_executor: saving those ops instead (pass swap_executor= to offload)")
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
            run.in_hook = True   # the copies are ours: they must not shift the op numbering
            try:
                with no_casts():
                    snapshot = StateSnapshot(args, slots)
            finally:
                run.in_hook = False
            self.snapshots[idx] = snapshot
            self._kept[("state", idx)] = snapshot.nbytes
        elif decision is None:
            decision = SAVE
            ENGINE.warnings.warning(
                ("keep_side_effect", name),
                "%s writes parameters larger than its other inputs: its output is kept "
                "instead of copying them for the recompute", name)
        for k, ptr in enumerate(slot_ptrs(args, slots)):
            self.written.setdefault(ptr, (idx, snapshot, k))
        return decision

    def rerun_args(self, run, idx, name, args):
        """Arguments for re-running op ``idx`` in a region that writes tensors.

        A side-effect op gets fresh copies of what it wrote (the real tensors
        were written once, in forward); an op reading such a tensor gets the
        run's copy (as it was at that point of the forward). A read of a tensor
        whose writer kept its output instead, before that write, can't be
        served: RuntimeError naming both ops.
        """
        run.in_hook = True   # copies are ours, not ops of the region
        try:
            with no_casts():
                return self._rerun_args(run, idx, name, args)
        finally:
            run.in_hook = False

    def _rerun_args(self, run, idx, name, args):
        snapshot = self.snapshots.get(idx)
        if snapshot is not None:
            return snapshot.args_for_rerun(args, run.written)
        served = {}
        for pos, ptr in read_slots(args, self.written):
            if ptr not in run.written:
                first, snap, k = self.written[ptr]
                if snap is None:
                    if idx < first:
                        raise RuntimeError(
                            f"mindformers_ac: op #{idx} {name}{self._in_path(run.cell_path())} of a "
                            f"recomputed region reads a tensor that op #{first} {self.describe_op(first)} "
                            "writes later in the region; that op's output is kept instead of a copy of "
                            "what it writes (too large to copy), so the recompute can't see the value "
                            f"the forward read. Keep {name}'s output too (exclude_op) or move the "
                            "write out of the recomputed region.")
                    continue   # after the write: the real tensor holds the written value
                run.written[ptr] = snap.fresh(k)
            served[pos] = run.written[ptr]
        return replace_at(args, served) if served else args

    # -- divergence checks -------------------------------------------------------
    @staticmethod
    def _in_path(path):
        return f" (in {path!r})" if path else ""

    def describe_op(self, idx):
        """``Name (in 'cell.path')`` of forward op ``idx``, for messages."""
        if idx >= len(self.op_names):
            return "<end of region>"
        return self.op_names[idx] + self._in_path(self.op_paths.get(idx, ""))

    def check_recompute(self, run):
        """After a recompute: raise unless it ran every op and re-saved what the forward dropped.

        Each re-run op that left tokens must save as many tensors as in forward,
        and each dropped tensor must come back with its shape and dtype. A
        mismatch means the tokens would take the wrong tensors: the error names
        the op and what differed, instead of failing later or silently.
        """
        n = len(self.op_names)
        if run.op_idx + 1 < n:
            i = run.op_idx + 1
            raise RuntimeError(
                f"mindformers_ac: recompute diverged from forward: it ran {i} ops, the forward ran {n}; "
                f"the first missing op is #{i} {self.describe_op(i)}. A checkpointed region must take the "
                "same code path when run again (no branching on global state, step counters or "
                "is_in_recompute() that changes ops).")
        for key, meta in self.token_meta.items():
            idx, k = key
            if self.decisions.get(idx) is not None:
                continue   # kept or rebuilt: not run again, its tokens are served otherwise
            fwd, rec = self.fwd_npacks.get(idx, 0), run.npacks.get(idx, 0)
            if fwd != rec:
                raise RuntimeError(
                    f"mindformers_ac: recompute diverged from forward at op #{idx} {self.describe_op(idx)}: "
                    f"it saved {fwd} tensor(s) for backward in forward but {rec} in the recompute, so its "
                    "dropped tensors can't be matched. An op saves different tensors when autograd tracks "
                    "different inputs: e.g. a tensor the region reads from outside its arguments (a "
                    "closure or an attribute set by the caller) that requires grad in only one of the runs; "
                    "pass it as an argument of the region.")
            t = self.recomputed.get(key)
            got = _meta(t) if t is not None else None
            if got != meta:
                raise RuntimeError(
                    f"mindformers_ac: recompute diverged from forward at op #{idx} {self.describe_op(idx)}: "
                    f"its saved tensor #{k} was {_describe_meta(meta)} in forward but "
                    f"{_describe_meta(got) if got else 'not saved'} in the recompute. The region must "
                    "compute the same shapes and dtypes when run again (no dependence on state that "
                    "changed since the forward).")

    # -- kept outputs -----------------------------------------------------------
    def cache_output(self, run, idx, out):
        if self.decisions[idx] == SWAP:
            self.cache[idx] = tuple(self.offload(run, t) if isinstance(t, Tensor) else t
                                    for t in output_tensors(out)), isinstance(out, (tuple, list))
            return
        for t in output_tensors(out):
            if isinstance(t, Tensor):
                self.account_kept(t)
        self.cache[idx] = out

    def cached_output(self, idx):
        out = self.cache[idx]
        if self.decisions[idx] != SWAP:
            return out
        items, is_seq = out
        items = tuple(t.load() if isinstance(t, SwappedTensor) else t for t in items)
        return items if is_seq else items[0]

    def finish_dropout(self, run, idx, args, out):
        """Keep a Dropout as mask bits when its output can be rebuilt bitwise, else keep its outputs."""
        pending, run.pending = run.pending, []
        x, keep_prob = dropout_input(args)
        output, mask = out
        if not ENGINE.dropout_formula_ok(x, output, mask, keep_prob):
            self.decisions[idx] = SAVE
            for token, t in pending:
                token.tensor = t
                self.token_meta.pop(token.key, None)
                self.account_kept(t)
            self.cache_output(run, idx, out)
            return
        record = DropoutRecord(mask, keep_prob)
        ptrs = [output.data_ptr(), mask.data_ptr()]
        for token, t in pending:
            ptr = t.data_ptr()
            if ptr in ptrs:
                record.pack_outputs.append((token.key[1], ptrs.index(ptr)))
                self.account_dropped(t)
            else:   # something other than its outputs: keep it as is
                token.tensor = t
                self.token_meta.pop(token.key, None)
                self.account_kept(t)
        self.dropouts[idx] = record
        self._kept[("bits", idx)] = record.nbytes

    def rebuild_dropout(self, run, idx, args):
        record = self.dropouts[idx]
        run.in_hook = True   # the rebuild's own ops save nothing for this region
        try:
            out = record.rebuild(dropout_input(args)[0])
        finally:
            run.in_hook = False
        if run.mode == RECOMPUTE:
            for k, j in record.pack_outputs:
                if (idx, k) in self.token_meta:
                    self.recomputed[(idx, k)] = out[j]
        return out

    # -- runs -------------------------------------------------------------------

    def _tracking(self):
        return self.tracker.active() if self.tracker is not None else contextlib.nullcontext()

    def run_forward(self, args, kwargs):
        run = RegionRun(self, FORWARD)
        self.precision = cell_precision(self.root)
        ENGINE.push(run)
        try:
            self.save_inputs(run, args, kwargs)
            with self.run_context(FORWARD), self._tracking(), RegionDispatch(run), \
                    ms.saved_tensors_hooks(run.pack_forward, unpack_saved):
                out = self.fn(*args, **kwargs)
        finally:
            ENGINE.pop(run)
        self.fwd_npacks = run.npacks
        self._finish_accounting()
        return out

    def replay(self, args, kwargs):
        """Run again inside a parent's recompute, with this region's kept outputs and masks."""
        run = RegionRun(self, REPLAY)
        ENGINE.push(run)
        try:
            with self.run_context(REPLAY), self._tracking(), RegionDispatch(run), \
                    ms.saved_tensors_hooks(drop_saved, keep_saved):
                return self.fn(*args, **kwargs)
        finally:
            ENGINE.pop(run)

    def ensure_recomputed(self):
        if self.done:
            return
        self.recompute_once()
        self.stats.recompute_calls += 1
        if self.profile is not None:   # this call profiled its signature for the light path
            profile, self.profile = self.profile, None
            profile.validate(self)

    def _recompute(self):
        run = RegionRun(self, RECOMPUTE)
        args, kwargs = self._load_inputs()
        wrun = weakref.ref(run)   # the recompute graph may outlive this call: don't let it own the run

        def pack(t):
            r = wrun()
            return r.pack_recompute(t) if r is not None else None

        with recompute_graph(run, self.precision), self.run_context(RECOMPUTE), self._tracking(), \
                RegionDispatch(run), \
                ms.saved_tensors_hooks(pack, keep_saved):
            self.fn(*args, **kwargs)
        self.check_recompute(run)


def run_region(fn, args, kwargs, **options):
    """Entry point of ``checkpoint``: forward a new region, replay a nested one, or run plainly."""
    top = ENGINE.top()
    if top is not None and top.mode in (RECOMPUTE, REPLAY):
        child = top.region.next_child(top)
        ENGINE.enter_recompute()
        try:
            return child.replay(args, kwargs)
        finally:
            ENGINE.exit_recompute()
    if top is None and not _executor.requires_grad():
        return fn(*args, **kwargs)   # no graph is recorded: nothing would be saved
    region = Region(fn, **options)
    if top is not None:
        top.region.children.append(region)
    return region.run_forward(args, kwargs)
