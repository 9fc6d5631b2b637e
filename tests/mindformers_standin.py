"""A stand-in for the parts of MindFormers 2.1.0 that its PyNative models use around recompute.

MindFormers needs MindSpore 2.11, so it can't be installed next to 2.10. Its
marker API (``mindformers/pynative/distributed/activation_checkpoint.py``:
``recompute_context_fn``, ``is_in_recompute``, ``save_for_recompute``,
``get_recompute_metadata``, with the ContextVar semantics copied here) and
its MoE logging tracker (``moe_utils.save_to_aux_losses_tracker``, guarded
by that marker) are rebuilt below and installed under MindFormers' module
names for a test's duration (``installed()``), so that ``apply_ac``'s bridge
finds them exactly where it would find MindFormers' own. Its collective registry
(``mindformers/pynative/distributed/style.py``: ``register_comm_op`` filling
``module._comm_ops`` with ``{'fn', 'domain'}`` dicts under dotted slot names,
``_call_comm_op``, and ``RowwiseParallel``'s forward hook that reduces a
linear's partial output through it) is copied in its shape below.
"""
import contextlib
import contextvars
import sys
import types
from collections import defaultdict, deque

from mindspore import mint, ops
from mindspore.common._grad_function import _Function

MARKER_MODULE = "mindformers.pynative.distributed.activation_checkpoint"
MOE_UTILS_MODULE = "mindformers.pynative.transformers.moe.moe_utils"


# -- mindformers/pynative/distributed/activation_checkpoint.py (the marker API, as in 2.1.0) -------------

class _RecomputeInvocationState:
    def __init__(self):
        self.metadata = defaultdict(deque)


_RECOMPUTE_CONTEXT = contextvars.ContextVar("mindformers_recompute_context", default=None)


@contextlib.contextmanager
def _recompute_phase(state, is_recompute):
    token = _RECOMPUTE_CONTEXT.set((state, is_recompute))
    try:
        yield
    finally:
        _RECOMPUTE_CONTEXT.reset(token)


@contextlib.contextmanager
def recompute_marker(state=None):
    with _recompute_phase(state if state is not None else _RecomputeInvocationState(), is_recompute=True):
        yield


def recompute_context_fn():
    state = _RecomputeInvocationState()
    return _recompute_phase(state, is_recompute=False), recompute_marker(state)


def is_in_recompute():
    context = _RECOMPUTE_CONTEXT.get()
    return context is not None and context[1]


def save_for_recompute(key, value):
    context = _RECOMPUTE_CONTEXT.get()
    if context is None or context[1]:
        return False
    context[0].metadata[key].append(value)
    return True


def get_recompute_metadata(key):
    context = _RECOMPUTE_CONTEXT.get()
    if context is None or not context[1]:
        return None
    values = context[0].metadata.get(key)
    if not values:
        raise RuntimeError(f"No forward metadata was saved for recompute key {key!r}.")
    return values.popleft()


# -- mindformers/pynative/distributed/style.py (the collective registry, as in 2.1.0) -----------------------

def register_comm_op(module, name, fn, domain):
    """Register a communication operator on *module* for exclude_op discovery (MindFormers' own body)."""
    if not hasattr(module, '_comm_ops'):
        module._comm_ops = {}
    module._comm_ops[name] = {'fn': fn, 'domain': domain}


def _call_comm_op(cell, name, *args, **kwargs):
    """Call a registered comm op by name through *cell*'s registry."""
    return cell._comm_ops[name]['fn'](*args, **kwargs)


class _AllReduceFunction(_Function):
    """AllReduce partial values in forward and preserve replicated gradients (``all_reduce``: MindFormers'
    ``ops_comm.all_reduce``, a stand-in on one process)."""

    @staticmethod
    def forward(ctx, tensor, all_reduce):
        output, _ = all_reduce(tensor)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _AllGatherSliceFunction(_Function):
    """AllGather (dim 0) with a local-slice backward for replicated outputs (``all_gather``: MindFormers'
    collective, a stand-in on one process)."""

    @staticmethod
    def forward(ctx, tensor, all_gather, rank):
        ctx.rank, ctx.size = rank, tensor.shape[0]
        return all_gather(tensor)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output[ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size], None, None


def single_process_all_reduce(tensor):
    """The all-reduce of a group of one: a copy of ``tensor`` (and no handle), as ``ops_comm.all_reduce``
    returns it."""
    return ops.deepcopy(tensor), None


def two_rank_all_gather(tensor):
    """The sequence all-gather (dim 0) of a group of two ranks holding the same shard, on one process."""
    return ops.concat((tensor, tensor), 0)


def rowwise_parallel(module, all_reduce=single_process_all_reduce):
    """``RowwiseParallel._apply`` in its ``all_reduce`` mode: the slot ``output.allreduce`` registered on the
    linear ``module``, and a forward hook that reduces its output through ``_call_comm_op``."""
    def _ar_fn(tensor):
        return _AllReduceFunction.apply(tensor, all_reduce)
    register_comm_op(module, "output.allreduce", _ar_fn, "tp")

    def _post_hook(cell, unused_args, output):
        del unused_args
        return _call_comm_op(cell, "output.allreduce", output)
    module.register_forward_hook(_post_hook)
    return module


def colwise_parallel(module, all_gather=two_rank_all_gather, rank=0):
    """``ColwiseParallel._apply`` with ``gather_input``: the slot ``input.allgather`` and a forward pre-hook
    that gathers the sequence-sharded input through ``_call_comm_op`` (``rank``: this rank's place in the
    gathered sequence, whose slice of the gradient its backward takes)."""
    def _ag_fn(tensor):
        return _AllGatherSliceFunction.apply(tensor, all_gather, rank)
    register_comm_op(module, "input.allgather", _ag_fn, "tp")

    def _pre_hook(cell, args):
        gathered = _call_comm_op(cell, "input.allgather", args[0])
        return (gathered,) + tuple(args[1:])
    module.register_forward_pre_hook(_pre_hook)
    return module


# -- mindformers/pynative/transformers/moe/moe_utils.py (the layer-wise aux-loss tracker) ------------------

class Tracker:
    """MindFormers' module-level ``_MOE_LAYER_WISE_LOGGING_TRACKER``, with the marker it asks."""

    def __init__(self, marker):
        self.values = {}
        self.marker = marker

    def save(self, loss, layer_number, num_layers):
        """``save_to_aux_losses_tracker``: skipped during a recompute, as MindFormers does."""
        if layer_number is None or self.marker():
            return
        if not self.values:
            self.values["values"] = mint.zeros(num_layers)
        cur = self.values["values"][layer_number] + ops.stop_gradient(loss)   # MindFormers: loss.detach()
        self.values["values"][layer_number] = cur

    def snapshot(self):
        return self.values["values"].asnumpy().copy() if self.values else None

    def clear(self):
        self.values.clear()


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@contextlib.contextmanager
def installed():
    """MindFormers' marker module (and its parent packages) in ``sys.modules`` for the ``with`` block."""
    names = ["mindformers", "mindformers.pynative", "mindformers.pynative.distributed", MARKER_MODULE]
    saved = {n: sys.modules.get(n) for n in names}
    marker = _module(MARKER_MODULE, recompute_context_fn=recompute_context_fn, is_in_recompute=is_in_recompute,
                     save_for_recompute=save_for_recompute, get_recompute_metadata=get_recompute_metadata,
                     recompute_marker=recompute_marker)
    modules = [_module(n) for n in names[:-1]] + [marker]
    for parent, child in zip(modules, modules[1:]):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    for m in modules:
        if m is not marker:
            m.__path__ = []   # a package, so that the marker module's parents import as MindFormers' do
        sys.modules[m.__name__] = m
    try:
        yield marker
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
