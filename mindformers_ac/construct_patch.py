"""Wrapping a cell instance's ``construct``: the one mechanism behind every cell wrapper.

``checkpoint_wrapper``, ``swap_wrapper`` and op-output recompute of a Cell op
all replace the *instance* attribute ``construct`` (the class, other
instances, the cell tree and parameter names are untouched) with a function
that runs the wrapper around what was there before. Patches stack: each one
records the construct it wrapped, and removing one relinks the patch above it
(or restores the cell), so the order of removal does not matter. Each patch
also puts a forward pre-hook on its cell that refuses a *copy* calling it
(``foreign_patches``: MindSpore hands the hook the cell being called, and a
network rewrite copies the hook dicts with the patch); with it the cell's
call takes ``Cell.__call__``'s hook path (``_run_construct``), which also runs
saved-tensor hooks the cell registered.

``copy.deepcopy`` of a patched cell (or of anything holding one) gives a
plain copy: every patched cell carries an instance ``__deepcopy__``
(``CopyHook``) that copies it the default way and then takes out of the copy
what the library put into the original (patches, hooks, proxies, engine
state), which a default copy would share with the original: closures and
bound methods still run the original's cells. Objects of the library that
sit in a cell's attributes copy as their plain equivalent (a proxy as the op
it wraps) or as ``DROPPED`` (engine state), which the hook removes.
``CopyHook.after`` callbacks then run on the copy: ``apply_ac`` uses one to
give a copied model its own AC.

Two kinds can't share a cell: a region that recomputes a cell and a swap
group around the same cell would each see the other's saves (the innermost
saved-tensor hook wins), so ``checkpoint_wrapper`` and ``swap_wrapper`` on one
cell are refused in either order with the same message, and so are the two
on one function (``refuse_wrapped_function``). One inside the other's cell
tree (a ``swap_wrapper`` on a layer whose attention is checkpoint-wrapped, or
the reverse) composes exactly, but each does the other's work twice (a swap
inside a recompute region offloads in the forward and again in the re-run),
so it is warned, once per pair, as HyperParallel warns: when the outer cell
is wrapped after the inner one, or else at the outer wrapper's first call
(``check_nesting``).
"""

import copy
import logging
import pickle
import weakref

from .mindspore_compat import cell_hook_dicts

logger = logging.getLogger("mindformers_ac")

_PATCH_ATTR = "mac_construct_patch"

_EXCLUSIVE_KINDS = ("checkpoint_wrapper", "swap_wrapper")
# what each exclusive kind sets on the function it returns for a wrapped function
_FN_ATTRS = {"checkpoint_wrapper": "__mac_checkpoint__", "swap_wrapper": "__mac_swap__"}


def refuse_wrapped_function(fn, kind):
    """ValueError when ``fn`` is a function the other exclusive wrapper returned (recompute it or swap it)."""
    for other, attr in _FN_ATTRS.items():
        if other != kind and getattr(fn, attr, None) is not None:
            raise ValueError(f"{getattr(fn, '__name__', type(fn).__name__)} is already wrapped by {other}: "
                             f"{kind} and {other} can't wrap the same function (recompute it or swap it, not "
                             "both); wrap the original function with one of them")


def mark_wrapped_function(wrapped, kind, info):
    """Set ``kind``'s mark (``info``) on the function it returned."""
    setattr(wrapped, _FN_ATTRS[kind], info)


def wrapped_function_info(fn, kind):
    """The mark ``mark_wrapped_function`` set on ``fn`` for ``kind``, or None."""
    return getattr(fn, _FN_ATTRS[kind], None)


def nesting_message(outer, outer_kind, path, inner, inner_kind):
    what = ("a swap inside a recompute region offloads in the forward and again in the re-run"
            if outer_kind == "checkpoint_wrapper" else
            "the recompute region inside a swap group offloads what its forward keeps and rebuilds the rest")
    return (f"{type(outer).__name__} is wrapped by {outer_kind} and its sub-cell {path!r} "
            f"({type(inner).__name__}) by {inner_kind}: both apply and gradients stay exact, but {what}. "
            "Recompute or swap a cell tree, not both (HyperParallel: don't nest wrappers)")


