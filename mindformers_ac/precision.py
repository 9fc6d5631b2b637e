"""PyNative mixed precision as the engines meet it: the type a cell runs under, and running ops under another.

``Cell.to_float`` and amp O2/O3 set a type on cells (``mixed_precision_type``)
that ``Cell.__call__`` pushes on the executor around ``construct``; every op
run meanwhile gets its float inputs cast (the Casts are dispatched as ops).
Code that runs ops outside the cell's call (a recompute from backward) must
push the same type itself; code that runs ops *for itself* inside a cell's
call (copies of saved inputs, of written parameters, swap copies) must run
them with no type set, or they are cast too (an in-place ``copy_`` under fp16
even writes into a cast copy and leaves its target unchanged). Such ops are
also no op of a recompute region that runs around them (``engine_ops``).
"""
import contextlib
import contextvars

from .mindspore_compat import MixedPrecisionType
from .mindspore_compat import pynative_executor as _executor


def cell_precision(cell):
    """The mixed-precision type ``cell.__call__`` pushes around its construct, or None.

    ``to_float`` and amp O2/O3 set it on every cell of the tree
    (recursively), so a layer or module has it whenever the model runs in
    mixed precision. A type set on an ancestor alone (``add_flags(fp16=True)``
    on the model) is not the cell's: code relying on this sees None.
    """
    return getattr(cell, "mixed_precision_type", None) if cell is not None else None


@contextlib.contextmanager
def under_precision(precision):
    """Ops run inside under mixed-precision type ``precision`` (pushed on the executor's stack and popped on
    every exit path); None leaves the executor's type as it is."""
    if precision is None:
        yield
        return
    _executor.set_mixed_precision_type(precision)
    try:
        yield
    finally:
        _executor.set_mixed_precision_type(MixedPrecisionType.NOTSET, False)   # pops the push above


def no_casts():
    """Ops run inside get no inserted Casts, whatever type the cell around has pushed."""
    return under_precision(MixedPrecisionType.NOTSET)


# Set while an engine runs ops for itself inside the model's code; read per op by the recompute dispatch.
_ENGINE_OPS = contextvars.ContextVar("mindformers_ac.engine_ops", default=False)
in_engine_ops = _ENGINE_OPS.get


@contextlib.contextmanager
def engine_ops():
    """Ops run inside are an engine's own (swap's alias of a saved tensor): no recompute region numbers them, in
    its forward or its re-run, so an engine that runs them at another point of the two (a swap group nested in
    a region saves other tensors in the re-run, whose inputs are new) leaves the region's numbering aligned."""
    token = _ENGINE_OPS.set(True)
    try:
        yield
    finally:
        _ENGINE_OPS.reset(token)
