"""The light way into a region: saved-tensor hooks only, no per-op interception (docs/exactness.md, "The light
path"). Saved tensors are numbered in forward and refilled by position; an ``nn.Dropout`` kernel call and a call at
a keep site arrive through their ``op_slot.OpSlot`` and are numbered apart."""
import mindspore as ms
from mindspore import Tensor

from ..mindspore_compat import no_grad, recording_backward
from ..tensors import output_tensors, tensors_equal
from . import messages
from .dispatch import arg_meta, tensor_args
from .rerun import RegionBase, RegionRun, keep_saved, recompute_graph, rerun_inputs
from .rules.safety_net import Sample, first_probed, probed
from .side_effects import BufferGuard
from .state import ENGINE, FORWARD, RECOMPUTE


class _ApartPack:
    """What a light forward leaves for a tensor saved inside a call it numbers apart, an ``nn.Dropout`` kernel call
    or a kept call: ``tensor`` kept, or item ``index`` of ``source``, the list the re-run fills (the Dropout's
    rebuilt ``(output, mask)``, or the kept call's tensor arguments: rule K1)."""

    __slots__ = ("region", "tensor", "source", "index")

    def __init__(self, region, tensor):
        self.region, self.tensor, self.source, self.index = region, tensor, None, 0


class _Collector:
    """The light recompute's pack hook; held by the recompute graph, so it holds no region."""

    __slots__ = ("saved", "skip")

    def __init__(self):
        self.saved, self.skip = [], False

    def pack(self, t):
        if not self.skip and self.saved is not None:
            self.saved.append(t)


def _unpack(obj):
    """Unpack hook of light forwards: ``(region, position)`` or an ``_ApartPack``."""
    if obj.__class__ is tuple:
        return obj[0].take(obj[1])
    if obj.tensor is not None:   # an _ApartPack whose tensor was kept
        return obj.tensor
    obj.region.ensure_recomputed()
    return obj.source[obj.index]


