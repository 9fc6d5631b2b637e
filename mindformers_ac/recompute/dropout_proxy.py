"""``nn.Dropout`` cells under a wrapped cell: their kernel call is handed to the running region.

The light path intercepts no op, so it can't see a Dropout kernel run; yet a
Dropout must never be run again in a recompute (it would draw another mask).
``checkpoint_wrapper`` (without a policy) therefore replaces the ``dropout``
primitive of each ``nn.Dropout`` sub-cell, on the instance, by a
``DropoutProxy`` that calls ``run.dropout_call(prim, x)`` of the innermost
running region run: the light region keeps the mask as bits in forward and
rebuilds the output in the recompute; the intercepting region runs the kernel
through its dispatch as usual and notes that this Dropout belongs to an
``nn.Dropout`` cell (which the path check requires before going light).
Outside a region the proxy calls the primitive.
"""
from mindspore import nn
from mindspore.ops import Primitive

from .op_slot import OpSlotProxy
from .state import ENGINE


class DropoutProxy(OpSlotProxy):
    """Stands in for an ``nn.Dropout`` cell's ``dropout`` primitive; hands each call to the running region.

    Wrappers share one proxy per cell (``users``); the last one out restores
    the primitive. Primitive attributes (``keep_prob``, ``name`` ...) stay
    readable through it; a deep copy of the cell gets the plain primitive.
    """

    def __init__(self, inner):
        self.mac_inner, self.users = inner, 0

    def __call__(self, x):
        run = ENGINE.top()
        if run is None:
            return self.mac_inner(x)
        return run.dropout_call(self.mac_inner, x)


def install_dropout_proxies(root):
    """Put a ``DropoutProxy`` on every ``nn.Dropout`` under ``root``; returns an undo callable.

    A cell whose ``dropout`` is not the plain ``Dropout`` primitive (replaced
    by the user, or by another tool) is left alone: its kernel then goes
    through the dispatch only, and the region stays on the intercepting path.
    """
    cells = []
    for _, cell in root.cells_and_names():
        if not isinstance(cell, nn.Dropout):
            continue
        current = cell.__dict__.get("dropout")
        if isinstance(current, DropoutProxy):
            proxy = current
        elif isinstance(current, Primitive) and current.name == "Dropout":
            proxy = DropoutProxy(current)
            object.__setattr__(cell, "dropout", proxy)
        else:
            continue
        proxy.users += 1
        cells.append((cell, proxy))

    def remove():
        for cell, proxy in cells:
            proxy.users -= 1
            if proxy.users == 0 and cell.__dict__.get("dropout") is proxy:
                object.__setattr__(cell, "dropout", proxy.mac_inner)
        cells.clear()
    return remove