def check_nesting(cell, kind, warned):
    """Warn once per pair when a sub-cell of ``cell`` (wrapped by ``kind``) is wrapped by the other exclusive
    kind; ``warned``: the ids of sub-cells already warned about (updated)."""
    if kind not in _EXCLUSIVE_KINDS:
        return
    for path, sub in cell.cells_and_names():
        if sub is cell or id(sub) in warned:
            continue
        other = next((p.kind for p in patches(sub) if p.kind in _EXCLUSIVE_KINDS and p.kind != kind), None)
        if other is not None:
            warned.add(id(sub))
            logger.warning("mindformers_ac: %s", nesting_message(cell, kind, path, sub, other))


class _Dropped:
    """What a library object that belongs to one cell becomes in a deep copy; the copy hook removes it."""

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return "<dropped by mindformers_ac on copy>"


DROPPED = _Dropped()

_COPY_ATTR = "__deepcopy__"
_PICKLE_ATTR = "__reduce_ex__"
_DROP_MARK = "mac_drop_on_copy"


def drop_on_copy(fn):
    """Mark a hook function (registered on a cell) to be left out of a deep copy of that cell."""
    setattr(fn, _DROP_MARK, True)
    return fn


def _is_dropped(value):
    if value is DROPPED:
        return True
    try:   # any attribute value of a user's cell passes here, some with odd __getattr__s
        return getattr(value, "__self__", None) is DROPPED or getattr(value, _DROP_MARK, False) is True
    except Exception:  # pylint: disable=broad-exception-caught  # not ours, whatever it raised
        return False


def _scrub(original, memo):
    """Take out of the copies of ``original`` and its sub-cells what the library put into the originals."""
    for _, cell in original.cells_and_names():
        dup = memo.get(id(cell))
        if dup is None or dup is cell:
            continue
        attrs = dup.__dict__
        chain = patches(cell)
        if chain and patch_of(attrs.get("construct")) is not None:
            bottom = chain[-1]
            if bottom.had_instance:
                attrs["construct"] = copy.deepcopy(bottom.inner, memo)
            else:
                del attrs["construct"]
        for key in [k for k, v in attrs.items() if isinstance(v, CopyHook) or _is_dropped(v)]:
            del attrs[key]
        hook_dicts, extras = cell_hook_dicts(attrs)   # an entry of ours goes from the main dict and its extras
        for hooks in hook_dicts:
            for hid in [hid for hid, fn in hooks.items() if _is_dropped(fn)]:
                del hooks[hid]
                for extra in extras:
                    extra.pop(hid, None)


class CopyHook:
    """The instance ``__deepcopy__`` of a cell the library changed: a plain copy, then ``after`` callbacks.

    Shared by every patch of the cell (``users``); the last one out removes
    it. ``after``: callables ``(original, copy, memo)`` run once the copy is
    complete and clean (``apply_ac`` installs its plan on the copy there).
    """

    def __init__(self, cell):
        self._cell = weakref.ref(cell)
        self.users = 0
        self.after = []

    def __call__(self, memo):
        cell = self._cell()
        # what deepcopy does, with the class's reduce (the instance's refuses pickling)
        dup = copy._reconstruct(cell, memo, *type(cell).__reduce_ex__(cell, 4))  # pylint: disable=protected-access
        _scrub(cell, memo)
        for fn in list(self.after):
            fn(cell, dup, memo)
        return dup

    def __deepcopy__(self, memo):
        return DROPPED


class PickleRefusal:
    """The instance ``__reduce_ex__`` of a cell the library changed: ``pickle`` refuses it, naming the way out.

    A pickled patch would unpickle as closures over the original process's engines (and MindSpore's weak
    references don't pickle at all); a model without AC pickles as before. ``remove_ac`` (or ``unwrap`` /
    ``remove_swap_wrapper``) takes this out with the patches.
    """

    def __init__(self, cell):
        self.name = type(cell).__name__
        self._cell = weakref.ref(cell)

    def __call__(self, protocol=2):
        # copy.copy asks the same method (a deep copy has CopyHook): the class's reduce, whose state refuses
        # to be pickled itself; copy.copy uses that state as it is, so a shallow copy stays what it was
        cell = self._cell()
        rv = type(cell).__reduce_ex__(cell, protocol)
        state = rv[2] if len(rv) > 2 else None
        refusing = _REFUSING.get(type(state))
        if refusing is None:
            raise pickle.PicklingError(self.message())
        state = refusing(state)
        state.message = self.message()
        return (*rv[:2], state, *rv[3:])

    def message(self):
        return (f"mindformers_ac: can't pickle {self.name}: activation checkpointing or swap installed by "
                f"mindformers_ac (apply_ac, checkpoint_wrapper, swap_wrapper) is part of it; call "
                f"mindformers_ac.remove_ac(model) (or unwrap() / remove_swap_wrapper()) before pickling and "
                f"apply_ac again after loading, or save the weights with mindspore.save_checkpoint")

    def __deepcopy__(self, memo):
        return DROPPED


