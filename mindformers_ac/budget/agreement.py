"""Ranks that must run one plan choose it together: the worst rank's figures, on every rank.

Under tensor or expert parallelism a layer's collectives pair up across the ranks, so a plan that re-runs
them in backward on one rank only deadlocks or mixes the ranks' gradients; data-parallel replicas stay exact
apart, but a replica on a slower plan is the straggler of every step. ``memory_budget`` therefore combines
what every rank of a group measured before it chooses (``BudgetController``): each figure becomes its
largest value over the ranks (the slowest step, the most bytes), and every rank runs the same solver on the
same numbers.

CPU mccl (MindSpore 2.10) reduces float32 and float16 by sum only (``AllReduce`` MAX, int and float64
inputs are refused), so ``Agreement.gather`` sums one-hot rows: each rank writes its figures into its own
row of zeros, and the sum is every rank's row. A float64 figure travels as its four 16-bit pieces, each a
float32 integer below 2**16, which a sum with zeros leaves exact: the figures arrive bit for bit.
"""
import numpy as np

from ..mindspore_compat import no_grad

PIECES = 4   # 16-bit pieces of one float64


def initialised_world():
    """The world group's name when MindSpore's communication is initialised in this process, else None."""
    try:
        from mindspore.communication import GlobalComm
    except ImportError:
        return None
    return GlobalComm.WORLD_COMM_GROUP if GlobalComm.INITED else None


class Agreement:
    """The ranks of communication group ``group`` (a name) choosing together; ``size`` ranks, this one
    ``rank`` among them."""

    def __init__(self, group):
        from mindspore.communication import get_group_size, get_rank
        self.group = group
        self.size, self.rank = get_group_size(group), get_rank(group)

    def gather(self, values):
        """Every rank's ``values`` (a float array, the same length on every rank): ``(size, n)``, row ``r``
        rank ``r``'s, bit for bit. Every rank of the group must call it at the same point."""
        values = np.ascontiguousarray(values, dtype=np.float64).ravel()
        if self.size == 1:
            return values[None, :]
        import mindspore as ms
        from mindspore import ops
        rows = np.zeros((self.size, values.size * PIECES), np.float32)
        rows[self.rank] = values.view(np.uint16)
        with no_grad():   # run inside the user's training forward: nothing of it is recorded for a gradient
            summed = ops.AllReduce(group=self.group)(ms.Tensor(rows)).asnumpy()
        return summed.astype(np.uint16).view(np.float64).reshape(self.size, values.size)

    def worst(self, values):
        """The largest of every rank's ``values``, elementwise (``nan`` where any rank has ``nan``)."""
        return self.gather(values).max(axis=0)

    def any(self, flag):
        """Whether ``flag`` is true on any rank of the group."""
        return bool(self.worst(np.array([float(bool(flag))]))[0])

    def describe(self):
        return f"rank {self.rank} of {self.size} in group {self.group}"


def agreed_profile(agreement, profile, *figures):
    """``(profile, figures)`` with every measured figure the worst over ``agreement``'s ranks: each entry of
    the per-layer bytes, step-time costs and rebuilds, the bytes outside the layers, the step without AC, the
    timing noise (said in the words of the rank that measured the widest), and ``figures`` (numbers besides
    the profile), each its largest. Every rank gets the same numbers, so the same solver chooses the same plan."""
    import dataclasses

    from .options import BELOW_BASELINE
    from .solver import MISSED, SPREAD_OF_REPEATS
    noise_words = (SPREAD_OF_REPEATS, BELOW_BASELINE, MISSED)
    arrays = (profile.mem, profile.time, profile.transient)
    words = noise_words.index(profile.time_spread_what) if profile.time_spread_what in noise_words else -1
    scalars = [profile.other_bytes, profile.baseline_step_s, profile.time_spread_s, words]
    rows = agreement.gather(np.concatenate([a.ravel() for a in arrays] + [scalars, figures]))
    worst = rows.max(axis=0)
    n = profile.mem.size
    mem, time, transient = (worst[k * n:(k + 1) * n].reshape(profile.mem.shape) for k in range(3))
    other, baseline_s, spread = worst[3 * n:3 * n + 3]
    words = int(rows[rows[:, 3 * n + 2].argmax(), 3 * n + 3])   # the noisiest rank's
    combined = dataclasses.replace(profile, mem=mem, time=time, transient=transient, other_bytes=int(other),
                                   baseline_step_s=float(baseline_s), time_spread_s=float(spread),
                                   time_spread_what=noise_words[words] if words >= 0 else profile.time_spread_what)
    return combined, [float(v) for v in worst[3 * n + 4:]]
