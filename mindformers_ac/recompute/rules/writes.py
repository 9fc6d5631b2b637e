"""Writes of a region's forward (rules W1-W6 of docs/exactness.md; the write model is ``side_effects``): each lands
once per step, and the re-run reads what its forward read."""
from mindspore import Tensor, ops

from ...mindspore_compat import no_grad
from ...precision import no_casts
from ...tensors import param_ptrs, storage_info
from .. import messages, side_effects
from ..dispatch import SAVE
from ..state import ENGINE
from .base import Rule


class Writes(Rule):
    """The root's Parameters and what the forward wrote. ``written``: data_ptr -> (op index, StateSnapshot or None,
    slot) of its first write; ``writes_arg``: kept ops that wrote their first argument (W3)."""

    __slots__ = ("params", "param_names", "buffers", "param_ptrs", "input_ptrs", "snapshots", "written",
                 "writes_arg", "may_write_seen", "dropped", "saved_outputs")

    def __init__(self, region, root):
        super().__init__(region)
        named = list(root.parameters_and_names()) if root is not None else []
        self.params = tuple(p for _, p in named)
        self.param_names = frozenset(name for name, _ in named)   # to tell a replaced Parameter from a new one
        self.buffers = tuple(p for p in self.params if not p.requires_grad)   # non-trainable Parameters
        self.param_ptrs = param_ptrs(self.params)
        self.input_ptrs = set()
        self.snapshots = {}         # op index -> StateSnapshot of a side-effect op's written tensors
        self.written, self.writes_arg = {}, set()
        self.may_write_seen = False   # an op that may write tensors ran in forward
        self.dropped = {}             # (storage, producing op) -> keys of the saves of it the forward dropped
        self.saved_outputs = {}       # position of an output an op of the region saved -> keys of its dropped saves

    def guard(self, run, idx, name, args, decision):
        """Forward, before op ``idx`` that may write: protect what it writes that the re-run must see as it is now
        (W1, W2), then snapshot what it writes (None), or keep its output (SAVE) when the copies would be too large;
        a kept op (``decision``) is not run again."""
        self.may_write_seen = True
        if self.input_ptrs or self.region.kept.kept_ptrs:
            self.protect_targets(run, idx, name, args)
        slots = side_effects.written_slots(name, args, self.param_ptrs)
        if not slots:
            return decision
        snapshot = None
        if decision is None and side_effects.choose_handling(args, slots) != side_effects.KEEP:
            with run.engine_ops(), no_casts():   # the copies are ours: they must not shift the op numbering
                snapshot = side_effects.StateSnapshot(args, slots)
            self.snapshots[idx] = snapshot
            self.region.bytes.keep_bytes(("state", idx), snapshot.nbytes)
        elif decision is None:
            decision = SAVE
            ENGINE.warnings.warning(("keep_side_effect", name), messages.KEEP_SIDE_EFFECT, name)
        buffers = {p.data_ptr() for p in self.buffers}
        for k, ptr in enumerate(side_effects.slot_ptrs(args, slots)):
            self.written.setdefault(ptr, (idx, snapshot, k))
            if ptr not in buffers:
                self.keeps_intercepted(("writes", ptr), f"op #{idx} {name} writes a tensor that is not one of "
                                                        f"the cell's non-trainable Parameters")
        return decision

    def protect_targets(self, run, idx, name, args):
        """W1: a region input the op writes gets a private copy first (the re-run starts from it); W2: so does a
        kept op's output (the re-run gets it back as the kept op returned it, and the writer writes it again)."""
        kept = self.region.kept
        for t in side_effects.written_tensors(name, args):
            ptr = t.data_ptr()
            if ptr in kept.kept_ptrs:
                owner, j = kept.kept_ptrs.pop(ptr)
                out = kept.cache[owner]
                single = isinstance(out, Tensor)
                with run.engine_ops(), no_grad(), no_casts():   # the copy is ours: it must not shift the op numbering
                    copy = ops.deepcopy(out if single else out[j])
                kept.cache[owner] = copy if single else type(out)((*out[:j], copy, *out[j + 1:]))
                self.region.bytes.keep(copy)
                self.keeps_intercepted(("writes_kept", owner), f"op #{idx} {name} writes the kept output of op "
                                                               f"#{owner} {self.region.op_names[owner]} in place")
            elif ptr in self.input_ptrs:
                with run.engine_ops():
                    if self.region.protect_input(ptr):
                        self.keeps_intercepted("writes_input", "an op writes one of its inputs in place")

    def note_kept_writer(self, idx, name, args):
        """W3: a kept op that wrote its argument (``all_reduce(t)``, ``t.copy_``): the re-run writes the kept value
        into its own argument, which the code after it reads (``replay_write``)."""
        if side_effects.writes_first_input(name, args) and \
                side_effects.first_input(args).data_ptr() not in self.param_ptrs:
            self.writes_arg.add(idx)
            self.keeps_intercepted(("kept_writer", idx), f"op #{idx} {name} is kept and writes its argument in place")

    @staticmethod
    def replay_write(run, args, out):
        target = side_effects.first_input(args)
        with run.engine_ops(), no_grad(), no_casts():
            target.copy_(out if isinstance(out, Tensor) else out[0])
        return target if isinstance(out, Tensor) else type(out)((target, *out[1:]))

    def note_rerun_write(self, idx, name, args):
        if side_effects.written_slots(name, args, self.param_ptrs):   # copies here; a light re-run writes for real
            self.keeps_intercepted("rerun_writes", f"re-run op #{idx} {name} writes (a light re-run would write "
                                                   f"for real)")

    def rerun_args(self, run, idx, name, args):
        """Re-run op ``idx``'s arguments: a side-effect op gets fresh copies of what it wrote (the real tensors were
        written once, in forward); a reader of such a tensor gets the run's copy. A read of a tensor whose writer
        kept its output instead, before that write, can't be served: ``RecomputeError``."""
        with run.engine_ops(), no_casts():   # copies are ours, not ops of the region
            snapshot = self.snapshots.get(idx)
            if snapshot is not None:
                return snapshot.args_for_rerun(args, run.written)
            served = {}
            for pos, ptr, t in side_effects.read_slots(args, self.written):
                first, snap, k = self.written[ptr]
                if snap is not None and (t.shape, t.dtype) != (snap.copies[k].shape, snap.copies[k].dtype):
                    continue   # another tensor at an address the written one had (found by program_generator)
                self.keeps_intercepted("rerun_reads_written", f"re-run op #{idx} {name} reads a tensor the "
                                                              f"region writes")
                if ptr not in run.written:
                    if snap is None:
                        if idx < first:
                            raise messages.read_before_kept_write(idx, name, run.cell_path(), first,
                                                                  self.region.describe_op(first),
                                                                  self.region.cell_path())
                        continue   # after the write: the real tensor holds the written value
                    run.written[ptr] = snap.fresh(k)
                served[pos] = run.written[ptr]
            return side_effects.replace_at(args, served) if served else args

    def find_saved_outputs(self, leaves, packed, producer):
        """W6, at the end of the forward: the region's outputs an op of it saved, each with the keys of the saves of
        it the forward dropped (served from the held output, not rebuilt: ``RegionBase.stamp``)."""
        storages = [(ptr, producer.get(ptr)) for ptr in (storage_info(t)[0] for t in leaves)]
        self.saved_outputs = {j: tuple(self.dropped.get(s, ())) for j, s in enumerate(storages) if s in packed}
        self.dropped = None
        return self.saved_outputs

    def param_moved(self, old, new):
        self.param_ptrs.difference_update(old - new)
        self.param_ptrs.update(new)

    def refuse_replaced(self, root):
        """W4's limit: a root Parameter replaced by a new object (``self.g = Parameter(...)``) leaves nothing
        holding the old value for the re-run: ``RecomputeError`` after the forward."""
        before = {id(p) for p in self.params}
        for name, p in root.parameters_and_names():
            if id(p) not in before and name in self.param_names:   # a new name (built on first use) is read as is
                raise messages.parameter_replaced(self.region.cell_path(), name)