class _RefusingTuple(tuple):
    """A patched cell's state (``Cell.__getstate__``'s pair) in its reduce: it unpacks as the pair (copy.copy)
    and raises ``message`` when pickled (a tuple subclass is pickled through its own reduce)."""

    def __reduce_ex__(self, protocol):
        raise pickle.PicklingError(self.message)


class _RefusingDict(dict):
    """As ``_RefusingTuple``, for a cell class whose state is its ``__dict__``."""

    def __reduce_ex__(self, protocol):
        raise pickle.PicklingError(self.message)


_REFUSING = {tuple: _RefusingTuple, dict: _RefusingDict}


def hold_copy_hook(cell):
    """The cell's ``CopyHook`` (and ``PickleRefusal``), installed if missing; pair with ``release_copy_hook``."""
    hook = cell.__dict__.get(_COPY_ATTR)
    if not isinstance(hook, CopyHook):
        hook = CopyHook(cell)
        object.__setattr__(cell, _COPY_ATTR, hook)   # an instance attribute: deepcopy looks it up with getattr
        object.__setattr__(cell, _PICKLE_ATTR, PickleRefusal(cell))   # and so does pickle
    hook.users += 1
    return hook


def release_copy_hook(cell):
    hook = cell.__dict__.get(_COPY_ATTR)
    if isinstance(hook, CopyHook):
        hook.users -= 1
        if hook.users <= 0:
            del cell.__dict__[_COPY_ATTR]
            cell.__dict__.pop(_PICKLE_ATTR, None)


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


def foreign_patches(root):
    """``(path, cell, patch)`` for each cell under ``root`` whose construct is a patch made for another cell.

    A tool that rebuilds a network by copying its cells' instance attributes
    (amp O1 and ``custom_mixed_precision`` rewrite it into new cell classes)
    copies the patches too: the new cell then runs the *old* cell's code
    through them, and undoing the patches on the old cells leaves the copies
    patched.
    """
    found = []
    for path, cell in root.cells_and_names():
        patch = patch_of(cell.__dict__.get("construct"))
        if patch is not None and patch.cell is not cell:
            found.append((path, cell, patch))
    return found


def copied_patch_message(path, cell, patch):
    """Why a cell holding another cell's patch is refused, and what to do instead."""
    where = f"'{path}' " if path else ""
    return (f"cell {where}({type(cell).__name__}) carries the '{patch.kind}' patch that apply_ac installed on another "
            f"cell ({type(patch.cell).__name__}): this network was rebuilt from one apply_ac was applied to (amp "
            f"O1 and custom_mixed_precision rewrite the network into new cells, copy the patches and put the "
            f"new cells in the original model too), so its cells would run the old cells' code and remove_ac "
            f"can't restore them. Rebuild the model, apply mixed precision first, then apply_ac on the network "
            f"it returns")


def find_patch(cell, kind):
    """The patch of ``kind`` on ``cell``, or None."""
    return next((p for p in patches(cell) if p.kind == kind), None)


