"""What every recompute region shares, whichever way it was entered: one engine, two ways in.

A region is one call of a checkpointed function, from its forward to the end of its backward; the op-intercepting
``Region`` and the ``LightRegion`` differ only in how they decide what to save. Everything else is here, once (what,
and the invariants: docs/architecture.md, "The recompute engine's mechanisms"; the rules: docs/exactness.md). The
engine's own ops in a region run under ``no_casts``.
"""
import contextlib
import weakref

import mindspore as ms
from mindspore import Parameter, Tensor, ops

from ..ledger import ActivationLedger
from ..mindspore_compat import EXECUTOR_CALLS, RandomState, autodiff_engine_id, no_grad, tensor_stamp
from ..mindspore_compat import pynative_executor as _executor
from ..precision import no_casts, under_precision
from ..tensors import detached, is_tracked, tensor_leaves_in_objects, version_alias
from . import messages
from .chain import first_output
from .markers import context_pair
from .random_ops import DropoutRecord
from .side_effects import ReboundParameters
from .state import ENGINE, FORWARD, RECOMPUTE

# stateless and reentrant: one instance serves every call that has nothing to enter (no object per call)
_NO_CONTEXT = contextlib.nullcontext()


# What a region's pack hook leaves in the autograd graph in place of a saved tensor: a Token for one dropped
# for recompute (it holds the region, not the tensor, until backward), a SwappedTensor for one handed to a
# swap executor; unpack_saved turns either back into a tensor.
class SwappedTensor:
    __slots__ = ("executor", "handle")

    def __init__(self, executor, tensor):
        self.executor, self.handle = executor, executor.offload(tensor)

    def load(self):
        return self.executor.load(self.handle)


class Token:
    __slots__ = ("region", "key", "tensor")

    def __init__(self, region, key):
        self.region, self.key, self.tensor = region, key, None

    def resolve(self):
        if self.tensor is not None:
            return self.tensor
        region = self.region
        t = region.ensure_recomputed().pop(self.key, None)
        if t is None:
            # The recompute checked that it regenerated every dropped tensor (Alignment.check) but
            # those of ops it skipped under the marker, so a missing one was skipped or handed out already.
            idx, k = self.key
            if idx in region.align.skipped:
                raise messages.skipped_op_needed(idx, region.describe_op(idx), region.cell_path())
            raise messages.already_used(f"saved tensor #{k} of op #{idx} {region.describe_op(idx)}", region.cell_path())
        return t


def unpack_saved(obj):
    """Unpack hook shared by all region forwards."""
    if isinstance(obj, Token):
        return obj.resolve()
    if isinstance(obj, SwappedTensor):
        return obj.load()
    return obj


def keep_saved(obj):
    return obj


def saved_hooks(run, pack, forward=False):
    """The saved-tensor hooks of ``run``: ``pack(region, run, t)`` while ``run`` lives; once it is gone a forward's
    graph keeps what it packs (``unpack_saved`` resolves it), a re-run's or a replay's graph (never backpropagated)
    nothing. MindSpore keeps a hook function as long as the graph that used it (an inner grad call's made in a forward
    outlived every step: one region a step kept, ``test_an_inner_grad_call_keeps_no_region_alive``): the hook holds
    the run, and so the region, weakly."""
    wrun = weakref.ref(run)

    def hook(t):
        r = wrun()
        if r is not None:
            return pack(r.region, r, t)
        return t if forward else None
    return ms.saved_tensors_hooks(hook, unpack_saved if forward else keep_saved)


