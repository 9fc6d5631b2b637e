"""The op-intercepting way into a region: every op numbered and decided before it runs, each decision dispatched to
the rule objects of ``rules``. A region met inside another's forward is its child: the parent's recompute *replays*
it (same kept outputs, same masks)."""
import contextlib

from ..checkpoint_policy import CheckpointPolicy
from ..config import RecomputeConfig
from ..errors import RecomputeError
from ..mindspore_compat import EXECUTOR_CALLS
from ..precision import cell_precision
from ..tensors import cell_path_of, detached, root_cell_of, storage_info, tensor_leaves_in_objects
from . import messages
from .dispatch import REBUILD, SAVE, SWAP, RegionDispatch, StopRerun, arg_meta
from .rerun import RegionBase, RegionRun, Token, recompute_graph, rerun_inputs, saved_hooks
from .rules import alignment, kept_ops, must_swap, nesting, randomness, safety_net, writes
from .side_effects import buffers_as_before
from .state import ENGINE, FORWARD, RECOMPUTE


class Region(RegionBase):
    """One call on the op-intercepting path, from its forward to the end of its backward. ``recorder``: a
    ``path_choice.CheckRecorder`` when this call is the first of its call signature; ``settings``: the ``recompute``
    section apply_ac was given (the checkpoint API's ``early_stop`` keyword is its field); ``probe_index``: the wrapper's."""

    def __init__(self, fn, *, policy_fn, stats, swap_executor, swap_inputs, context_fn, tracker, root=None,
                 recorder=None, chain=None, debug=False, settings=None, rebind=None, probe_index=None):
        self.settings = settings if settings is not None else RecomputeConfig()
        self.root = root if root is not None else tracker.root if tracker is not None else root_cell_of(fn)
        self.writes = writes.Writes(self, self.root)
        super().__init__(fn, stats, context_fn, self.writes.param_ptrs, self.writes.params, chain, rebind)
        self.replaced.moved = self.writes.param_moved
        self.tracker, self.recorder = tracker, recorder
        self.op_names = []        # forward op names, to detect a diverging recompute
        self.op_paths = {}        # op index -> cell path, for ops that left tokens (for messages)
        self.decisions = {}       # op index -> SAVE / SWAP / REBUILD (absent: recompute)
        self.token_meta = {}      # key of a saved tensor dropped in forward -> its (shape, dtype)
        self.kept, self.swap = kept_ops.KeptOps(self, policy_fn), must_swap.MustSwap(self, swap_executor, swap_inputs)
        self.random, self.nesting = randomness.RandomOps(self), nesting.Nesting(self)
        self.align = alignment.Alignment(self, self.settings.early_stop, debug)
        self.net = safety_net.SafetyNet(self, recorder.check.probe_index if recorder is not None
                                        else probe_index if probe_index is not None else safety_net.SampleIndex())
        if recorder is not None:
            recorder.attach(self)
        elif self.intercept:   # never checked: say why once per call (a per-call policy, swapped inputs)
            stats.note_intercepted(self.intercept.values())

    def rules(self):
        return self.kept, self.swap, self.writes, self.random, self.align, self.nesting, self.net

    @property
    def intercept(self):
        """Why this call's signature stays intercepted (key -> reason): every rule's reasons, collected here."""
        return {key: reason for rule in self.rules() for key, reason in rule.reasons.items()}

    def keep_intercepted(self, key, reason):
        """A fact of this call outside the rules (a feature of a subclass) the light path can't reproduce."""
        self.nesting.keeps_intercepted(key, reason)

    def light_reproduces(self, key):
        """The light path reproduces decision ``key`` itself (Dropout mask bits, a random op drawn again from the
        forward's state, an op kept at its site): it no longer keeps the signature intercepted."""
        for rule in self.rules():
            rule.reasons.pop(key, None)

    def decide(self, run, idx, name, func, args, kwargs):
        """Decision for op ``idx`` in forward; random ops are kept whatever the policy says."""
        kept = self.kept
        policy = kept.ask(run, idx, name, func, args, kwargs) if kept.policy_fn is not None else None
        if kept.site_policy and self.recorder is not None:
            self.recorder.note_site(run, idx, name, args, policy is not None and not policy.recomputes)
        decision = self.random.decide(idx, name, args)
        if decision is not None or policy is None or policy.recomputes:
            return decision
        if policy is CheckpointPolicy.MUST_SWAP and self.swap.available():
            return SWAP
        kept.policy_saves[idx] = policy
        return SAVE

    def record_decision(self, idx, decision, args):
        """Op ``idx`` is kept, swapped or rebuilt instead of run again: before the call (legacy ops pack inside)."""
        self.decisions[idx] = decision
        self.align.arg_metas[idx] = arg_meta(args)
        rule = self.random if idx in self.random.ops else self.swap if decision == SWAP else self.kept
        rule.keeps_intercepted(("op", idx), f"op #{idx} {self.op_names[idx]} is {decision}d, not run again")
        if idx in self.kept.policy_saves:
            self.kept.note_args(idx, args)

    def pack_forward(self, run, t):
        """Forward pack hook: what the autograd graph keeps for ``t`` (itself, a swap holder or a Token)."""
        if run.in_hook:
            return t
        key = run.next_key()   # first: the recompute numbers every pack, weights included
        if EXECUTOR_CALLS.grad_calls() > run.grad_calls:
            return self.nesting.inner_grad_save(t)
        decision = self.decisions.get(key[0]) if key is not None else SAVE
        if self.recorder is not None and not (decision == REBUILD and run.in_cell_dropout):
            # as a light run numbers them: an nn.Dropout's apart, a functional dropout's as any op's (a kept
            # op's are filtered out when the check ends: whether it stays kept is known then, rule K2)
            self.recorder.note_forward(t, key)
        ptr = t.data_ptr()
        if ptr in self.writes.param_ptrs:
            return t
        base, nbytes = storage_info(t)
        storage = base, self.bytes.producer.get(base)
        self.kept.packed[storage] = nbytes
        if decision == SAVE and key is not None and self.kept.saves_argument(key, ptr):
            decision = None   # K1: a kept op keeps its outputs; an argument it saved is the re-run's
        elif decision == SAVE or (ptr in self.writes.input_ptrs and not self.swap.inputs):
            self.bytes.keep(t)
            if decision == SAVE:
                # An alias cut from autograd: an op that saves its own output (Softmax, Exp) and gets the
                # tensor itself back closes a loop inside MindSpore (its node -> the saved tensor -> that node)
                # that only its backward breaks; a forward whose backward never runs kept its model for good.
                with run.engine_ops():
                    return detached(t)
            return t
        elif decision == SWAP:
            return self.swap.offload(run, t)
        token = Token(self, key)
        self.writes.dropped.setdefault(storage, []).append(key)
        self.token_meta[key] = (tuple(t.shape), t.dtype)   # checked against the recompute's
        self.op_paths.setdefault(key[0], run.cell_path())
        if decision == REBUILD:
            run.pending.append((token, t))   # settled when the Dropout returns (RandomOps.finish_dropout)
        else:
            self.bytes.drop(t)
            self.net.note_drop(key, t)
        return token

    def pack_recompute(self, run, t):
        """Recompute pack hook: file each regenerated tensor under its forward key; the graph keeps nothing."""
        if run.in_hook:
            if run.noting_replay:   # a random op run again by its replay check: saves as a light re-run's would
                self.recorder.note_recompute(t)
            return None
        idx = run.current_op()
        if idx is not None and not self.align.fwd_npacks.get(idx) and idx not in self.decisions:
            self.align.realign(run, idx)
        key = run.next_key()
        if EXECUTOR_CALLS.grad_calls() > run.grad_calls:
            return t   # as in forward (Nesting.inner_grad_save)
        if self.recorder is not None and (key is None or (self.decisions.get(key[0]) != REBUILD
                                                            and key[0] not in self.kept.policy_saves)):
            # as in forward: a light run numbers Dropout packs apart and runs no kept op
            self.recorder.note_recompute(t)
        if key is not None and key in self.token_meta:
            self.recomputed[key] = t
            self.align.stop_if_done(run, key)
        return None

    def dropout_call(self, run, prim, x):
        return self.random.dropout_call(run, prim, x)

    def tracking(self):
        return self.tracker.active() if self.tracker is not None else contextlib.nullcontext()

    def run_forward(self, args, kwargs):
        run = RegionRun(self, FORWARD, self.tracker)
        self.precision = cell_precision(self.root)
        self.stats.intercepted_calls += 1
        ENGINE.push(run)
        try:
            with EXECUTOR_CALLS.counting():   # grad calls of its own (Nesting.inner_grad_save)
                self.start_forward()
                chained = self.link_chain(args, kwargs)
                self.writes.input_ptrs = set(self.save_inputs(args, kwargs, self.swap.input_offloader(run), chained))
                with self.run_context(FORWARD), self.tracking(), RegionDispatch(run), \
                        saved_hooks(run, Region.pack_forward, forward=True), \
                        self.replaced.watch((args, kwargs)):
                    out = self.fn(*args, **kwargs)
                with run.engine_ops():   # on the run, so that no enclosing region numbers the sample's op
                    self.net.take_samples(run, out)
                if self.root is not None:
                    self.writes.refuse_replaced(self.root)
                self.finish_forward(run, args, kwargs, out)   # its own ops: not an enclosing region's (N1)
        finally:
            ENGINE.pop(run)
        return out

    def finish_forward(self, run, args, kwargs, out):
        """What the end of the forward keeps, while ``run`` is on the ENGINE stack: an enclosing region's dispatch
        then does not number the ops it runs, which its re-run, replaying this region, would not run (N1)."""
        producer, packed = self.bytes.producer, self.kept.packed
        saved = self.writes.find_saved_outputs(tensor_leaves_in_objects(out), packed, producer)
        self.stamp(args, kwargs, out, saved)   # first: a held output counts against K2's bound
        self.kept.release_unread()
        self.keep_replaced()
        self.finish_chain(out)
        self.align.fwd_npacks = run.npacks
        self.swap.holders = None
        self.stats.open_region(self, self.bytes.close())

    def _recompute(self):
        try:
            self._rerun()
        except RecomputeError as exc:
            if self.align.debug_log is None:
                raise
            raise RecomputeError(f"{exc}\n{self.align.debug_log.side_by_side()}") from exc

    def _rerun(self):
        run = RegionRun(self, RECOMPUTE, self.tracker)
        self.recomputed = {}   # this backward's (R1)
        args, kwargs = self.load_inputs()
        outputs = self.nesting.rerun_outputs()
        with EXECUTOR_CALLS.counting(), self.replaced.rerun_from(), buffers_as_before(self.writes.snapshots.values()), \
                recompute_graph(run, self.precision, self.random_state, outputs), \
                self.run_context(RECOMPUTE), self.tracking(), RegionDispatch(run), \
                saved_hooks(run, Region.pack_recompute):
            with run.engine_ops():   # the inputs' views are ours, not ops of the region
                args, kwargs = rerun_inputs(args, kwargs)
            self.align.start_rerun()
            try:
                out, stopped = self.fn(*args, **kwargs), False
            except StopRerun:
                out, stopped = None, True
            finally:
                self.align.stop_after = None
            if outputs is not None:
                outputs.append(out)
        self.align.check(run, stopped)
        self.net.check(out, stopped)
        if stopped:
            self.stats.early_stops += 1
        else:
            self.keep_rerun_output(out)
        if self.recorder is not None:   # this call checked its signature for the light path
            recorder, self.recorder = self.recorder, None
            recorder.finish(self)

    def describe_op(self, idx):
        """``Name (in 'cell.path')`` of forward op ``idx``."""
        return messages.describe_op(self.op_names, self.op_paths, idx)

    def cell_path(self):
        """The region's cell path in its model (or its function's name)."""
        return cell_path_of(self.root) if self.root is not None else self.describe_root()

