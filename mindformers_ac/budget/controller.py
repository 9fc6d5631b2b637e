"""``memory_budget`` at work: measure the options on the user's first training steps, then install the
cheapest plan that fits.

``apply_ac`` with a ``memory_budget`` section installs this controller on
the model it was given: one bracket around that cell's ``construct``
(``construct_patch``; a forward that raises, Ctrl-C included, ends the
measured step there and then). While a step is measured it also holds the
meter's forward hooks on every layer and its modules (``accounting.StepMeter``),
a gradient hook on every trainable Parameter (when the backward ends) and one
on the forward's output (when it starts); the first two are taken off when
the step closes, the last lives in that step's graph. A *training forward* is one MindSpore records for a gradient
(``requires_grad``); an eval forward in between is left alone. Every AC
option is bitwise exact, so the controller can run the user's own steps
under any candidate plan without changing the training curve:

* **profiling** (``profile_steps`` training forwards): the first runs without
  AC (a warm-up: first calls are slow), the second without AC too (the
  baseline: its kept bytes are what ``0.5x`` is a fraction of), then one
  step per candidate option, applied to every layer where it is allowed
  (``profile_schedule``: full recompute and layer swap first); steps left
  over (``profile_steps`` more than those) time the baseline and the options
  again, in the same order (``retiming_schedule``): an option timed more than
  once costs the median of its steps, and the widest spread of one option's
  times widens the timing noise (``Profile.time_spread_s``); so does an
  option's step measured faster than the step without AC (an option adds
  work, so the difference is noise). The steps
  may have other input shapes each (a new sequence length every step): each
  is scaled by element count to the largest shapes among them, which the
  plan is chosen for. Each step is
  measured as ``train`` measures (``accounting.StepMeter``: kept bytes per
  layer, the rebuild in backward, what swap offloaded) and timed as its
  forward plus its backward (``MeasuredStep``), not what the trainer does
  between steps. Timed in wall time: the process's CPU time (all threads) was
  measured as noisy as wall time on a loaded CPU, not less (MindSpore's pool
  threads wait spinning for each other, and so count time a busy machine
  makes them wait).
* **the choice**: ``budget.solver.plan_within`` on those figures, under the
  real peak (kept bytes, plus the largest rebuild, plus what prefetch
  brings back ahead of time); plans within the timing noise of the fastest
  are a tie, settled by bytes (said in the log). The chosen plan is installed, and the next
  training step is measured: a second timing of the chosen options. If its
  measured peak is over the budget, the profile takes the measured figures
  and the choice is made once more (said in the log); if its step time
  missed the prediction by more than the timing noise, that miss is how far
  this machine moves a step, the noise widens to it, and when that makes
  another plan a tie with fewer bytes the choice is made once more too (said
  in the log). After that the plan stays. If nothing fits, the plan with the
  least peak is installed and one warning gives the figures.
* **settled**: one log block says what was measured and chosen
  (``describe``); ``ac_state(model).plan`` is the chosen ``AcPlan`` and its
  ``to_config()`` pins it without profiling. The bracket then only compares
  input shapes: a forward with shapes not seen before is predicted (the
  measured peak, scaled by the inputs' element count) and profiled again
  only if the prediction is over the budget, at most ``MAX_PROFILES`` times
  in all; past that, the plan stays and a warning says so once. A plan
  chosen for a shape is installed again when that shape comes back.

A plan is only switched when no training forward is in flight: every earlier
one's output has had its gradient, or is gone (``_in_flight``). With
microbatches in flight the plan stays, and a forward made while another is in
flight is not a profiling sample; nor is a step whose forward raised. A measured
step's kept bytes and time count as many times as training forwards were seen in
flight at once (``held_in_flight``: a pipeline stage's microbatches, all held in
GPipe order); a rebuild in backward stays one at a time.

Under MindSpore's communication the ranks that must run one plan choose it
together (``budget.agreement``): the profile, and the chosen plan's measured
step, are combined over the group (every figure its worst rank's) before each
decision, so every rank installs the same plan and re-plans, or not, with the
others. The group is the world, except on a pipeline stage (``agree_within``).

The budget in bytes is fixed by the first profile (a fraction of its baseline); later profiles keep it.
The profiling steps run without AC once each: the model must fit without AC
for those steps (pin an offline plan, ``mindformers-ac plan``, where it does not).
"""
import dataclasses
import logging
import math
import time
import weakref
from enum import Enum

import numpy as np

