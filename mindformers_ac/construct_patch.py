"""Wrapping a cell instance's ``construct``: the one mechanism behind every cell wrapper.

``checkpoint_wrapper``, ``swap_wrapper`` and op-output recompute of a Cell op
all replace the *instance* attribute ``construct`` (the class, other
instances, the cell tree and parameter names are untouched) with a function
that runs the wrapper around what was there before. Patches stack: each one
records the construct it wrapped, and removing one relinks the patch above it
(or restores the cell), so the order of removal does not matter.

Two kinds can't share a cell: a region that recomputes a cell and a swap
group around the same cell would each see the other's saves (the innermost
saved-tensor hook wins), so ``checkpoint_wrapper`` and ``swap_wrapper`` on one
cell are refused in either order with the same message.
"""

_PATCH_ATTR = "mac_construct_patch"

_EXCLUSIVE_KINDS = ("checkpoint_wrapper", "swap_wrapper")


def patch_of(fn):
    """The ``ConstructPatch`` a construct function belongs to, or None."""
    return getattr(fn, _PATCH_ATTR, None)


def patches(cell):
    """The patches on ``cell``, outermost first."""
    found = []
    fn = cell.__dict__.get("construct")
    while patch_of(fn) is not None:
        found.append(patch_of(fn))
        fn = found[-1].inner
    return found


def find_patch(cell, kind):
    """The patch of ``kind`` on ``cell``, or None."""
    return next((p for p in patches(cell) if p.kind == kind), None)


class ConstructPatch:
    """``cell.construct(*a, **k)`` becomes ``around(inner, *a, **k)``; ``remove()`` undoes it.

    ``kind`` names the wrapper (one patch per kind and cell; ValueError with
    ``undo`` as the hint otherwise); ``info`` is the wrapper's own record.
    """

    def __init__(self, cell, kind, around, info=None, undo=""):
        name = type(cell).__name__
        for other in patches(cell):
            if other.kind == kind:
                raise ValueError(f"{name} is already wrapped by {kind}; {undo} first to change its options")
            if kind in _EXCLUSIVE_KINDS and other.kind in _EXCLUSIVE_KINDS:
                raise ValueError(f"{name}: checkpoint_wrapper and swap_wrapper can't wrap the same cell "
                                 "(recompute it or swap it, not both); undo the other with unwrap() or "
                                 "remove_swap_wrapper() first")
        self.cell, self.kind, self.info = cell, kind, info
        self.inner = cell.construct   # the class method (bound) or the patch below
        self.had_instance = "construct" in cell.__dict__

        def construct(*args, **kwargs):
            return around(self.inner, *args, **kwargs)

        setattr(construct, _PATCH_ATTR, self)
        self.construct = construct
        cell.construct = construct

    def remove(self):
        """Take this patch out of the chain, wherever it is; a second call does nothing."""
        cell = self.cell
        stack = patches(cell)
        if self not in stack:
            return
        i = stack.index(self)
        if i == 0:
            if self.had_instance:
                cell.construct = self.inner
            else:
                del cell.construct
        else:
            above = stack[i - 1]
            above.inner, above.had_instance = self.inner, self.had_instance
