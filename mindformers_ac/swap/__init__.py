"""The swap engine: keep saved activations in host memory between forward and backward.

* ``install``: ``install_layer_swap`` / ``install_op_swap``, what ``apply_ac`` installs;
* ``api``: HyperParallel's and MindSpeed's API on the process-wide ``SwapManager``;
* ``scheduler``: swap groups, the pack/unpack hooks and prefetch;
* ``executor``: offload / load of one tensor, with the ``SwapReport``;
* ``backends``: the host copy backend (CPU) and the device one (streams, pinned memory).

The package is callable: ``mindformers_ac.swap(fn, *args)`` runs ``swap.api.swap``
(HyperParallel's name for it), so the name means one thing, the swap engine.
"""
import sys
import types

from .api import SwapManager, async_save_on_cpu, remove_swap_wrapper, swap_tensor_wrapper, swap_wrapper
from .api import swap as _swap_call
from .executor import LayerSwapStats, SwapExecutor, SwapHandle, SwapReport
from .install import SwapInstallation, install_layer_swap, install_op_swap

__all__ = ["LayerSwapStats", "SwapExecutor", "SwapHandle", "SwapInstallation", "SwapManager", "SwapReport",
           "async_save_on_cpu", "install_layer_swap", "install_op_swap", "remove_swap_wrapper",
           "swap_tensor_wrapper", "swap_wrapper"]


class _CallableSwapPackage(types.ModuleType):
    """``mindformers_ac.swap(fn, *args, policy_fn=None, **kwargs)``: see ``swap.api.swap``."""

    def __call__(self, fn, *args, **kwargs):
        return _swap_call(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableSwapPackage
