"""What the two swap actions share: the ``swap`` section's own rules, and the engine they install on.

The installers get the section itself (``SwapEngine.settings``), and the scheduler keeps it
(``SwapScheduler.settings``): a new field of ``swap`` that the scheduler reads is the field and the line
that reads it, nothing in between.
"""
from dataclasses import dataclass

import mindspore as ms
from mindspore import nn

from ..config import DEVICE_BACKEND_TARGETS
from ..errors import ConfigError, quote
from ..layer_specs import prefetch_trigger_id, swappable_layers, trigger_within
from ..swap import SwapExecutor
from ..swap.backends import select_backend


def section_entries(planning, name):
    """``(k, entry)`` of the list ``swap.<name>``, once the section's own rules hold; none when swap is off."""
    sc = planning.config.swap
    if not sc.enabled:
        return []
    check_swap_section(planning)
    return list(enumerate(getattr(sc, name) or ()))


def check_swap_section(planning):
    """The section's rules that need no layer: the backend against the device, the prefetch bound."""
    sc = planning.config.swap
    target = ms.get_context("device_target") if planning.stack is not None else None
    if sc.backend == "device" and target is not None and target not in DEVICE_BACKEND_TARGETS:
        raise ConfigError("swap.backend", f"device copies need an Ascend or GPU device, and MindSpore's "
                                          f"device_target is {target}: use auto or host")
    p, n, decoder = sc.default_prefetch, planning.num_layers, planning.num_decoder
    if p > n - 1:   # on a pipeline stage each swapped layer's own bound is the stage's (check_prefetch_bound)
        mtp = "" if n == decoder else f" ({decoder} decoder + {n - decoder} MTP)"
        raise ConfigError("swap.default_prefetch", f"must be in [1, {n - 1}] for a "
                                                   f"model with {n} layers{mtp}, got {quote(p)}")


def _stage_text(planning):
    return f"global layers {planning.stage_start}-{planning.stage_end - 1} of {planning.num_layers}"


def prefetch_trigger_of(planning, layer_id, field_path):
    """The layer whose backward start fetches layer ``layer_id``'s swapped tensors back: ``layer_id + p``.

    On a pipeline stage that layer must be on the stage. A stage's last ``p`` layers are fetched back by
    the stage's layer ``layer_id + p - stage size`` instead: in GPipe order its backward of the next
    microbatch comes ``p`` layers before theirs (for the first microbatch in backward order, and with one
    microbatch, they load on demand).
    """
    p, n, decoder = planning.config.swap.default_prefetch, planning.num_layers, planning.num_decoder
    if planning.is_stage and not trigger_within(layer_id, p, planning.stage_end):
        size = planning.stage_end - planning.stage_start
        if p < size:
            return prefetch_trigger_id(layer_id, p) - size
        raise ConfigError(field_path, f"layer {layer_id} + default_prefetch {p} must be < {planning.stage_end}, "
                                      f"the end of this pipeline stage ({_stage_text(planning)}), or default_"
                                      f"prefetch below the stage's {size} layers (the next microbatch's backward "
                                      f"of an earlier layer then fetches the last layers back)")
    if layer_id not in swappable_layers(n, p):
        count = f"num_layers {n}" if n == decoder else \
            (f"the {n} layers ({decoder} decoder + {n - decoder} MTP; layer i is fetched back when layer i + p "
             f"starts its backward)")
        raise ConfigError(field_path, f"layer {layer_id} + default_prefetch {p} must be < {count}: the last "
                                      f"layer that can be swapped is {n - p - 1}")
    return prefetch_trigger_id(layer_id, p)


def prefetch_part(action):
    """A swap action's ``describe`` part: where its tensors are fetched back."""
    return f"prefetch at layer {action.prefetch_layer} backward" + \
        (" of the next microbatch" if action.next_microbatch else "")


def prefetch_cell(plan, action):
    """A swap action's ``prefetch at`` cell in the plan's table."""
    return plan.layer_label(action.prefetch_layer) + (" (next microbatch)" if action.next_microbatch else "")


def settings_line(plan):
    """The section's settings, under the plan's table."""
    sc = plan.config.swap
    bound = "none (no bound)" if sc.max_host_bytes is None else str(sc.max_host_bytes)
    return f"Swap settings: min_bytes {sc.min_bytes}, max_host_bytes {bound}, backend {sc.backend}"


@dataclass
class SwapEngine:
    """What a swap installer of ``apply_ac`` is given: the one executor of the model, and the settings."""

    executor: SwapExecutor
    params: list          # parameters never offloaded (None: the installer's model's own)
    mtp: object           # the MTP block when it runs in its own call, else None
    settings: object      # the swap section (``SwapConfig``), handed to the installers and the scheduler whole:
                          # they read default_prefetch and min_bytes from it

    def top(self, plan, model, layer_id):
        """The call a layer runs in: its tensors received from outside it stay on the device."""
        return self.mtp if self.mtp is not None and layer_id >= plan.num_layers else model


def swap_engine(state, model):
    """The model's ``SwapEngine``, made on first use (``state.swap_executor`` is closed by ``remove``)."""
    if state.swap_engine is None:
        sc = state.plan.config.swap
        # MTP layers run in the MTP block's call, not the model's: the tensors that call receives (the
        # decoder's output, masks) stay on the device for them, as the model's inputs do for the decoder.
        # Parameters of both never leave the device.
        block = state.mtp_block
        mtp = block if isinstance(block, nn.Cell) and block is not model else None
        params = None if mtp is None else list(model.get_parameters()) + list(mtp.get_parameters())
        state.swap_executor = SwapExecutor(select_backend(kind=sc.backend), max_pool_bytes=sc.max_host_bytes)
        state.swap_engine = SwapEngine(state.swap_executor, params, mtp, sc)
    return state.swap_engine