class RegionRun:
    """One execution (forward, recompute or replay) of a region's function: its ENGINE stack entry. ``tracker``: the
    region's ``PathTracker``, or None (path hooks and op slots' track role act only for their own tracker's runs)."""

    __slots__ = ("region", "mode", "tracker", "op_idx", "inside", "last", "npacks", "path", "attrs",
                 "child_idx", "in_hook", "pending", "written", "dropout_idx", "in_cell_dropout", "noting_replay",
                 "asked_marker", "keeps", "keep_idx", "metadata_read", "grad_calls", "__weakref__")

    def __init__(self, region, mode, tracker=None):
        self.region, self.mode, self.tracker = region, mode, tracker
        self.op_idx = -1
        self.inside = []       # op indices whose call is in progress (legacy ops pack inside)
        self.last = None       # index of the op that returned last (pyboost ops pack after)
        self.npacks = {}       # op index -> packs so far
        self.path = []         # [(name, cell)] of sub-cells entered, maintained by PathTracker
        self.attrs = []        # (OpSlot, its path) of the op attributes being called (innermost last)
        self.child_idx = 0     # nested regions met so far
        self.in_hook = False   # our own code running ops (swap offload, Dropout rebuild): not the region's
        self.pending = []      # (token, tensor) packed inside a Dropout call, settled when it returns
        self.written = {}      # recompute/replay: data_ptr of a tensor the region writes -> this run's copy
        self.dropout_idx = 0   # nn.Dropout calls so far (light path)
        self.in_cell_dropout = False   # an nn.Dropout's kernel call through its slot is running
        self.noting_replay = False     # CheckRecorder.check_replay's run of a random op: note its saves
        self.asked_marker = False      # a re-run whose code asked is_in_recompute(): may skip side effects
        self.keeps = None      # light path: the OpSlots whose calls this run keeps (keep_sites)
        self.keep_idx = 0      # light recompute: kept calls handed back so far
        self.metadata_read = {}   # re-run or replay: key -> replay metadata values read so far (markers)
        self.grad_calls = EXECUTOR_CALLS.grad_calls()   # more while a save is made: a grad call of the run's own

    @contextlib.contextmanager
    def engine_ops(self):
        """Ops the engine runs in the middle of the region's code: no op of the region."""
        in_hook, self.in_hook = self.in_hook, True
        try:
            yield
        finally:
            self.in_hook = in_hook

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


class SavedInput:
    """A region input kept for the recompute, and whether autograd tracked it in forward; ``written``: the forward
    writes it in place, so ``value`` is a private copy taken before that write."""

    __slots__ = ("value", "tracked", "ptr", "written")

    def __init__(self, value, tracked, ptr):
        self.value, self.tracked, self.ptr, self.written = value, tracked, ptr, False

    @classmethod
    def of(cls, a):
        return cls(detached(a), is_tracked(a), a.data_ptr())


def map_inputs(fn, args, kwargs):
    """``(args, kwargs)`` with each argument ``a`` (at position or keyword ``key``) replaced by ``fn(key, a)``."""
    return tuple(fn(i, a) for i, a in enumerate(args)), {k: fn(k, v) for k, v in kwargs.items()}


class ChainedInput:
    """A layer group member's first argument, not kept: the previous member's ``region`` rebuilds it (``chain``);
    ``tracked`` and ``ptr`` as for ``SavedInput``."""

    __slots__ = ("region", "tracked", "ptr")

    def __init__(self, region, tracked, ptr):
        self.region, self.tracked, self.ptr = region, tracked, ptr


def recompute_input(a):
    """A saved input as the recompute must see it: loaded, detached, tracked exactly as in forward (why, for int and
    bool inputs too: docs/exactness.md, "Int and bool inputs"; an input tracked in only one run makes its consumers
    save another number of tensors, and the forward's tokens would take the wrong ones)."""
    if not isinstance(a, SavedInput):
        return a   # not a tensor, or a Parameter: passed as is
    tracked, a = a.tracked, a.value
    if isinstance(a, SwappedTensor):
        a = a.load()
    a = detached(a)
    if tracked:
        a.requires_grad_()
    return a


def _region_input(a):
    """``recompute_input(a)``, to be handed to the re-run through an op when it must (``_RerunInput``): the forward's
    input came out of an op; the re-run's must too, or an in-place write into it fails as a write into a leaf
    (setitem: "input tensor from network"; ``copy_``: "leaf tensor that requires grad"). A view costs nothing; a
    ``copy_`` target needs a copy of its own, so the saved one stays as it was (``* 1``: a recorded, exact copy;
    ``deepcopy`` would not be tracked)."""
    if isinstance(a, ChainedInput):   # runs the previous member's re-run first
        a = SavedInput(a.region.rerun_output(), a.tracked, a.ptr)
    t = recompute_input(a)
    if not isinstance(a, SavedInput):
        return t
    if a.written:
        return _RerunInput(t, "copy" if a.tracked else "deepcopy")
    return _RerunInput(t, "view") if a.tracked else t


class _RerunInput:
    """A saved input that the re-run gets through an op, made inside the re-run's graph (``rerun_inputs``)."""

    __slots__ = ("tensor", "how")

    def __init__(self, tensor, how):
        self.tensor, self.how = tensor, how

    def made(self):
        t = self.tensor
        if self.how == "view":
            return t.view(t.shape)
        return t * 1 if self.how == "copy" else ops.deepcopy(t)


