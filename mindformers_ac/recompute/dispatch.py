"""Op dispatch inside a region run: number every op, apply the region's decision before it runs.

In forward every op is numbered and shown to the region *before* it runs (legacy ops such as LayerNorm pack inside
the call); in the re-run it is aligned with its forward op (``rules.alignment``), a kept one hands back its output
and one that writes runs on copies (``rules.writes``). The dispatch only numbers ops and asks the region's rules.
"""
from mindspore import Tensor
from mindspore.utils import MsDispatchMode

from ..precision import in_engine_ops, no_casts
from .side_effects import may_write
from .state import ENGINE, FORWARD, RECOMPUTE

# Decisions recorded per op index in forward (absent = recompute).
SAVE, SWAP, REBUILD = "save", "swap", "rebuild"


# A primitive that stands in for another op names it here, e.g. an AllGather that implements an
# all-to-all where the backend has no all-to-all kernel: ``exclude_op`` and the counters see that name.
OP_NAME_ATTR = "mac_op_name"


def op_name_of(op, args=()):
    """Name of a dispatched op (``op.name`` is a str, or a method on some op kinds), or the str ``mac_op_name`` of
    the primitive a legacy op is dispatched with (``args[0]``)."""
    alias = getattr(args[0], OP_NAME_ATTR, None) if args else None
    if isinstance(alias, str):
        return alias
    name = getattr(op, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else type(op).__name__


# Names of ops that communicate: a kept one stays kept even when no backward reads its output (rule K2),
# since re-running it would communicate in backward, which is what exclude_op on a collective avoids.
_COMM_NAMES = ("allreduce", "allgather", "alltoall", "reducescatter", "broadcast", "distcomm", "send", "recv")


def is_comm_op(name):
    """True for an op name of a collective or point-to-point communication (``AllGather``, ``DistCommAllReduce``)."""
    lowered = name.lower()
    return any(n in lowered for n in _COMM_NAMES)


def tensor_args(args):
    """The tensor arguments of a dispatched op (a legacy op's inputs are a tuple)."""
    return [t for a in args for t in (a if isinstance(a, tuple) else (a,)) if isinstance(t, Tensor)]


def arg_meta(args):
    """``(shape, dtype)`` of each tensor argument of a dispatched op."""
    return tuple((tuple(t.shape), t.dtype) for t in tensor_args(args))


class StopRerun(BaseException):
    """Ends a re-run early (``early_stop``): every tensor the backward needs from it is rebuilt. A BaseException, so
    a model's ``except Exception`` does not swallow it."""


class RegionDispatch(MsDispatchMode):
    """Numbers ops of one run and applies the region's keep/recompute decisions."""

    def __init__(self, run):
        super().__init__()
        self.run = run

    def __ms_dispatch__(self, func, args, kwargs=None):
        run = self.run
        kwargs = kwargs or {}
        # Ops of a nested region, or run by our own hooks or another engine, belong to nobody here; skipping
        # them in forward and recompute alike keeps the numbering aligned.
        if run.in_hook or ENGINE.top() is not run or in_engine_ops():
            return func(*args, **kwargs)
        run.op_idx += 1
        idx = run.op_idx
        region = run.region
        name = op_name_of(func, args)
        if region.align.debug_log is not None:
            region.align.debug_log.note(run.mode != FORWARD, idx, name, run.cell_path())
        if run.mode != FORWARD:
            return self._recompute_op(run, region, idx, name, func, args, kwargs)
        region.op_names.append(name)
        region.stats.ops_forward += 1
        net = region.net
        if net.cut_pending is not None:   # a pyboost op packs after it returns: the kept op before is done
            net.sample_at_kept(run, net.cut_pending)
        decision = region.decide(run, idx, name, func, args, kwargs)
        if may_write(name, args):   # before the call: the op writes during it
            decision = region.writes.guard(run, idx, name, args, decision)
        if decision is not None:
            net.sample_at_kept(run, (idx, "before"))   # the safety net: what a kept op cuts off the output
            region.record_decision(idx, decision, args)
        out = self._call(run, idx, func, args, kwargs)
        if decision is not None:   # what it saved of its arguments (K1): sampled once its packs are made
            net.cut_pending = (idx, "after")
        region.bytes.note_outputs(idx, out)
        if decision == REBUILD:
            region.random.finish_dropout(run, idx, args, out)
        elif decision == SWAP:
            region.swap.keep_output(run, idx, out)
        elif decision == SAVE:
            region.kept.keep_output(idx, out)
            region.writes.note_kept_writer(idx, name, args)
        return out

    @staticmethod
    def _call(run, idx, func, args, kwargs):
        run.inside.append(idx)
        try:
            return func(*args, **kwargs)
        finally:
            run.inside.pop()
            run.last = idx

    def _recompute_op(self, run, region, idx, name, func, args, kwargs):
        align = region.align
        idx = run.op_idx = align.align(run, idx, name, args)
        if align.stop_after is not None and idx > align.stop_after:
            raise StopRerun()   # no later op left a tensor for backward (early_stop)
        if region.kept.policy_fn is not None:
            region.kept.ask(run, idx, name, func, args, kwargs)   # lets the policy observe the re-run
        decision = region.decisions.get(idx)
        if decision is None:
            region.stats.count_rerun(name)
            writes = region.writes
            if writes.may_write_seen and may_write(name, args):
                writes.note_rerun_write(idx, name, args)
            if writes.written:
                served = writes.rerun_args(run, idx, name, args)
                if served is not args:
                    # The op's inputs were cast already (mixed precision casts before dispatch); the copies
                    # that stand in for the Parameters it writes must stay uncast, as those Parameters were.
                    with no_casts():
                        return self._call(run, idx, func, served, kwargs)
            return self._call(run, idx, func, args, kwargs)
        # A kept, swapped or rebuilt op: its forward output, checked at the safety net's cuts.
        region.stats.ops_reused += 1
        net = region.net
        checked = net.cut_samples and run.mode == RECOMPUTE   # a replay (N1) rebuilds nothing to compare
        if checked:
            net.check_at_kept(run, (idx, "before"))
        run.last = idx
        out = region.random.rebuild(run, idx, args) if decision == REBUILD else region.kept.output(idx)
        if idx in region.kept.kept_args:
            region.kept.serve_arguments(idx, args)
        if checked:
            net.check_at_kept(run, (idx, "after"))
        if idx in region.writes.writes_arg:
            out = region.writes.replay_write(run, args, out)
        if region.recorder is not None and idx in region.random.ops:
            region.recorder.check_replay(run, idx, func, args, kwargs, out)
        return out
