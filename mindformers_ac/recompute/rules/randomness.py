"""Random ops and Dropout (docs/exactness.md, "Random ops"): a random op is never drawn again in a re-run; a Dropout
is rebuilt from its mask bits, any other random op keeps its output (the facts: ``random_ops``)."""
from mindspore.ops import Primitive

from ..dispatch import REBUILD, SAVE
from ..random_ops import dropout_input, is_unreplayable_random_op
from ..state import FORWARD, RECOMPUTE
from .base import Rule


class RandomOps(Rule):
    """``ops``: op index of a random op kept or rebuilt -> its primitive (None: a pyboost op); ``dropouts``: op
    index -> ``DropoutRecord`` of a Dropout rebuilt from its mask."""

    __slots__ = ("ops", "dropouts")

    def __init__(self, region):
        super().__init__(region)
        self.ops, self.dropouts = {}, {}

    def decide(self, idx, name, args):
        if not is_unreplayable_random_op(name, args):
            return None
        self.ops[idx] = args[0] if args and isinstance(args[0], Primitive) else None
        return REBUILD if name == "Dropout" and dropout_input(args)[0] is not None else SAVE

    def finish_dropout(self, run, idx, args, out):
        """After Dropout op ``idx`` ran: its packed outputs are left for the rebuild from its mask bits; anything else
        it packed, or everything when it can't be rebuilt bitwise (then it is kept), is handed to its token."""
        region = self.region
        pending, run.pending = run.pending, []
        x, keep_prob = dropout_input(args)
        record, where = region.keep_dropout(idx, x, out, keep_prob, [t for _, t in pending])
        for (token, t), j in zip(pending, where):
            if j is None:
                token.tensor = t
                region.token_meta.pop(token.key, None)
            else:
                record.pack_outputs.append((token.key[1], j))
                region.bytes.drop(t)
        if record.kept is not None:
            region.decisions[idx] = SAVE
            region.kept.keep_output(idx, out)
        else:
            self.dropouts[idx] = record

    def dropout_call(self, run, prim, x):
        """An ``nn.Dropout`` cell's kernel call through its slot: one the region rebuilds from its mask, the only op
        of this call, is noted for the path check (the light path's dropout slot takes it later)."""
        if run.mode != FORWARD or run.in_hook:
            return prim(x)
        start = run.op_idx
        run.in_cell_dropout = True
        try:
            out = prim(x)
        finally:
            run.in_cell_dropout = False
        region = self.region
        if run.op_idx == start + 1 and region.decisions.get(run.op_idx) == REBUILD and region.recorder is not None:
            region.recorder.note_cell_dropout(region, run.op_idx)
        return out

    def rebuild(self, run, idx, args):
        record, region = self.dropouts[idx], self.region
        with run.engine_ops():   # the rebuild's own ops save nothing for this region
            out = record.rebuild(dropout_input(args)[0])
        if run.mode == RECOMPUTE:
            for k, j in record.pack_outputs:
                if (idx, k) in region.token_meta:
                    region.recomputed[(idx, k)] = out[j]
        return out