def rerun_inputs(args, kwargs):
    """``load_inputs``' arguments with each ``_RerunInput`` made: call inside ``recompute_graph``."""
    return map_inputs(lambda _, a: a.made() if isinstance(a, _RerunInput) else a, args, kwargs)


def _rerun_top_cell():
    """What names the top cell a re-run records in when its function makes grad calls of its own."""


@contextlib.contextmanager
def recompute_graph(run, precision=None, random_state=None, outputs=None):
    """Run a region's function again as ``run``: recording on, in a new graph, under the forward's mixed-precision
    type ``precision`` and from the forward's ``random_state``; everything restored on every exit path (the random
    state to what it was before the re-run). ``run`` None: nothing on the engine stack (an op output's re-run, whose
    forward had no run either).

    ``outputs``: None for the throw-away graph (``new_empty_graph``); a list, for a function that makes grad calls
    of its own (docs/exactness.md, "Higher-order gradients and nested regions"; without it the second such call
    fails: "The pointer[top_cell_] is null"): a top cell of its own (``new_graph``), ended with the output the
    caller appends to ``outputs``.
    """
    grad_flag, enable_grad = _executor.grad_flag(), _executor.enable_grad()
    current = RandomState() if random_state is not None else None   # the random state to restore
    if random_state is not None:
        random_state.restore()
    ENGINE.enter_recompute()
    if run is not None:
        ENGINE.push(run)
    try:
        _executor.set_grad_flag(True)
        _executor.set_enable_grad(True)
        if outputs is None:
            _executor.new_empty_graph()
        else:
            _executor.new_graph(_rerun_top_cell)
        try:
            with under_precision(precision):
                yield
            if outputs:
                _executor.end_graph(_rerun_top_cell, outputs[0])
        finally:
            if outputs is None:
                _executor.end_empty_graph()
    finally:
        _executor.set_grad_flag(grad_flag)
        _executor.set_enable_grad(enable_grad)
        if run is not None:
            ENGINE.pop(run)
        ENGINE.exit_recompute()
        if current is not None:
            current.restore()


