"""``OpSlotProxy``: what the engine puts in a cell's op attribute slot in place of the op.

A path tracker's ``AttrProxy``, an ``nn.Dropout``'s ``DropoutProxy`` and
output recompute's function proxy all stand, as an instance attribute, where
a Primitive or function op was, and differ only in what a call does. The slot
behaviour they share lives here: the wrapped op is ``mac_inner``, attribute
reads the proxy doesn't answer go to it (``name``, ``keep_prob``, a
Primitive's attrs), a deep copy of the cell gets the plain op (see
``construct_patch``), and ``mac_is_op_proxy`` marks it as an op for
``tracking.is_op_attribute``. Each subclass defines ``__call__`` itself, so a
call costs no more than it did before the classes shared a base.
"""
import copy


class OpSlotProxy:
    """Stands in an instance attribute slot for the callable ``mac_inner``; subclasses define ``__call__``.

    ``mac_inner`` may be reassigned (``wrap_op_output`` swaps a tracker's
    inner op for its own proxy, ``OpOutputHandle.remove`` swaps it back).
    """

    mac_is_op_proxy = True

    def __init__(self, inner):
        self.mac_inner = inner

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define __call__")

    def __getattr__(self, name):   # only for names the proxy lacks: the op's attributes stay reachable
        return getattr(self.__dict__["mac_inner"], name)

    def __deepcopy__(self, memo):   # a copied cell gets the plain op (see construct_patch)
        return copy.deepcopy(self.mac_inner, memo)
