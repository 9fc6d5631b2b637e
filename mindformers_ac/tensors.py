"""Facts about tensors and cells that every engine asks: storage, outputs, weights, the cell of a call.

MindSpore hands saved-tensor hooks plain tensors: a weight arrives as a
non-Parameter tensor sharing the parameter's ``data_ptr``, and views of one
activation share a storage. Engines therefore key what they keep by storage
base pointer and recognise weights by pointer; these helpers are the one
place that knows how.
"""
from mindspore import Tensor, nn

MiB = 2 ** 20


def storage_info(t):
    """(base pointer, bytes) of the storage behind ``t``: views of one storage share the key."""
    try:
        storage = t.untyped_storage()
        return int(storage.data_ptr()), int(storage.nbytes())
    except (AttributeError, RuntimeError, TypeError):   # some tensor kinds have no untyped_storage on CPU
        return int(t.data_ptr()), int(t.nbytes)


def storage_ptr(t):
    """Base pointer of the storage behind ``t``."""
    return storage_info(t)[0]


def storage_nbytes(t):
    """Bytes of the storage behind ``t``."""
    return storage_info(t)[1]


def output_tensors(out):
    """The items of an op's or cell's output as a tuple (a single output becomes a 1-tuple)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def tensor_storage_ptrs(*values):
    """Storage pointers of the tensors in ``values`` (one level of tuple/list/dict is searched)."""
    ptrs = set()
    for v in values:
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else (v,)
        for item in items:
            if isinstance(item, Tensor):
                ptrs.add(storage_ptr(item))
            elif isinstance(item, (tuple, list)):
                ptrs.update(storage_ptr(x) for x in item if isinstance(x, Tensor))
    return ptrs


def param_ptrs(params):
    """``data_ptr`` and storage pointer of each parameter: how a weight is recognised in a pack hook."""
    ptrs = set()
    for p in params:
        try:
            ptrs.add(p.data_ptr())
            ptrs.add(storage_ptr(p))
        except (RuntimeError, TypeError):   # not initialised yet: it has no storage, so it can't be packed
            continue
    return ptrs


def root_cell_of(fn):
    """The Cell a call runs: ``fn`` itself, or the owner of a bound method; else None."""
    if isinstance(fn, nn.Cell):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Cell) else None


def is_tracked(t):
    """Whether autograd records ops on ``t`` in the graph being built (any dtype).

    A grad-function input is tracked whatever its dtype (int position ids and
    bool masks from the batch too); a constant float tensor is not. Ops save
    for backward only what their tracked inputs' gradients need, so this
    decides which tensors an op packs. Reads MindSpore's private
    ``Tensor._requires_grad``, falling back to ``_grad_node`` if it is gone.
    """
    flag = getattr(t, "_requires_grad", None)
    if isinstance(flag, bool):
        return flag
    return getattr(t, "_grad_node", None) is not None
