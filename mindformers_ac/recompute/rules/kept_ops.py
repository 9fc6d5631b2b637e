"""Kept ops (rules K1, K2 of docs/exactness.md): what a policy keeps (``MUST_SAVE``, ``exclude_op``,
``PREFER_SAVE``)."""
from mindspore import Tensor

from ...checkpoint_policy import CheckpointPolicy
from ...tensors import output_tensors, storage_info
from .. import messages
from ..dispatch import SAVE, SWAP, is_comm_op, tensor_args
from ..keep_sites import decides_by_site
from ..state import ENGINE, FORWARD
from ..tracking import OpContext
from .base import Rule


class KeptOps(Rule):
    """The policy's decisions and the outputs kept for the re-run. ``packed``: (storage, producing op) -> bytes of
    every tensor saved in forward (K2's budget, and W6: was an output saved); ``None`` after it."""

    __slots__ = ("policy_fn", "site_policy", "policy_saves", "cache", "kept_ptrs", "kept_args", "arg_saves", "packed")

    def __init__(self, region, policy_fn):
        super().__init__(region)
        self.policy_fn = policy_fn
        # a policy deciding by the op's name and place only (exclude_policy) may be installed at keep sites
        self.site_policy = policy_fn is not None and decides_by_site(policy_fn)
        if policy_fn is not None and not self.site_policy:
            self.keeps_intercepted("policy", "a policy_fn that decides per op call (not by the op's name and place)")
        self.policy_saves = {}  # op index the policy keeps -> its policy (MUST_SAVE / PREFER_SAVE)
        self.cache = {}         # op index -> kept output (tensors, or swap holders: must_swap)
        self.kept_ptrs = {}     # storage pointer of a kept output -> (op index, output position): W2
        self.kept_args = {}     # policy-kept op index -> {data_ptr of a tensor argument: its position}: K1
        self.arg_saves = {}     # key of a kept op's save that is one of its arguments -> that position: K1
        self.packed = {}

    def ask(self, run, idx, name, func, args, kwargs):
        ctx = OpContext(name, run.cell_path(), run.mode != FORWARD, idx, run.cell(),
                        run.attrs[-1][1] if run.attrs else None)
        with run.engine_ops():   # a policy that runs ops must not shift the numbering
            policy = self.policy_fn(ctx, func, *args, **kwargs)
        if not isinstance(policy, CheckpointPolicy):
            raise messages.bad_policy(policy, ctx.op_path)
        return policy

    def note_args(self, idx, args):
        """Before policy-kept op ``idx`` runs: where its tensor arguments live, so that what it saves of them is
        left to the re-run of the ops before it (K1), not kept beside its output."""
        ptrs = self.region.writes.param_ptrs
        self.kept_args[idx] = {t.data_ptr(): i for i, t in enumerate(tensor_args(args)) if t.data_ptr() not in ptrs}

    def saves_argument(self, key, ptr):
        position = self.kept_args.get(key[0], {}).get(ptr)
        if position is None or ptr in self.region.writes.input_ptrs:
            return False
        self.arg_saves[key] = position
        return True

    def keep_output(self, idx, out):
        region = self.region
        for j, t in enumerate(output_tensors(out)):
            if isinstance(t, Tensor):
                region.bytes.keep(t)
                self.kept_ptrs.setdefault(t.data_ptr(), (idx, j))   # a later write copies it first (W2)
        self.cache[idx] = out

    def output(self, idx):
        out = self.cache[idx]
        return self.region.swap.load(out) if self.region.decisions[idx] == SWAP else out

    def serve_arguments(self, idx, args):
        tensors, region = tensor_args(args), self.region
        for key, i in self.arg_saves.items():
            if key[0] == idx and key in region.token_meta:
                region.recomputed[key] = tensors[i]

    def release_unread(self):
        """K2, at the end of the forward: unread PREFER_SAVE ops are re-run instead, largest first, while the region
        keeps more than its forward saved; a collective or a writer (W3) stays kept. MUST_SAVE is kept whatever it
        costs: the excess is reported (``RecomputeStats.kept_over_bytes``, a warning)."""
        region = self.region
        kept, budget = sum(region.bytes.kept.values()), sum(self.packed.values())
        unread = []
        for idx, policy in self.policy_saves.items():
            out = self.cache.get(idx)
            if out is None or policy is not CheckpointPolicy.PREFER_SAVE or idx in region.writes.writes_arg \
                    or is_comm_op(region.op_names[idx]) or region.decisions.get(idx) != SAVE:
                continue
            tensors = [t for t in output_tensors(out) if isinstance(t, Tensor)]
            if not any((storage_info(t)[0], idx) in self.packed for t in tensors):
                unread.append((sum(storage_info(t)[1] for t in tensors), idx, tensors))
        for nbytes, idx, tensors in sorted(unread, key=lambda u: (-u[0], u[1])):
            if kept <= budget:
                break
            del self.cache[idx], region.decisions[idx], self.policy_saves[idx]
            self.kept_args.pop(idx, None)
            region.light_reproduces(("op", idx))
            for t in tensors:
                region.bytes.unkeep(t)
                self.kept_ptrs.pop(t.data_ptr(), None)
            kept -= nbytes
            region.stats.unread_kept += 1
        if kept > budget and self.policy_saves:
            region.stats.note_kept_over(kept - budget)
            ENGINE.warnings.warning(("kept_over", id(region.stats)), messages.KEPT_OVER, region.cell_path(),
                                    kept - budget)
        self.packed = None