class RegionBase:
    """One checkpointed call, whichever way it was entered: a subclass runs the forward (``save_inputs`` first,
    ``bytes.close`` at the end) and defines ``_recompute()`` and ``dropout_call``. What a forward leaves in the graph
    holds the region, so it dies with the graph after backward."""

    def __init__(self, fn, stats, context_fn, param_ptrs, params=(), chain=None, rebind=None):
        self.fn, self.stats, self.context_fn = fn, stats, context_fn
        self.chain = chain           # (LayerChain, member index) of a layer group, or None
        self.feeds_next = False      # a group's next member rebuilds its first argument from this re-run's output
        self._rerun_out = None
        # the root's Parameters, whose rebinding the forward watches (``replaced.watch``, through the wrapper's
        # ``RebindSlots`` ``rebind``) and the re-run undoes around itself (``replaced.rerun_from``)
        self.replaced = ReboundParameters(params, rebind)
        self.precision = None     # the mixed-precision type the forward ran under
        self.random_state = None  # RandomState when the forward started (start_forward)
        self.metadata = None      # key -> list of values the forward saved for the re-run (markers)
        self.inputs = None        # (args, kwargs) with SavedInputs in place of tensors
        self.children = []        # regions nested in this one's forward, in call order
        self.bytes = ActivationLedger(param_ptrs)
        self.stamps = ()             # (weakref or held view, stamp, description) of what a later write must not touch
        self.held_saves = {}         # save key (or light position) -> held output it saved: served, not rebuilt (W6)
        self.recomputed = None       # what the re-run running now rebuilt (``_recompute`` fills it)
        self.reruns = {}             # autodiff engine id -> its re-run's ``recomputed``, taken on unpack (R1)
        self._running = False
        self._recompute_ctx = None   # the recompute context made with this call's forward context

    def start_forward(self):
        """Once the forward's run is on the ENGINE stack (so no enclosing region numbers the snapshot's op)."""
        self.random_state = RandomState()

    def keep_replaced(self):
        for i, (_, c) in enumerate(self.replaced.before.values()):
            self.bytes.keep_bytes(("replaced", i), int(c.nbytes))

    # -- writes after the forward (rule W6) -------------------------------------------------------------
    def stamp(self, args, kwargs, out, saved_outputs):
        """At the end of the forward: stamp the region's tensor inputs, which the re-run reads through the aliases
        it saved, and hold the outputs an op of the region saved for backward (``saved_outputs``: position in
        ``tensor_leaves_in_objects(out)`` -> the keys of its dropped saves). Inputs are held weakly (the saved alias
        has its own version counter, so the caller's tensor is stamped: once it dies nobody writes it). A saved
        output is held as a view (counted as kept), as the graph holds it without AC, and its dropped
        saves are served from that view, not rebuilt (rule W6): the backward then reads what the code after the
        region wrote into it without a new version (``ops.assign_add``, ``ops.assign``), as without AC."""
        stamps = []
        for i, a in enumerate((*args, *kwargs.values())):
            if isinstance(a, Tensor) and not isinstance(a, Parameter):
                stamps.append((weakref.ref(a), tensor_stamp(a), f"input #{i}"))
        if saved_outputs:
            leaves = tensor_leaves_in_objects(out)
            for j, keys in saved_outputs.items():
                if j >= len(leaves):
                    continue   # a light call's output holds fewer tensors than its checking call's
                t = leaves[j]
                self.bytes.keep(t)
                # not the output itself, which would tie the region to its own graph: a cycle through MindSpore's C++
                # nodes that a step failing before backward never frees
                with no_grad():
                    held = version_alias(t)
                stamps.append((held, tensor_stamp(t), f"output #{j}"))
                self.held_saves.update(dict.fromkeys(keys, held))
        self.stamps = stamps

    def cell_path(self):
        """The region's cell path in its model, for messages (its root's class, or its function's name, here)."""
        return self.describe_root()

    def describe_root(self):
        root = getattr(self, "root", None)
        return type(root).__name__ if root is not None else getattr(self.fn, "__qualname__", "function")

    # -- layer groups (see ``chain``) -----------------------------------------------------------------
    def link_chain(self, args, kwargs=None):
        """As a group member's forward starts: ``(the previous member's region, the position or keyword its output
        went into)`` (None: the first member, or no group). ``RecomputeError`` when no argument is that member's
        output."""
        if self.chain is None:
            return None
        link = self.chain[0].link(self.chain[1], args, kwargs)
        if link is not None:
            link[0].feeds_next = True
            self.stats.chained_calls += 1
        return link

    def finish_chain(self, out):
        if self.chain is not None:
            self.chain[0].done(self.chain[1], self, out)

    def keep_rerun_output(self, out):
        if self.feeds_next:
            self._rerun_out = first_output(out)

    def rerun_output(self):
        """The first output of this region's re-run (run now if it has not run yet), handed out once."""
        self.ensure_recomputed()
        out, self._rerun_out = self._rerun_out, None
        if out is None:
            raise messages.already_used("the output a layer group's next layer is rebuilt from", self.cell_path())
        return out

    # -- inputs ---------------------------------------------------------------------------------------
    def save_inputs(self, args, kwargs, offload=None, chained=None):
        """Keep the tensor arguments for the recompute, detached, with whether autograd tracked them (``SavedInput``);
        returns the storage pointers of those kept. Holding a tracked one with its graph node instead would tie the
        region to the graph that holds it (a cycle through MindSpore's C++ nodes, which Python's collector can't
        break: tried, the checking call's regions outlived every step, ``test_fifty_steps_do_not_grow``).
        ``offload(tensor, ptr) -> holder`` hands them to a swap executor instead of keeping them on the device.
        Parameters (read at recompute time) and non-tensors are passed as they are. ``chained``: ``(the previous
        member's region, a position or keyword)`` in a layer group (``link_chain``), whose argument is rebuilt from
        that region (``ChainedInput``), not kept."""
        ptrs = []
        where = link = None
        if chained is not None:   # not among the returned pointers: what an op saves of it is dropped too
            region, where = chained
            value = args[where] if isinstance(where, int) else kwargs[where]
            link = ChainedInput(region, is_tracked(value), value.data_ptr())

        def save(key, a):
            if key == where:
                return link
            if not isinstance(a, Tensor) or isinstance(a, Parameter):
                return a
            saved = SavedInput.of(a)
            ptrs.append(saved.ptr)
            if offload is not None:
                saved.value = offload(saved.value, saved.ptr)
            else:
                self.bytes.keep(a)
            return saved

        with no_casts():   # the engine's own op: a saved input keeps its dtype
            self.inputs = map_inputs(save, args, kwargs)
        return ptrs

    def protect_input(self, ptr):
        """Before an op of the forward writes the saved input at ``ptr`` in place: keep a private copy of it as it
        is now, for the re-run (which writes it again, into a copy of that copy). Returns whether ``ptr`` is a saved
        input kept on the device."""
        args, kwargs = self.inputs
        for saved in (*args, *kwargs.values()):
            if isinstance(saved, SavedInput) and saved.ptr == ptr and isinstance(saved.value, Tensor):
                if not saved.written:
                    with no_grad(), no_casts():
                        saved.value = ops.deepcopy(saved.value)
                    saved.written = True
                    self.bytes.keep(saved.value)
                return True
        return False

    def load_inputs(self):
        """The saved arguments for the recompute; pass them through ``rerun_inputs`` inside the re-run's graph."""
        return map_inputs(lambda _, a: _region_input(a), *self.inputs)

    # -- Dropout ------------------------------------------------------------------------------------
    def keep_dropout(self, key, x, out, keep_prob, packed):
        """Settle one Dropout kernel call of the forward, on either path (``out``: its ``(output, mask)``;
        ``packed``: the tensors it saved for backward, in order): a ``DropoutRecord`` of its mask bits (counted
        under ``("bits", key)``), or of its outputs, ``kept`` and counted, when the formula does not reproduce this
        dtype and keep_prob bitwise. Returns it and, per packed tensor, the index in ``(output, mask)`` it is
        rebuilt as, or None: kept as it is (and counted)."""
        record = DropoutRecord(x, out, keep_prob, ENGINE.dropout_formula_ok(x, *out, keep_prob))
        ptrs = []
        if record.kept is not None:
            for t in out:
                self.bytes.keep(t)
        else:
            self.bytes.keep_bytes(("bits", key), int(record.bits.nbytes))
            ptrs = [t.data_ptr() for t in out]
        where = [ptrs.index(t.data_ptr()) if t.data_ptr() in ptrs else None for t in packed]
        for t, j in zip(packed, where):
            if j is None:
                self.bytes.keep(t)
        return record, where

    # -- runs ------------------------------------------------------------------------------------------
    def run_context(self, mode):
        if self.context_fn is None:
            return _NO_CONTEXT
        if mode == FORWARD:
            fwd, self._recompute_ctx = context_pair(self.context_fn)
            return fwd
        if mode == RECOMPUTE and self._recompute_ctx is not None:
            ctx, self._recompute_ctx = self._recompute_ctx, None
            return ctx
        return context_pair(self.context_fn)[1]

    def next_child(self, run):
        if run.child_idx >= len(self.children):
            raise messages.nested_regions(len(self.children), self.cell_path())
        child = self.children[run.child_idx]
        run.child_idx += 1
        return child

    def ensure_recomputed(self):
        """What the re-run of the running backward rebuilt and no unpack took yet: re-run now on its first unpack.
        Rule R1 of docs/exactness.md: each backward that reaches the region's saved tensors gets a re-run of its own,
        keyed by MindSpore's autodiff engine (``autodiff_engine_id``), as MindSpore's non-reentrant recompute and
        PyTorch's (keyed by the graph task) do: the backward of a grad of a grad reaches them a second time. Raises
        ``RecomputeError`` for a recompute that asks for its own saved tensors, or that diverged from its forward
        (``_recompute``); that engine then has no re-run."""
        engine = autodiff_engine_id()
        saved = self.reruns.get(engine)
        if saved is not None:
            return saved
        if self._running:
            raise messages.recompute_reentered(self.cell_path())
        # a stamped tensor written in place since the forward (same storage, another version) is refused, as MindSpore
        # refuses a saved tensor modified in place
        for ref, (ptr, version), what in self.stamps:
            t = ref() if isinstance(ref, weakref.ref) else ref
            if t is not None and (now := tensor_stamp(t))[0] == ptr and now[1] != version:
                raise messages.written_after_forward(what, tuple(t.shape), t.dtype, self.describe_root())
        self.stamps = ()
        self._running = True
        try:
            self._recompute()
        finally:
            self._running = False
        saved = self.reruns[engine] = self.recomputed
        # W6: what the graph reads without AC; a backward that records (a grad of a grad) takes the re-run's tensors,
        # whose graph the held views lack (saved: a dict or a list)
        if not _executor.requires_grad():
            for key, held in self.held_saves.items():
                saved[key] = held
        self.stats.recompute_calls += 1
        return saved

    def _recompute(self):
        raise NotImplementedError
