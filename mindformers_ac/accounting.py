"""One accounting of activation memory, used by ``train``, the benchmarks and the tests.

The figure is *bytes kept alive for backward*, per layer, at the end of the
forward pass (where activation memory peaks in a training step):

* outside recompute and swap regions, a saved-tensor meter counts every
  storage autograd packs (deduplicated by ``data_ptr``, weights excluded) and
  attributes it to the layer running at the time (``"other"`` for the
  embedding, head and loss);
* inside regions the engines' own hooks hide the meter, so the engines report
  what they keep: ``RecomputeStats.kept_bytes`` (inputs, excluded ops, random
  masks) and ``SwapReport`` resident bytes (what stayed on the device);
* saved-tensor hooks the model installs itself are seen through (the meter
  counts what their packed objects hold; see ``meter``), and one holding
  nothing the meter can see is named in a warning, once per model;
* the engines of every ``apply_ac`` on the model or on one of its sub-cells
  are read (MindFormers applies it to ``model.decoder``).

On a model without AC, the per-layer figures (``"other"`` included) add up to the peak an
independent ``SavedTensorMeter`` measures over the same step, to the byte
(``tests/test_apply.py`` on the reference GPT; ``tests/test_meter_foreign_hooks.py``
on a model with saved-tensor hooks of its own). The split between layers
is not checked against an independent meter: the tests check that alike
layers get equal figures, that a model's own hooks leave every per-layer
figure as it is without them, and that a fully recomputed layer's figure is
its ``RecomputeStats.kept_bytes``.

Use ``measure_step(model, step_fn, *args)`` on your own model: it runs one
step and returns a ``StepMemory`` with the per-layer figures.
"""
import contextlib
from dataclasses import dataclass, field

from mindspore import nn

from .installed import ac_state
from .layers import find_layer_stack
from .logs import OnceLogger
from .meter import SavedTensorMeter
from .meter import logger as meter_logger
from .mindspore_compat import registered_pack_hook
from .recompute import is_in_recompute

OTHER = "other"
LAYER_ITSELF = "(layer)"            # bytes a layer packs outside all of its modules
ENGINE_REGIONS = "(recompute regions)"   # what the recompute engine keeps: inputs, excluded ops, masks
SWAP_RESIDENT = "(swap, on device)"  # what swap left on the device
# How deep into a layer the per-module figures go: "mlp" and "mlp.experts", not deeper.
MODULE_DEPTH = 2


class LayerMeter(SavedTensorMeter):
    """A ``SavedTensorMeter`` that attributes each storage to the layer that packed it first, and within
    the layer to the innermost of its modules (sub-cells up to ``MODULE_DEPTH`` deep) that was running.

    ``by_module_at_peak``: ``{layer id: {module path: bytes}}`` at the peak; bytes packed by the layer
    outside every module are under ``LAYER_ITSELF``. Inside recompute and swap regions the engines'
    hooks hide this meter: what they keep is reported by the engines (``_engine_figures``).
    """

    def __init__(self, params, layer_cells, model=None, warnings=None):
        super().__init__(params, model, warnings)
        self.layer_cells = layer_cells        # global id -> cell
        self._running = []                    # stack of (layer id, module path) currently in forward
        self._owner = {}                      # data_ptr -> (layer id, module path)
        self.by_module = {}                   # (layer id, module path) -> bytes held now
        self.by_module_at_peak = {}
        self._handles = []

    def _enter(self, owner):
        def pre(cell, args):
            self._running.append(owner)
        return pre

    def _exit(self, cell, args, output):
        if self._running:
            self._running.pop()

    def _hook(self, cell, owner):
        self._handles.append(cell.register_forward_pre_hook(self._enter(owner)))
        self._handles.append(cell.register_forward_hook(self._exit))

    def attach(self):
        self._running = []   # a step that raised may have left layers open
        for layer_id, cell in self.layer_cells.items():
            self._hook(cell, (layer_id, LAYER_ITSELF))
            for path, sub in cell.cells_and_names():
                # A forward hook would turn on the saved-tensor hooks a module registered, which MindSpore
                # skips on a cell without hooks (mindspore_compat.registered_pack_hook): what it packs is
                # its parent's in the figures instead. A layer needs its hooks for the split by layer.
                if path and path.count(".") < MODULE_DEPTH and registered_pack_hook(sub) is None:
                    self._hook(sub, (layer_id, path))

    def detach(self):
        while self._handles:
            self._handles.pop().remove()

    def skip_chained(self):
        return is_in_recompute()   # a recompute's throw-away graph, met through another hook

    def storage_added(self, ptr, nbytes):
        owner = self._running[-1] if self._running else (OTHER, LAYER_ITSELF)
        self._owner[ptr] = owner
        self.by_module[owner] = self.by_module.get(owner, 0) + nbytes
        if self.current == self.peak:
            self.by_module_at_peak = dict(self.by_module)

    def storage_released(self, ptr, nbytes):
        owner = self._owner.pop(ptr, None)
        if owner is not None:
            self.by_module[owner] -= nbytes