from ..accounting import OTHER, StepMemory, StepMeter
from ..config import MemoryBudgetConfig
from ..construct_patch import ConstructPatch
from ..layer_specs import format_layer_specs, swappable_layers
from ..logs import report_summary
from ..mindspore_compat import pynative_executor
from ..plan import plan_with_layers
from ..tensors import MiB, is_tracked, tensor_leaves_in_objects
from .agreement import Agreement, agreed_profile, initialised_world
from .options import OptionSample, applied_layers, candidate_options, profile_with_noise
from .sizes import format_bytes
from .solver import OptionKind, option_config, plan_within, summarize, widened_by_miss

logger = logging.getLogger("mindformers_ac")

MAX_PROFILES = 3   # the first profile and two for new input shapes
MAX_IN_FLIGHT = 64   # forwards before a backward: a pipeline's microbatches (train --microbatches' bound too)
_BASELINE = 1   # sample index of the second step without AC (the first is a warm-up)
# why a choice was made a second time, when its plan's measured peak was over the budget (the report's
# words for a record written before ``replanned_because`` existed, too)
REPLANNED_OVER_BUDGET = "the first choice measured over the budget"


class Phase(str, Enum):
    PROFILING = "profiling"
    CHECKING = "checking"    # the chosen plan's first step, measured
    SETTLED = "settled"


def profile_schedule(options, steps, include_swap):
    """The option each profiling step runs: ``none`` twice (warm-up, baseline), then the most useful
    options first (full recompute, layer swap, selects of whole sub-layers, the rest), ``steps`` in all."""
    def rank(option):
        if option.kind == OptionKind.FULL:
            return (3,) if option.exclude else (0,)   # keeping outputs takes the slower path: last
        if option.kind == OptionKind.SWAP:
            return (1,)
        return (2, -len(option.select), sum(p.count(".") for p in option.select))
    rest = sorted((o for o in options if o.kind != OptionKind.NONE and (include_swap or o.kind != OptionKind.SWAP)),
                  key=rank)
    none = next(o for o in options if o.kind == OptionKind.NONE)
    return [none, none] + rest[:steps - 2]


def retiming_schedule(first_pass, steps):
    """The profiling steps after ``first_pass`` (``profile_schedule``'s) when ``steps`` allows more: the
    baseline and the options again, in the same order, round after round; none when it does not."""
    timed = first_pass[1:]   # not the warm-up's second run: the baseline is "none" already
    return [timed[i % len(timed)] for i in range(max(0, steps - len(first_pass)))]


def shape_key(args):
    """The shapes and dtypes of a forward's tensor arguments: what a profile is valid for."""
    return tuple((tuple(t.shape), str(t.dtype)) for t in tensor_leaves_in_objects(args))


def _elements(key):
    return sum(math.prod(shape) for shape, _ in key) or 1


_BYTE_FIELDS = ("kept_bytes", "recomputed_bytes", "offloaded_bytes", "prefetched_bytes", "on_demand_bytes")


def scaled_memory(memory, factor, fields=_BYTE_FIELDS):
    """A ``StepMemory`` with the byte figures ``fields`` of ``memory`` (every one by default) and the kept bytes
    per module times ``factor`` (the figures of a step at other input shapes, by element count); ``memory``
    itself when ``factor`` is 1."""
    if factor == 1:
        return memory
    layers = {}
    for key, lm in memory.layers.items():
        scaled = dataclasses.replace(lm, **{f: int(round(getattr(lm, f) * factor)) for f in fields})
        scaled.kept_by_module = {k: int(round(v * factor)) for k, v in lm.kept_by_module.items()}
        layers[key] = scaled
    return StepMemory(layers)


def held_in_flight(memory, copies):
    """A ``StepMemory`` of one training forward as ``copies`` forwards in flight hold it (a pipeline stage's
    microbatches): the kept bytes ``copies`` times; a rebuild and an offload come back one at a time, as
    ``planner.stages`` counts them offline. ``memory`` itself when ``copies`` is 1."""
    return scaled_memory(memory, copies, fields=("kept_bytes",))


def measured_peak(memory, layer_ids, prefetch):
    """A step's real peak from its ``StepMemory``, the figure the solver bounds: kept bytes, plus the
    largest rebuild in backward, plus the ``prefetch`` largest offloads (back on the device ahead of use)."""
    layers = [memory.layers[i] for i in layer_ids if i in memory.layers]
    rebuild = max((lm.recomputed_bytes for lm in layers), default=0)
    offloads = sorted((lm.offloaded_bytes for lm in layers), reverse=True)
    return memory.kept_bytes + rebuild + sum(offloads[:prefetch])