class ConstructPatch:
    """``cell.construct(*a, **k)`` becomes ``around(inner, *a, **k)``; ``remove()`` undoes it.

    ``kind`` names the wrapper: one patch per kind and cell (ValueError with
    ``undo`` as the hint otherwise) unless ``unique`` is False; ``info`` is
    the wrapper's own record. An ``outer`` patch stands for a pair of forward
    hooks: it stays outside every other patch, whenever either was added, so a
    swap group opened around a layer call encloses a checkpoint region of the
    same layer as hooks would.
    """

    def __init__(self, cell, kind, around, info=None, undo="", unique=True, outer=False):
        name = type(cell).__name__
        stack = patches(cell)
        for other in stack:
            if unique and other.kind == kind:
                raise ValueError(f"{name} is already wrapped by {kind}; {undo} first to change its options")
            if kind in _EXCLUSIVE_KINDS and other.kind in _EXCLUSIVE_KINDS:
                raise ValueError(f"{name}: checkpoint_wrapper and swap_wrapper can't wrap the same cell "
                                 "(recompute it or swap it, not both); undo the other with unwrap() or "
                                 "remove_swap_wrapper() first")
        self.cell, self.kind, self.info, self.outer = cell, kind, info, outer
        warned = set()          # sub-cells warned about as wrapped by the other exclusive kind
        check_nesting(cell, kind, warned)
        first = [kind in _EXCLUSIVE_KINDS]   # check again at the first call: a sub-cell wrapped since

        def construct(*args, **kwargs):
            if first[0]:
                first[0] = False
                check_nesting(cell, kind, warned)
            return around(self.inner, *args, **kwargs)

        @drop_on_copy
        def refuse_copied_caller(caller, args):
            # MindSpore hands a forward pre-hook the cell being called: a cell other than ours that holds this
            # very patch is a copy made by a network rewrite (see foreign_patches), which copies the hook
            # dicts with the patch; running on would run the old cell's code, silently wrong.
            if caller is not cell and caller.__dict__.get("construct") is construct:
                raise RuntimeError("mindformers_ac: " + copied_patch_message("", caller, self))

        setattr(construct, _PATCH_ATTR, self)
        self.construct = construct
        self._guard = cell.register_forward_pre_hook(refuse_copied_caller)
        above = None if outer else next((p for p in reversed(stack) if p.outer), None)
        hold_copy_hook(cell)
        if above is None:
            self.inner = cell.construct   # the class method (bound), an instance construct, or the top patch
            self.had_instance = "construct" in cell.__dict__
            cell.construct = construct
        else:   # below the innermost hook-like patch
            self.inner, self.had_instance = above.inner, above.had_instance
            above.inner, above.had_instance = construct, True

    def remove(self):
        """Take this patch out of the chain, wherever it is; a second call does nothing."""
        cell = self.cell
        stack = patches(cell)
        if self not in stack:
            return
        self._guard.remove()
        i = stack.index(self)
        if i == 0:
            if self.had_instance:
                cell.construct = self.inner
            else:
                del cell.construct
        else:
            above = stack[i - 1]
            above.inner, above.had_instance = self.inner, self.had_instance
        release_copy_hook(cell)


def bracket_calls(cell, kind, enter, leave, unique=True, pass_output=False):
    """Run ``enter(args, kwargs) -> state`` before and ``leave(state, failed)`` after every call of ``cell``
    (``pass_output``: ``leave(state, False, output)`` after a return).

    ``leave`` runs however the call ends: a return (``failed`` False), an
    exception, or a KeyboardInterrupt / SystemExit (``failed`` True).
    MindSpore's ``always_call`` forward hooks run on ``Exception`` only, so a
    Ctrl-C in forward would skip them and leave a saved-tensor hook installed
    for the whole process. When the call failed, an exception raised by
    ``leave`` itself is logged and the original error propagates (a cleanup
    failure must not hide what interrupted the forward); after a successful
    call it propagates. Like a pair of forward hooks, the bracket stays
    outside the cell's other wrappers. Returns the ``ConstructPatch``;
    ``remove()`` undoes it.
    """
    def around(inner, *args, **kwargs):
        state = enter(args, kwargs)
        try:
            out = inner(*args, **kwargs)
        except BaseException:
            try:
                leave(state, True)
            except Exception:  # pylint: disable=broad-exception-caught  # the original error wins
                logger.warning("cleanup of %s after a failed call of %s failed", kind, type(cell).__name__,
                               exc_info=True)
            raise
        if pass_output:
            leave(state, False, out)
        else:
            leave(state, False)
        return out

    return ConstructPatch(cell, kind, around, unique=unique, outer=True)