@dataclass
class LayerMemory:
    """One layer's figures for one step (bytes; ``ops_rerun`` and the region calls are counts).

    ``kept_by_module`` splits ``kept_bytes`` by where it was kept: the
    layer's modules (what the meter saw outside engine regions), the
    recompute regions, what swap left on the device.
    ``light_calls`` / ``intercepted_calls``: the layer's recompute-region calls
    that took the light path / intercepted every op (see ``recompute.path_choice``);
    ``intercept_reasons``: why the layer's calls stayed intercepted this step
    (reason -> times found, as ``RecomputeStats.intercept_reasons``).
    """

    layer: object
    kept_bytes: int = 0          # on the device for backward at the end of forward
    recomputed_bytes: int = 0    # dropped in forward, rebuilt in backward
    offloaded_bytes: int = 0     # copied to host memory
    prefetched_bytes: int = 0    # back on the device in time (prefetch finished before use)
    on_demand_bytes: int = 0     # loaded when backward needed it (no or late prefetch)
    ops_rerun: int = 0
    light_calls: int = 0
    intercepted_calls: int = 0
    intercept_reasons: dict = field(default_factory=dict)
    # what kept_bytes is made of: module path (up to MODULE_DEPTH), LAYER_ITSELF, ENGINE_REGIONS,
    # SWAP_RESIDENT -> bytes (non-zero entries only); the values add up to kept_bytes
    kept_by_module: dict = field(default_factory=dict)

    def as_dict(self):
        return dict(self.__dict__)


@dataclass
class StepMemory:
    """Per-layer activation memory of one training step (see the module docstring)."""

    layers: dict = field(default_factory=dict)   # global id or "other" -> LayerMemory

    @property
    def kept_bytes(self):
        return sum(lm.kept_bytes for lm in self.layers.values())

    @property
    def offloaded_bytes(self):
        return sum(lm.offloaded_bytes for lm in self.layers.values())

    @property
    def recomputed_bytes(self):
        return sum(lm.recomputed_bytes for lm in self.layers.values())

    def as_dict(self):
        return {"kept_bytes": self.kept_bytes, "recomputed_bytes": self.recomputed_bytes,
                "offloaded_bytes": self.offloaded_bytes,
                "layers": {str(k): lm.as_dict() for k, lm in self.layers.items()}}


def _add(counts, key, nbytes):
    if nbytes:
        counts[key] = counts.get(key, 0) + nbytes


def _engine_figures(state, memory):
    """Add what the recompute and swap engines report for this step to ``memory``."""
    if state is None:
        return
    for layer_id, stats in state.recompute_stats.items():
        lm = memory.layers.setdefault(layer_id, LayerMemory(layer_id))
        lm.kept_bytes += stats.kept_bytes
        _add(lm.kept_by_module, ENGINE_REGIONS, stats.kept_bytes)
        lm.recomputed_bytes += stats.dropped_bytes
        lm.ops_rerun += stats.ops_rerun
        lm.light_calls += stats.light_calls
        lm.intercepted_calls += stats.intercepted_calls
        for reason, n in stats.intercept_reasons.items():
            lm.intercept_reasons[reason] = lm.intercept_reasons.get(reason, 0) + n
    report = state.swap_report
    if report is None:
        return
    for layer_id, s in report.layers.items():
        lm = memory.layers.setdefault(layer_id, LayerMemory(layer_id))
        lm.kept_bytes += s.resident_bytes
        _add(lm.kept_by_module, SWAP_RESIDENT, s.resident_bytes)
        lm.offloaded_bytes += s.offloaded_bytes
        lm.prefetched_bytes += s.prefetched_bytes
        lm.on_demand_bytes += s.on_demand_bytes + s.late_bytes


