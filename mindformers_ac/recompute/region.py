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
from mindspore.graph.api import _pynative_executor as _executor

from ..tensors import output_tensors, param_ptrs, root_cell_of, storage_info
from .dispatch import REBUILD, SAVE, SWAP, RegionDispatch, RegionRun
from .policy import CheckpointPolicy
from .random_ops import DropoutRecord, dropout_input, is_unreplayable_random_op
from .saved import SwappedTensor, drop_saved, keep_saved, unpack_saved
from .state import ENGINE, FORWARD, RECOMPUTE, REPLAY
from .tracking import OpContext


_FLOAT_TYPES = (ms.float16, ms.float32, ms.float64, ms.bfloat16)


def _recompute_input(a):
    if isinstance(a, SwappedTensor):
        a = a.load()
    # Without grad on some input, ops fed only by inputs and rebuilt tensors would record nothing
    # in the recompute graph, and their saved tensors would never be regenerated.
    if isinstance(a, Tensor) and a.dtype in _FLOAT_TYPES:
        a = ops.stop_gradient(a)
        a.requires_grad_()
    return a


class Region:
    """State of one checkpointed call, from its forward to the end of its backward."""

    def __init__(self, fn, *, policy_fn, stats, swap_executor, swap_inputs, context_fn, tracker):
        self.fn = fn
        self.policy_fn = policy_fn
        self.stats = stats
        self.swap_executor = swap_executor
        self.swap_inputs = swap_inputs
        self.context_fn = context_fn
        self.tracker = tracker
        self.root = tracker.root if tracker is not None else root_cell_of(fn)
        self.param_ptrs = param_ptrs(self.root.get_parameters()) if self.root is not None else set()
        self.input_ptrs = set()
        self.inputs = None
        self.decisions = {}       # op index -> SAVE / SWAP / REBUILD (absent: recompute)
        self.op_names = []        # forward op names, to detect a diverging recompute
        self.cache = {}           # op index -> kept output (tensors or SwappedTensor)
        self.dropouts = {}        # op index -> DropoutRecord
        self.token_keys = set()   # keys of saved tensors dropped in forward
        self.recomputed = {}      # key -> regenerated tensor, filled by the recompute
        self.children = []        # regions nested in this one's forward, in call order
        self.done = False
        self._running = False
        self._recompute_ctx = None
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
        self.stats.open_region(self, kept, dropped, swapped)

    # -- inputs -----------------------------------------------------------------
    def _save_input(self, run, a):
        if not isinstance(a, Tensor) or isinstance(a, Parameter):
            return a
        ptr = a.data_ptr()
        self.input_ptrs.add(ptr)
        detached = ops.stop_gradient(a)
        if self.swap_inputs and self.swap_executor is not None:
            return self.offload(run, detached, key=("input", ptr))
        self.account_kept(a)
        return detached

    def save_inputs(self, run, args, kwargs):
        if self.swap_inputs and self.swap_executor is None:
            ENGINE.warnings.warning("swap_inputs", "checkpoint(swap_inputs=True) without a swap_executor: "
                             "the region's inputs stay on the device (pass swap_executor= to offload them)")
        self.inputs = (tuple(self._save_input(run, a) for a in args),
                       {k: self._save_input(run, v) for k, v in kwargs.items()})

    def _load_inputs(self):
        """Inputs for the recompute: loaded if swapped, and requiring grad so that ops record saves."""
        args, kwargs = self.inputs
        return tuple(_recompute_input(a) for a in args), {k: _recompute_input(v) for k, v in kwargs.items()}

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
            ENGINE.warnings.warning("must_swap", "policy_fn returned MUST_SWAP but checkpoint() got no "
                             "swap_executor: saving those ops instead (pass swap_executor= to offload)")
        return SAVE

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
                self.token_keys.discard(token.key)
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
                self.token_keys.discard(token.key)
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
                if (idx, k) in self.token_keys:
                    self.recomputed[(idx, k)] = out[j]
        return out

    # -- runs -------------------------------------------------------------------
    def _contexts(self, mode):
        if self.context_fn is None:
            return contextlib.nullcontext()
        if mode == FORWARD:
            fwd, self._recompute_ctx = self.context_fn()
            return fwd
        if mode == RECOMPUTE and self._recompute_ctx is not None:
            ctx, self._recompute_ctx = self._recompute_ctx, None
            return ctx
        return self.context_fn()[1]

    def _tracking(self):
        return self.tracker.active() if self.tracker is not None else contextlib.nullcontext()

    def run_forward(self, args, kwargs):
        run = RegionRun(self, FORWARD)
        ENGINE.push(run)
        try:
            self.save_inputs(run, args, kwargs)
            with self._contexts(FORWARD), self._tracking(), RegionDispatch(run), \
                    ms.saved_tensors_hooks(run.pack_forward, unpack_saved):
                out = self.fn(*args, **kwargs)
        finally:
            ENGINE.pop(run)
        self._finish_accounting()
        return out

    def next_child(self, run):
        if run.child_idx >= len(self.children):
            raise RuntimeError("mindformers_ac: a checkpointed region called more nested checkpoints in its "
                               "recompute than in its forward; its code path must not change when re-run")
        child = self.children[run.child_idx]
        run.child_idx += 1
        return child

    def replay(self, args, kwargs):
        """Run again inside a parent's recompute, with this region's kept outputs and masks."""
        run = RegionRun(self, REPLAY)
        ENGINE.push(run)
        try:
            with self._contexts(REPLAY), self._tracking(), RegionDispatch(run), \
                    ms.saved_tensors_hooks(drop_saved, keep_saved):
                return self.fn(*args, **kwargs)
        finally:
            ENGINE.pop(run)

    def ensure_recomputed(self):
        if self.done:
            return
        if self._running:
            raise RuntimeError("mindformers_ac: a region's recompute asked for its own saved tensors")
        self._running = True
        try:
            self._recompute()
        finally:
            self._running = False
        self.done = True
        self.stats.recompute_calls += 1

    def _recompute(self):
        run = RegionRun(self, RECOMPUTE)
        args, kwargs = self._load_inputs()
        wrun = weakref.ref(run)   # the recompute graph may outlive this call: don't let it own the run

        def pack(t):
            r = wrun()
            return r.pack_recompute(t) if r is not None else None

        grad_flag, enable_grad = _executor.grad_flag(), _executor.enable_grad()
        ENGINE.enter_recompute()
        ENGINE.push(run)
        try:
            _executor.set_grad_flag(True)
            _executor.set_enable_grad(True)
            _executor.new_empty_graph()
            try:
                with self._contexts(RECOMPUTE), self._tracking(), RegionDispatch(run), \
                        ms.saved_tensors_hooks(pack, keep_saved):
                    self.fn(*args, **kwargs)
            finally:
                _executor.end_empty_graph()
        finally:
            _executor.set_grad_flag(grad_flag)
            _executor.set_enable_grad(enable_grad)
            ENGINE.pop(run)
            ENGINE.exit_recompute()


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