class MeasuredStep:
    """One training step the controller measures: its memory (an ``accounting.OpenStep``) and its compute
    time, the forward (pre-hook to hook) plus the backward (the output's gradient to the last parameter's),
    so that what the trainer does between steps (data, logging, a checkpoint, another model) is not an
    option's cost."""

    def __init__(self, memory_step, option, shape, params):
        self.memory_step, self.option, self.shape = memory_step, option, shape
        self.started = time.perf_counter()
        self.forward_s = self.backward_from = self.last_grad = None
        self._grad_hooks = []
        # MindSpore holds a tensor hook where the garbage collector does not look: a hook holding this step
        # (and so the controller and the model) would keep a model dropped between its forward and its
        # backward alive for ever; it holds a weak reference
        mine = weakref.ref(self)

        def grad_seen(_grad):
            step = mine()
            if step is not None:
                step.last_grad = time.perf_counter()
        try:
            for p in params:
                self._grad_hooks.append(p.register_hook(grad_seen))
        except BaseException:
            self.close()
            raise

    def end_forward(self):
        if self.forward_s is None:
            self.forward_s = time.perf_counter() - self.started
        self.memory_step.end_forward()

    def backward_started(self):
        if self.backward_from is None:
            self.backward_from = time.perf_counter()

    @property
    def complete(self):
        """Its forward ended and its backward reached the output and a parameter."""
        return None not in (self.forward_s, self.backward_from, self.last_grad)

    def seconds(self):
        return self.forward_s + max(0.0, self.last_grad - self.backward_from) if self.complete else None

    def close(self):
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []
        self.memory_step.end_forward()

    def finish(self):
        self.close()
        return self.memory_step.finish()