class StepMeter:
    """Measure steps of one model; ``with meter.step() as memory: run the step``.

    Each step attaches the layer hooks and detaches them when it ends. Works
    with or without ``apply_ac`` (also applied or removed after the meter was
    made): the engines' per-step counters are read and reset. ``mtp_block``:
    MindFormers' multi-token-prediction block, whose layer ``i`` is measured as
    global layer ``num_layers + i`` (default: the block ``apply_ac`` was given).
    """

    def __init__(self, model, layers=None, mtp_block=None):
        self.model = model
        if mtp_block is None:   # the MTP block an apply_ac on the model (or its decoder) was given
            mtp_block = next((s.mtp_block for s in self._ac_states() if isinstance(s.mtp_block, nn.Cell)), None)
        stack = find_layer_stack(model, layers, mtp_block)
        self.layer_ids = list(stack.layer_ids)
        self.layer_cells = {i: stack.cell(i) for i in stack.layer_ids}
        self.params = list(model.get_parameters())
        self.warnings = OnceLogger(meter_logger)   # a hook the meter can't see into is named once per model

    def _ac_states(self):
        """The ``AcState`` of the model and of its sub-cells: MindFormers applies AC to ``model.decoder``
        and measures the whole model."""
        states = (ac_state(cell) for _, cell in self.model.cells_and_names())
        return list({id(s): s for s in states if s is not None}.values())

    @staticmethod
    def _reset_engines(states):
        for state in states:
            for stats in state.recompute_stats.values():
                stats.reset()
            if state.swap_report is not None:
                state.swap_report.end_step()

    @contextlib.contextmanager
    def step(self):
        step = self.begin()
        try:
            yield step.memory
        finally:
            step.end_forward()
        step.finish()

    def begin(self, engines_at_forward_end=False):
        """Start measuring a step without a ``with`` (``budget.controller`` does, from a model's forward
        hooks): ``end_forward()`` when the forward ends, ``finish()`` once its backward is done.
        ``engines_at_forward_end``: read the engines' counters when the forward ends (what they keep,
        drop and offload is known then), not in ``finish``: another meter's next step may have reset them
        by then (the controller measures inside ``train``'s meter)."""
        return OpenStep(self, engines_at_forward_end)


class OpenStep:
    """A step ``StepMeter.begin`` is measuring: the meter's hooks are in from here to ``end_forward``
    (forward packs what backward keeps); ``finish`` reads the engines' counters, which backward completes,
    into ``memory``."""

    def __init__(self, step_meter, engines_at_forward_end=False):
        self.engines_read = False
        self.engines_at_forward_end = engines_at_forward_end
        self.states = step_meter._ac_states()   # pylint: disable=protected-access
        StepMeter._reset_engines(self.states)   # pylint: disable=protected-access
        self.meter = LayerMeter(step_meter.params, step_meter.layer_cells, step_meter.model, step_meter.warnings)
        self.meter.attach()
        self.memory = StepMemory({i: LayerMemory(i) for i in step_meter.layer_ids})
        self.memory.layers[OTHER] = LayerMemory(OTHER)
        self._hooks = self.meter.hooks()
        try:
            self._hooks.__enter__()
        except BaseException:
            self.meter.detach()
            raise

    @property
    def in_forward(self):
        """The meter's hooks are in (``end_forward`` has not run)."""
        return self._hooks is not None

    def end_forward(self):
        if self._hooks is None:
            return
        hooks, self._hooks = self._hooks, None
        try:
            hooks.__exit__(None, None, None)
        finally:
            self.meter.detach()
        if self.engines_at_forward_end:
            self._read_engines()

    def _read_engines(self):
        if not self.engines_read:
            self.engines_read = True
            for state in self.states:
                _engine_figures(state, self.memory)

    def finish(self):
        self.end_forward()
        memory = self.memory
        for (owner, module), nbytes in self.meter.by_module_at_peak.items():
            lm = memory.layers[owner]
            lm.kept_bytes += nbytes
            _add(lm.kept_by_module, module, nbytes)
        self._read_engines()
        return memory


def measure_step(model, step_fn, *args, layers=None, mtp_block=None, **kwargs):
    """Run ``step_fn(*args, **kwargs)`` (forward + backward of ``model``) once; return its ``StepMemory``.

    ``step_fn`` is typically ``ms.value_and_grad(model, None, params)`` or a
    training step that calls it. Works on any model whose layer list
    ``plan_ac`` finds (or that ``layers`` names), with or without ``apply_ac``;
    MTP layers (``mtp_block``, as ``apply_ac`` takes it) are global ids after the decoder's.
    """
    meter = StepMeter(model, layers, mtp_block)
    with meter.step() as memory:
        step_fn(*args, **kwargs)
    return memory


__all__ = ["LayerMemory", "LayerMeter", "OpenStep", "StepMemory", "StepMeter", "measure_step"]