class LightRegion(RegionBase):
    """One call on the light path. ``check``: the ``path_choice.PathCheck`` that let this signature go light (op
    names for messages, counters); ``checks``/``key``: where to forget it when this forward saved something else."""

    def __init__(self, fn, check, checks, key, stats, context_fn, precision, chain=None, rebind=None):
        super().__init__(fn, stats, context_fn, check.param_ptrs, check.params, chain, rebind)
        self.check, self.path, self.precision = check, check.region_path, precision   # path: for messages
        self._checks, self._key = checks, key
        self.sig = []             # (shape, dtype) of each tensor saved in forward, in order
        self.dropouts = []        # random_ops.DropoutRecord per nn.Dropout kernel call, in order
        self.recomputed = None    # tensors the recompute saved, by position; None once taken
        self._pending = None      # _ApartPacks made inside a Dropout kernel call or a kept call in progress
        self.kept = []            # (OpSlot, its tensor arguments' (shape, dtype), outputs, re-run's arguments) per call
        self.input_ptrs = set()   # storage pointers of the saved inputs (kept anyway)
        self._collector = None
        self.probe = None         # safety_net.Sample of the forward's output (the safety net)
        self.kept_inputs = []     # safety_net.Sample of each kept call's input, in order (the safety net)

    def _pack(self, t):
        # What is left in the graph holds the region until backward used it (not the hook functions:
        # MindSpore keeps those as long as the graph, which outlives the backward).
        pending = self._pending
        if pending is not None:
            p = _ApartPack(self, t)
            pending.append(p)
            return p
        sig = self.sig
        sig.append((t.shape, t.dtype))
        return self, len(sig) - 1

    def take(self, i):
        """The tensor the recompute saved at position ``i`` (single use: ``RecomputeError`` the second time)."""
        recomputed = self.ensure_recomputed()
        t, recomputed[i] = recomputed[i], None
        if t is None:
            raise messages.already_used(f"saved tensor #{i}", self.path)
        return t

    def run_forward(self, args, kwargs):
        run, check, stats = RegionRun(self, FORWARD), self.check, self.stats
        run.keeps = check.keep_proxies or None
        stats.light_calls += 1
        ENGINE.push(run)
        try:
            self.start_forward()
            self.input_ptrs = set(self.save_inputs(args, kwargs, chained=self.link_chain(args, kwargs)))
            with self.run_context(FORWARD), ms.saved_tensors_hooks(self._pack, _unpack), \
                    self.replaced.watch((args, kwargs)):
                out = self.fn(*args, **kwargs)
            self.probe = Sample(first_probed(out), check.probe_index)
            self.stamp(args, kwargs, out, check.saved_outputs)   # its own ops: not an enclosing region's (N1)
        finally:
            ENGINE.pop(run)
        self.keep_replaced()
        self.finish_chain(out)
        if check.n_kept is None:
            check.n_kept = len(self.kept)
        if self.sig != check.fwd or len(self.dropouts) != check.n_dropouts or len(self.kept) != check.n_kept:
            # Its code path changed since the checking call: this call's recompute is still checked
            # against its own forward, but the next call checks again.
            self._checks.forget(self._key)
        stats.ops_forward += len(check.op_names)
        self.bytes.rebuilt(check.dropped)   # the light path sees no dropped tensor: its checking call's figure
        stats.open_region(self, self.bytes.close())
        return out

    def dropout_call(self, run, prim, x):
        """An ``nn.Dropout`` kernel call: keep its mask as bits in forward, rebuild its output in recompute."""
        if run.mode == FORWARD:
            pending = self._pending = []
            try:
                out = prim(x)
            finally:
                self._pending = None
            drop, where = self.keep_dropout(len(self.dropouts), x, out, float(prim.keep_prob),
                                            [p.tensor for p in pending])
            for p, j in zip(pending, where):   # all None when it can't be rebuilt bitwise: kept (drop.kept)
                if j is not None:
                    p.source, p.index, p.tensor = drop.rebuilt, j, None
            self.dropouts.append(drop)
            return out
        if run.mode != RECOMPUTE:
            return prim(x)
        i = run.dropout_idx
        run.dropout_idx += 1
        if i >= len(self.dropouts):
            raise messages.dropout_calls(run.dropout_idx, len(self.dropouts), self.path)
        drop = self.dropouts[i]
        if drop.kept is not None:
            return drop.kept
        got = (tuple(x.shape), x.dtype)
        if got != drop.meta:
            raise messages.other_tensor(f"nn.Dropout #{i}, its input", drop.meta, got, self.path)
        self._collector.skip = True   # the rebuild's own ops save nothing for this region
        try:
            drop.rebuilt[:] = out = drop.rebuild(x)
        finally:
            self._collector.skip = False
        return out

    def keep_call(self, run, proxy, args, kwargs):
        """A call at a keep site (an ``OpSlot`` with the keep role): forward runs it and keeps its outputs and
        whatever it saved; the recompute hands those outputs back without running it."""
        if run.mode == FORWARD:
            # the safety net: the kept output hides from the region's output what the re-run computed before
            # it, so the call's input is sampled and compared by the re-run (docs/exactness.md)
            self.kept_inputs.append(Sample(self._kept_input(args), self.check.probe_index))
            pending, self._pending = self._pending, []
            try:
                out = proxy.call_op(args, kwargs)
            finally:
                packs, self._pending = self._pending, pending
            outs = [t for t in output_tensors(out) if isinstance(t, Tensor)]
            plan, rerun_args = self._arg_plan(len(self.kept), args, outs, [p.tensor for p in packs]), []
            for p, i in zip(packs, plan):
                if i is not None:
                    p.source, p.index, p.tensor = rerun_args, i, None   # K1: the re-run's argument
            for t in outs + [p.tensor for p in packs if p.tensor is not None]:
                self.bytes.keep(t)
            self.kept.append((proxy, arg_meta(args), out, rerun_args))
            return out
        if run.mode != RECOMPUTE:
            return proxy.call_op(args, kwargs)
        i = run.keep_idx
        run.keep_idx += 1
        if i >= len(self.kept):
            raise messages.kept_calls(run.keep_idx, len(self.kept), proxy.mac_keep, self.path)
        held, meta, out, rerun_args = self.kept[i]
        got = arg_meta(args)
        if held is not proxy or got != meta:
            raise messages.other_kept_call(i, held.mac_keep, meta, proxy.mac_keep, got, self.path)
        if not self.kept_inputs[i].matches(self._kept_input(args)):
            self._checks.forget(self._key)
            raise messages.other_values(self.path, f"the input of kept call #{i} ({proxy.mac_keep})")
        rerun_args[:] = tensor_args(args)
        return out

    def _kept_input(self, args):
        """The first tensor argument of a kept call that can be sampled, weights aside."""
        weights = self.check.param_ptrs
        return next((t for t in tensor_args(args) if probed(t) and t.data_ptr() not in weights), None)

    def _arg_plan(self, n, args, outs, packed):
        """K1: per tensor kept call ``n`` saved, the position of the argument it is (the re-run's stands for it), or
        None (kept). A legacy op saves converted copies of its arguments, so the signature's first light forward
        compares values once (``PathCheck.kept_arg_plans``); later ones check shapes."""
        tensors, plan = tensor_args(args), self.check.kept_arg_plans.get(n)
        metas = [(tuple(t.shape), t.dtype) for t in packed]
        if plan is not None and plan[0] == metas:
            return plan[1]
        weights = self.check.param_ptrs   # kept anyway, as are the inputs and outputs: keeping it again costs nothing
        skip = {t.data_ptr() for t in outs} | set(weights) | self.input_ptrs
        found = []
        for t, meta in zip(packed, metas):
            i = None
            if t.data_ptr() not in skip:
                # An argument that is (a view of) a saved input still stands for the copy the op saved of it:
                # the copy is new storage, while the re-run's argument is rebuilt from the kept input.
                same = [j for j, a in enumerate(tensors) if (tuple(a.shape), a.dtype) == meta
                        and a.data_ptr() not in weights]
                i = next((j for j in same if tensors[j].data_ptr() == t.data_ptr()), None)
                if i is None:
                    with no_grad():
                        i = next((j for j in same if tensors_equal(tensors[j], t)), None)
            found.append(i)
        self.check.kept_arg_plans[n] = (metas, found)
        return found

    def _recompute(self):
        if self.fn is None:   # let go after a re-run no later backward was to reach (R1): a second backward
            raise messages.already_used("a saved tensor", self.path)
        run, check, stats = RegionRun(self, RECOMPUTE), self.check, self.stats
        run.keeps = check.keep_proxies or None
        collector = self._collector = _Collector()
        guard = BufferGuard(check.buffers) if check.buffers else None
        args, kwargs = self.load_inputs()
        try:
            with self.replaced.rerun_from(), recompute_graph(run, self.precision, self.random_state):
                args, kwargs = rerun_inputs(args, kwargs)   # in the graph: tracked as in forward
                with self.run_context(RECOMPUTE), ms.saved_tensors_hooks(collector.pack, keep_saved):
                    out = self.fn(*args, **kwargs)
                saved, collector.saved = collector.saved, None   # the recompute graph keeps the collector
                self._collector = None
        finally:
            if guard is not None and guard.restore_if_written():
                self._checks.forget(self._key)
                ENGINE.warnings.warning(("light_write", self._key), messages.LIGHT_REWRITE)
        sig = self.sig
        if run.keep_idx != len(self.kept):
            raise messages.kept_calls(run.keep_idx, len(self.kept), self.kept[run.keep_idx][0].mac_keep, self.path)
        messages.check_saves([(t.shape, t.dtype) for t in saved], sig, check.describe_save
                             if sig == check.fwd else (lambda j: f"saved tensor #{j}"), self.path)
        if run.dropout_idx != len(self.dropouts):
            raise messages.dropout_calls(run.dropout_idx, len(self.dropouts), self.path)
        if not self.probe.matches(first_probed(out)):
            self._checks.forget(self._key)
            raise messages.other_values(self.path, check.output_op)
        self.keep_rerun_output(out)
        self.recomputed = saved
        stats.ops_rerun += check.n_rerun
        stats.rerun_by_op.update(check.rerun_counts)
        stats.ops_reused += run.dropout_idx + check.n_kept_ops
        if recording_backward():
            return   # this backward is recorded for a higher-order one, whose backward re-runs it again (R1)
        # Its model too: the graph (a loss kept past its step holds it) still refers to this region, which
        # needs neither its function, its Parameters nor its signature's check again, so a dropped model is
        # not kept alive through it.
        self.inputs = self.sig = self.kept = self.kept_inputs = None
        self.fn = self.replaced = self.check = self._checks = None