class BudgetController:
    """The ``memory_budget`` of one model (``ac_state(model).budget``); see the module docstring.

    ``phase``; ``profile`` (``solver.Profile``) and ``choice`` (``solver.BudgetPlan``) once chosen;
    ``budget_bytes``; ``measured_peak`` / ``measured_step_s`` of the chosen plan's measured step;
    ``fits``; ``profiles`` (how many were taken); ``events``: what was logged, in order.
    """

    def __init__(self, state, model, stack):
        self.state, self.model = state, model
        config = state.config
        self.settings = config.memory_budget
        self.base_config = dataclasses.replace(config, memory_budget=MemoryBudgetConfig())
        self.prefetch = config.swap.default_prefetch
        self.layer_ids = [i for i in stack.layer_ids if i < stack.num_layers]
        options = candidate_options(stack.cell(self.layer_ids[0]))
        include_swap = self.settings.include_swap and bool(swappable_layers(len(self.layer_ids), self.prefetch))
        first_pass = profile_schedule(options, self.settings.profile_steps, include_swap)
        self.schedule = first_pass + retiming_schedule(first_pass, self.settings.profile_steps)
        self.meter = StepMeter(model, state.layers_arg, state.mtp_block)
        self.phase = Phase.PROFILING
        self.samples, self.sample_shapes, self.profile_shape, self.profiles = [], [], None, 1
        self.profile = self.choice = self.budget_bytes = None
        self.measured_peak = self.measured_step_s = None
        self.fits, self.replanned = True, False
        self.replanned_because = None   # why the choice was made a second time, in words
        self.plans = {}          # shape key -> (the option config for it, its measured or predicted peak)
        self.active_shape = None # the shape whose plan is installed
        self.installed = None    # the option config installed now (None: the apply_ac plan, nothing)
        self.events = []
        self.baseline_sample = None  # (training step, input shapes, kept bytes) of the last profile's baseline
        self.baseline_from = None    # ... of the budget's, with the budget in bytes at its inputs
        self.forwards = 0        # training forwards seen (not counting those made while one was in flight)
        self.chosen_at = None    # the training forward from which the current choice runs
        self._open = None        # the MeasuredStep in progress
        self._awaiting = {}      # token -> weakref to a training forward's output its backward has not reached
        self._skipped = 0        # forwards in a row made while one was in flight
        self.in_flight = 1       # the most training forwards seen in flight at once (a pipeline's microbatches)
        self._warned = set()
        self._patch = None
        # the ranks that choose together (``budget.agreement``): the world when MindSpore's communication is
        # initialised, except on a pipeline stage, whose ranks across replicas only the trainer knows
        # (``agree_within``); None: this process chooses alone
        world = initialised_world()
        self.agreement = Agreement(world) if world is not None and state.plan.pp == 1 else None
        self.own_figures = None   # this rank's own baseline (step seconds, kept bytes) when ranks agree

    # -- hooks -------------------------------------------------------------------------------------------

    def install(self):
        # one bracket around the model's construct (not a pair of forward hooks): a forward that raises,
        # KeyboardInterrupt included, closes the step being measured there and then, so no meter hook
        # outlives it (MindSpore's always_call forward hooks run on Exception only)
        self._patch = ConstructPatch(self.model, "memory_budget", self._around_forward, outer=True)

    def uninstall(self):
        patch, self._patch = self._patch, None
        if patch is not None:
            patch.remove()
        self._drop_open_step()

    def _around_forward(self, inner, *args, **kwargs):
        try:
            self._before_forward(args)
            output = inner(*args, **kwargs)
        except BaseException:
            self._drop_open_step()
            raise
        self._after_forward(output)
        return output

    def _drop_open_step(self):
        """The step being measured ends here and is no sample (its forward raised, or AC is removed)."""
        step, self._open = self._open, None
        if step is not None:
            step.close()

    def _before_forward(self, args):
        if not pynative_executor.requires_grad():
            return   # eval, or a forward nobody takes a gradient of: not a training step
        if self._in_flight() and self._skipped < MAX_IN_FLIGHT:
            self._skipped += 1
            return   # a backward is still to come: the plan stays, and this forward is not a sample
        if self._skipped < MAX_IN_FLIGHT and self.phase != Phase.SETTLED:
            self.in_flight = max(self.in_flight, self._skipped + 1)
        # past MAX_IN_FLIGHT the forwards in flight were abandoned (a loss kept but never differentiated)
        self._awaiting.clear()
        self._skipped = 0
        self.forwards += 1
        shape = shape_key(args)
        if self._open is not None:
            step, self._open = self._open, None
            self._finish(step)
        if self.phase == Phase.SETTLED:
            self._settled_forward(shape)
        if self.phase == Phase.PROFILING:
            option = self.schedule[len(self.samples)]
            self._install(self._option_config(option))
            self._start(option, shape)
        elif self.phase == Phase.CHECKING:
            self._start(None, shape)

    def _after_forward(self, output):
        if not pynative_executor.requires_grad():
            return
        if self._open is not None:
            self._open.end_forward()
        # the backward that reaches this output runs the whole model's backward in the same call: once
        # it has, a new training forward may switch the plan
        tracked = next((t for t in tensor_leaves_in_objects(output) if is_tracked(t)), None)
        if tracked is not None:
            token = object()
            self._awaiting[token] = weakref.ref(tracked)
            controller = weakref.ref(self)   # the output may outlive the model (see MeasuredStep)

            def reached(_grad):
                me = controller()
                if me is None:
                    return
                me._awaiting.pop(token, None)   # pylint: disable=protected-access
                if me._open is not None:   # pylint: disable=protected-access
                    me._open.backward_started()   # pylint: disable=protected-access
            tracked.register_hook(reached)

    def _in_flight(self):
        """A training forward's backward is still to come: its output is alive and its gradient not reached
        (an output dropped without a backward, a step that failed, is not in flight)."""
        for token, ref in list(self._awaiting.items()):
            if ref() is None:
                del self._awaiting[token]
        return bool(self._awaiting)

    def _start(self, option, shape):
        memory_step = self.meter.begin(engines_at_forward_end=True)
        try:
            self._open = MeasuredStep(memory_step, option, shape, self.model.trainable_params())
        except BaseException:
            memory_step.end_forward()
            raise

    # -- phases ------------------------------------------------------------------------------------------

    def _finish(self, step):
        option, shape = step.option, step.shape
        seconds, complete = step.seconds(), step.complete
        # a measured step is one forward (the first microbatch; those in flight with it are no samples) and its
        # backward: the plan must hold every forward in flight, and a step runs them all
        memory = held_in_flight(step.finish(), self.in_flight)
        seconds = seconds * self.in_flight if complete else None
        if not complete:   # its forward raised, or no gradient reached it: the figures are not a step's
            logger.debug("memory_budget: a measured step did not complete its forward and backward; not used")
            return
        if self.phase == Phase.PROFILING:
            applied = applied_layers(option, len(self.layer_ids), self.prefetch)
            self.samples.append(OptionSample(option, applied, seconds, memory))
            self.sample_shapes.append(shape)
            if len(self.samples) == _BASELINE + 1:   # the step just finished: the forward before this one
                self.baseline_sample = (self.forwards - 1, shape, memory.kept_bytes)
            if len(self.samples) == len(self.schedule):
                self._choose()
        elif self.phase == Phase.CHECKING:
            factor = _elements(self.profile_shape) / _elements(shape)   # the figures at the profile's shapes
            memory = scaled_memory(memory, factor)
            self.measured_peak = measured_peak(memory, self.layer_ids, self.prefetch)
            self.measured_step_s = seconds * factor
            if self.agreement is not None:   # the verdicts below (over the budget, a missed time) are the group's
                peak, self.measured_step_s = self.agreement.worst([self.measured_peak, self.measured_step_s])
                self.measured_peak = int(peak)
            self._check(memory)

    def _choose(self):
        # steps of other input shapes (a new sequence length every step) count all the same: each is scaled
        # by element count to the largest shapes the profile measured, as a settled plan is predicted for
        # new shapes (a profile that waited for one shape to come back could wait for ever)
        shapes = self.sample_shapes[_BASELINE:]
        self.profile_shape = max(shapes, key=_elements)
        target = _elements(self.profile_shape)
        scaled = [scaled_memory(s.memory, target / _elements(shape))
                  for s, shape in zip(self.samples[_BASELINE:], shapes)]
        steps = [OptionSample(s.option, s.applied, s.seconds * target / _elements(shape), self._by_row(memory))
                 for s, shape, memory in zip(self.samples[_BASELINE:], shapes, scaled)]
        inputs = ", ".join(f"{list(s)} {d}" for s, d in self.profile_shape)
        distinct = len(set(shapes))
        description = f"{len(self.samples)} training steps, inputs {inputs}"
        if len({s.option for s in steps}) < len(steps):
            description += " (options timed more than once: the median of their steps)"
        if self.in_flight > 1:
            description += (f" ({self.in_flight} training forwards in flight, a pipeline stage's microbatches: "
                            f"kept bytes and step times of one, times {self.in_flight})")
        if distinct > 1:
            description += (f" (the largest of {distinct} input shapes; the steps of the others scaled to it by "
                            f"element count)")
            self._note(f"memory_budget: the {len(shapes)} profiling steps after the warm-up had {distinct} input "
                       f"shapes; each step's figures are "
                       f"scaled by element count to the largest, {inputs}, and the plan is chosen for it")
        profile = profile_with_noise(steps, len(self.layer_ids), self.prefetch, description=description)
        base = scaled[0]
        profile.other_bytes += self._unplanned_bytes(base)
        base_kept = base.kept_bytes
        if self.agreement is not None:
            self.own_figures = (profile.baseline_step_s, base_kept)
            profile, (base_kept,) = agreed_profile(self.agreement, profile, base_kept)
            base_kept = int(base_kept)
        if self.budget_bytes is None:
            self.budget_bytes = self.settings.budget_bytes(base_kept) if self.settings.is_fraction \
                else self.settings.budget_bytes(0)
            step, shape, kept = self.baseline_sample
            self.baseline_from = (step, shape, kept, int(round(self.budget_bytes * _elements(shape) / target)),
                                  self.profile_shape)
        self.profile = profile
        self._solve()

    def _solve(self):
        self.choice, self.fits = plan_within(self.profile, self.budget_bytes)
        if not self.fits:
            self._warn_once("too_small", f"memory_budget: even the plan with the least peak needs "
                                         f"{format_bytes(self.choice.backward_peak)}, over the budget of "
                                         f"{format_bytes(self.budget_bytes)}; training goes on with it "
                                         f"({self._chosen_text(self.choice)})")
        if self.choice.tie:
            self._note(f"memory_budget: a tie: {self.choice.tie}")
        config = option_config(self._by_layer(self.choice), self.base_config, self.prefetch)
        self.plans[self.profile_shape] = (config, self.choice.backward_peak)
        self._install(config)
        self.chosen_at = self.forwards - 1
        self.phase = Phase.CHECKING

    def _check(self, memory):
        over = self.measured_peak > self.budget_bytes
        widened = not self.replanned and self._widen_noise()
        if over and self.fits and not self.replanned:
            self.replanned, self.replanned_because = True, REPLANNED_OVER_BUDGET
            self._note(f"memory_budget: the chosen plan's measured peak {format_bytes(self.measured_peak)} is over "
                       f"the budget {format_bytes(self.budget_bytes)} (predicted "
                       f"{format_bytes(self.choice.backward_peak)}): choosing again with the measured figures",
                       logging.WARNING)
            self._take_measured(memory)
            self._solve()
            return
        if widened:
            again, fits = plan_within(self.profile, self.budget_bytes)
            if again.choice != self.choice.choice and fits:
                self.replanned = True
                self.replanned_because = "the first choice's step time missed its prediction by more than the noise"
                self._note(f"memory_budget: with that noise, {self._chosen_text(again)} ties with the chosen plan and keeps "
                           f"fewer bytes: choosing it instead")
                self._solve()
                return
            self.choice = again   # the same plan; its tie (if any) said with the widened noise
        self.phase = Phase.SETTLED
        self.active_shape = self.profile_shape
        self.plans[self.profile_shape] = (self.installed, self.measured_peak)
        if over and self.fits:
            self._warn_once("still_over", f"memory_budget: the plan chosen again still measures "
                                          f"{format_bytes(self.measured_peak)}, over the budget "
                                          f"{format_bytes(self.budget_bytes)}; it stays")
        block = "\n".join(self.describe())
        report_summary(block)
        self.events.append(block)

    def _widen_noise(self):
        """The chosen plan's measured step is a second timing of its options: if it missed the predicted step
        time by more than the timing noise, the profile's ``time_spread_s`` becomes that miss (plans predicted
        within it tie). Whether it did."""
        widened = widened_by_miss(self.profile, self.choice, self.measured_step_s)
        if widened is None:
            return False
        self.profile = widened
        self._note(f"memory_budget: the chosen plan's step measured {self.measured_step_s * 1000:.1f} ms against "
                   f"{self.choice.predicted_step_s * 1000:.1f} ms predicted: this machine moves a step by "
                   f"{widened.time_spread_s * 1000:.1f} ms, more than the timing noise taken so far; plans within "
                   f"that tie")
        return True

    def _take_measured(self, memory):
        """The chosen options' profile entries, replaced by what their step measured."""
        mem, transient = self.profile.mem.copy(), self.profile.transient.copy()
        for row, (i, k) in enumerate(zip(self.layer_ids, self.choice.choice)):
            lm = memory.layers[i]
            mem[row, k], transient[row, k] = lm.kept_bytes, lm.recomputed_bytes
        other = memory.layers[OTHER].kept_bytes + self._unplanned_bytes(memory)
        self.profile = dataclasses.replace(self.profile, mem=mem, transient=transient,
                                           other_bytes=max(self.profile.other_bytes, other))
        if self.agreement is not None:
            self.profile = agreed_profile(self.agreement, self.profile)[0]

    def _by_row(self, memory):
        """``memory`` with the planned layers keyed by their row (the profile's layer index: a pipeline stage's
        layers have the global ids of the whole model), the rest dropped but the bytes outside the layers."""
        layers = {row: memory.layers[i] for row, i in enumerate(self.layer_ids) if i in memory.layers}
        if OTHER in memory.layers:
            layers[OTHER] = memory.layers[OTHER]
        return StepMemory(layers)

    def _unplanned_bytes(self, memory):
        """What layers the budget does not plan keep (MTP layers): beside the decoder's, with the embedding
        and head."""
        return sum(lm.kept_bytes for i, lm in memory.layers.items() if i != OTHER and i not in self.layer_ids)

    def _settled_forward(self, shape):
        if shape in self.plans:   # profiled, or predicted before: its plan (again)
            self._install(self.plans[shape][0])
            self.active_shape = shape
            return
        origin = self.active_shape
        config, peak = self.plans[origin]
        predicted = int(peak * _elements(shape) / _elements(origin))
        shapes = [list(s) for s, _ in shape]
        if predicted <= self.budget_bytes:
            self.plans[shape], self.active_shape = (config, predicted), shape
            self._note(f"memory_budget: new input shapes {shapes}: predicted peak {format_bytes(predicted)} (the "
                       f"peak at {[list(s) for s, _ in origin]} scaled by the inputs' size) fits the "
                       f"budget {format_bytes(self.budget_bytes)}; the plan stays")
        elif self.agreement is not None and self.agreement.size > 1:
            # profiling again would need the ranks to agree here, but a rank that sees a known shape makes no
            # collective at this step: the plan stays
            self.plans[shape], self.active_shape = (config, predicted), shape
            self._warn_once("agreed", f"memory_budget: new input shapes {shapes} predict a peak of "
                                      f"{format_bytes(predicted)}, over the budget "
                                      f"{format_bytes(self.budget_bytes)}; the ranks of "
                                      f"{self.agreement.group} chose their plan together and profile only once: "
                                      f"it stays for this and any further new shape")
        elif self.profiles < MAX_PROFILES:
            self.profiles += 1
            self._note(f"memory_budget: new input shapes {shapes}: predicted peak {format_bytes(predicted)} is over "
                       f"the budget {format_bytes(self.budget_bytes)}; profiling again (profile {self.profiles} of "
                       f"at most {MAX_PROFILES})", logging.WARNING)
            self.phase, self.samples, self.sample_shapes, self.replanned = Phase.PROFILING, [], [], False
        else:
            self.plans[shape], self.active_shape = (config, predicted), shape
            self._warn_once("bound", f"memory_budget: new input shapes {shapes} predict a peak of "
                                     f"{format_bytes(predicted)}, over the budget {format_bytes(self.budget_bytes)}, "
                                     f"but {MAX_PROFILES} profiles were taken already: the current plan stays for "
                                     f"this and any further new shape")

    # -- plans -------------------------------------------------------------------------------------------

    def _option_config(self, option):
        applied = applied_layers(option, len(self.layer_ids), self.prefetch)
        return option_config({self.layer_ids[r]: option for r in applied}, self.base_config, self.prefetch) \
            if applied else None

    def _by_layer(self, plan):
        """``plan``'s options by layer id (the solver's are by row: a pipeline stage's layers have global ids)."""
        return {self.layer_ids[row]: option for row, option in plan.options.items()}

    def _chosen_text(self, plan):
        return summarize(self._by_layer(plan))

    def _install(self, config):
        if config is self.installed or config == self.installed:
            return
        state = self.state

        def make_plan():
            return plan_with_layers(self.model, config=config if config is not None else self.base_config,
                                    pp=state.plan.pp, mtp_block=state.mtp_block, layers=state.layers_arg,
                                    **state.stage_args)[0]
        self.installed = None   # if installing fails the model runs without a plan
        state.replace_plan(make_plan, self.model)
        self.installed = config
        logger.debug("memory_budget: installed %s", state.plan.summary())

    # -- report ------------------------------------------------------------------------------------------

    def _note(self, text, level=logging.INFO):
        self.events.append(text)
        logger.log(level, "%s", text)

    def _warn_once(self, key, text):
        if key not in self._warned:
            self._warned.add(key)
            self._note(text, logging.WARNING)

    def table(self):
        """Per layer and option: kept bytes and step-time cost measured; the chosen option marked ``*``."""
        p, chosen = self.profile, self.choice.choice if self.choice else ()
        header = ["layer"] + [o.name for o in p.options]
        rows, ids = [header], []
        for row, layer_id in enumerate(self.layer_ids):
            cells = []
            for k in range(len(p.options)):
                if math.isnan(p.mem[row, k]):
                    cells.append("-")
                    continue
                mark = "*" if len(chosen) > row and chosen[row] == k else ""
                cells.append(f"{mark}{p.mem[row, k] / MiB:.2f} MiB {max(0.0, p.time[row, k]) * 1000:+.1f} ms")
            if ids and rows[-1][1:] == cells:   # alike layers side by side: one row
                ids[-1].append(layer_id)
            else:
                ids.append([layer_id])
                rows.append([""] + cells)
        for r, layers in zip(rows[1:], ids):
            r[0] = ", ".join(str(spec) for spec in format_layer_specs(layers))
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                for r in rows]

    def baseline_line(self):
        """Where the budget's baseline came from: its step and input shapes, and the budget in bytes at them."""
        step, shape, kept, at_shape, scaled_to = self.baseline_from
        inputs = ", ".join(f"{list(s)} {d}" for s, d in shape)
        line = (f"baseline: training step {step} without AC, inputs {inputs}, kept {kept:,} B; the budget at "
                f"those inputs is {at_shape:,} B")
        if shape != scaled_to:
            line += f" ({self.budget_bytes:,} B scaled by element count to the first profile's largest inputs)"
        return line

    def describe(self):
        """The log block of the choice: the measured options, the plan, its peak and step-time cost."""
        if self.choice is None:
            return [f"memory_budget: profiling, step {len(self.samples) + 1} of {len(self.schedule)}"]
        p, c = self.profile, self.choice
        baseline = p.baseline_peak
        lines = [f"memory_budget: profiled on {p.description}; kept bytes and step-time cost per layer "
                 f"(* chosen):"] + ["  " + line for line in self.table()]
        lines.append(f"  budget {format_bytes(self.budget_bytes)} ({self.budget_bytes / baseline:.2f}x the "
                     f"{format_bytes(baseline)} kept without AC); chosen: {self._chosen_text(c)}")
        lines.append("  " + self.baseline_line())
        verdict = "" if self.measured_peak is None else (
            f"; measured {format_bytes(self.measured_peak)}, "
            f"{'within' if self.measured_peak <= self.budget_bytes else 'over'} the budget")
        lines.append(f"  peak: predicted {format_bytes(c.backward_peak)} (kept {format_bytes(c.predicted_peak)} + "
                     f"largest rebuild {format_bytes(c.transient_bytes)} + prefetched "
                     f"{format_bytes(c.prefetch_bytes)}){verdict}")
        measured = "" if self.measured_step_s is None else \
            f", measured {self.measured_step_s * 1000:.1f} ms ({self.measured_step_s / p.baseline_step_s:.2f}x)"
        lines.append(f"  step time: {p.baseline_step_s * 1000:.1f} ms without AC, predicted "
                     f"{c.predicted_step_s * 1000:.1f} ms ({c.predicted_step_s / p.baseline_step_s:.2f}x){measured}")
        if c.tie:
            lines.append(f"  a tie: {c.tie}")
        if self.replanned:
            lines.append("  chosen a second time, with the first choice's measured figures")
        if self.own_figures is not None:
            own_s, own_kept = self.own_figures
            lines.append(f"  chosen together by the {self.agreement.size} ranks of {self.agreement.group} (this is "
                         f"rank {self.agreement.rank}), from the worst rank's figures: this rank measured "
                         f"{own_s * 1000:.1f} ms without AC and kept {format_bytes(own_kept)}, the group's worst "
                         f"{p.baseline_step_s * 1000:.1f} ms and {format_bytes(baseline)}")
        if not self.fits:
            lines.append("  the budget is below the least reachable peak: the plan with the least peak is installed")
        return lines

    def as_record(self):
        """Every figure, as plain data (``train``'s report)."""
        c = self.choice
        return {"activations": str(self.settings.activations), "budget_bytes": self.budget_bytes,
                "phase": self.phase.value, "profiles": self.profiles, "first_step": self.chosen_at,
                "chosen": self._chosen_text(c) if c else None,
                "predicted_peak_bytes": c.backward_peak if c else None, "tie": c.tie if c else None,
                "predicted_kept_bytes": c.predicted_peak if c else None,
                "measured_peak_bytes": self.measured_peak, "fits": self.fits, "replanned": self.replanned,
                "replanned_because": self.replanned_because,
                "predicted_step_s": c.predicted_step_s if c else None,
                "baseline_step_s": self.profile.baseline_step_s if self.profile else None,
                "describe": self.describe(), "events": list(self.events), "agreement": self._agreement_record(),
                "config": self.state.plan.to_yaml() if c else None}

    def agree_within(self, group):
        """Choose together with the ranks of communication group ``group`` (None: alone); before profiling ends.
        The default is the world group when MindSpore's communication is initialised, none on a pipeline stage:
        a trainer that runs data-parallel replicas of a pipeline gives each stage's controller
        (``ac_state(stage).budget``) the group of its ranks across the replicas."""
        if self.choice is not None:
            raise RuntimeError("memory_budget: the plan is chosen already; set the group before the first steps")
        self.agreement = Agreement(group) if group is not None else None

    def _agreement_record(self):
        if self.agreement is None:
            return None
        own_s, own_kept = self.own_figures or (None, None)
        costs = {o.name: float(np.nansum(self.profile.time[:, k])) for k, o in enumerate(self.profile.options)} \
            if self.profile else None
        return {"group": self.agreement.group, "ranks": self.agreement.size, "rank": self.agreement.rank,
                "own_baseline_step_s": own_s, "own_baseline_kept_bytes": own_kept, "step_cost_s": costs}

    def summary(self):
        """One line: the phase, the budget, the plan and its measured peak."""
        if self.choice is None:
            return f"memory_budget {self.settings.activations}: {self.describe()[0].split(': ', 1)[1]}"
        measured = f", measured peak {format_bytes(self.measured_peak)}" if self.measured_peak is not None else ""
        return (f"memory_budget {self.settings.activations} ({format_bytes(self.budget_bytes)}): "
                f"{self._chosen_text(self.choice)}{measured}")


def install_budget(state, model, stack):
    """Install the controller of ``state.config.memory_budget`` on ``model`` (``apply_ac`` calls this)."""
    controller = BudgetController(state, model, stack)
    controller.install()
    state.add_undo(controller.uninstall)
    state.budget = controller
    return controller

