"""Failed steps, caught by the training loop, in every AC mode: prints one JSON line.

    python failed_step_worker.py '[[[KIND, ...], [MODE, ...], [PLAIN, ...]], ...]'

Run by ``test_failed_steps.py`` in a fresh interpreter (an exception inside
MindSpore's grad leaves its executor in a state that lasts for the process:
its grad flag stays set). Each mode's model with AC trains once through every
kind of failure: step 0 trains, then steps 1, 2, ... each fail first, one
kind after the other, are caught and not applied (no ``clear_res()``: a loop
that skips a bad batch does not know it), and then train (``schedule``). The
model without AC trains the same schedule once per process (a mode's name in
``PLAIN`` stands for its schedule), after the first AC model, and the test
compares every AC run with it, from this process or another: the histories
(digests of the loss, every gradient and every parameter, per step: the step
after each kind of failure must train as without AC) must be equal, after
each failure the library must have left no engine run, saved-tensor hook,
dispatch mode or swap group behind, and the mode must have acted. Each
mode's AC is removed after its run, so the next model starts with nothing of
it; the first AC model of a process meets a process where nothing has failed
yet, the others one where earlier steps failed (as a user's later models
would). One run per mode, not one per kind and mode, keeps the module within
the time of its six modes before (a model's first steps cost the most).

The kinds (issue 38, point 1, found by porting HyperParallel's and PyTorch's
checkpoint tests, whose loops go on after a failed step):

* ``before_op``: the model's construct raises before any op;
* ``after_op``: layer 1 raises after its attention (inside a region);
* ``bad_keyword``: layer 1 is called with a keyword its construct lacks
  (a TypeError inside the region's call, after layer 0 ran);
* ``plain_grad``: a plain ``ms.grad`` of a function with no AC raises;
* ``in_backward``: a tensor hook on layer 1's output raises in backward,
  after layer 2's re-run.

The modes (``MODES``): every mode of ``model_patterns.mode_config`` (full,
layer groups, select of a cell, select of an op, ``exclude_op``,
``recompute_comm``, layer swap, op swap, ``mixed``), the APIs (``checkpoint``
and ``swap`` around each layer call, ``checkpoint_wrapper`` and
``swap_wrapper`` on each layer, MindSpeed's ``async_save_on_cpu``) and
``budget`` (a ``memory_budget`` profiling 3 steps), whose first failures hit
it while it profiles (the meter's hooks are on), the third while it checks
its chosen plan, the others once the plan is settled (a bad batch in a long
run). It must end with a settled plan that acted on the last step.

Where a mode runs in its process once mattered (``test_failed_steps.py``
still places them so): a budget installs its plans inside a training forward,
and MindSpore's grad-call counters (``EXECUTOR_CALLS``) once had to tell a
failed grad call's flag from a running grad of a grad. Re-runs are keyed by
the autodiff engine now, and the counters are wrapped only while a region's
intercepting run runs; the budget still runs in a process where no
``checkpoint()`` ran, and the ``checkpoint`` API first in its own, so that
either would show a state left behind.
"""
import hashlib
import json
import sys
import time

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

import mindformers_ac as mac
from mindformers_ac.budget.controller import Phase
from mindformers_ac.mindspore_compat import (
    EXECUTOR_CALLS,
    dispatch_mode_depth,
    pynative_executor,
    synchronous_pynative,
)
from mindformers_ac.recompute.state import ENGINE

from model_patterns import (
    N_LAYERS,
    PATTERNS,
    FailingLayer,
    H,
    InjectedFailure,
    PatternModel,
    hidden_batch,
    init_weights,
    mode_config,
)
from steps import _record, ac_counters, ac_work, assert_acted, install_api, offloaded

KINDS = ("before_op", "after_op", "bad_keyword", "plain_grad", "in_backward")
CONFIG_MODES = ("full", "group", "select_cell", "select_op", "exclude_op", "recompute_comm", "layer_swap",
                "op_swap", "mixed")
API_MODES = ("checkpoint_api", "checkpoint_wrapper", "swap_api", "swap_wrapper", "async_save_on_cpu")
BUDGET_MODES = ("budget",)
# the budget modes first, ``checkpoint_api`` last: it holds the grad-call counters for the process
MODES = BUDGET_MODES + CONFIG_MODES + tuple(sorted(API_MODES, key=lambda mode: mode == "checkpoint_api"))
# the budget profiles 3 steps (warm-up, baseline, full recompute), checks its plan on one step, and ends with
# a step under its settled plan
BUDGET_STEPS = 6
BUDGET = {"memory_budget": {"activations": "0.5x", "profile_steps": 3}}


class RMSNorm(nn.Cell):
    """In place of ``nn.LayerNorm``: after a grad call that raised, MindSpore 2.10's next backward through a
    LayerNorm fails without AC too ("For LayerNormGrad, the index 7 is out of range"), so there would be
    no model without AC to compare with."""

    def __init__(self):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(H, np.float32)), name="weight")

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * self.weight


class StepLayer(FailingLayer):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(), RMSNorm()


class StepModel(PatternModel):
    """``PatternModel`` of ``FailingLayer``s (with RMSNorm) whose construct fails as ``failure`` says."""

    def __init__(self):
        super().__init__([StepLayer() for _ in range(N_LAYERS)])
        self.failure = None

    def construct(self, x, y, pos, mask):
        if self.failure == "before_op":
            raise InjectedFailure("before any op")
        for i, layer in enumerate(self.layers):
            extra = {"bogus": 1} if self.failure == "bad_keyword" and i == 1 else {}
            x = self.run_layer(layer, x, pos, mask, self.scale, **extra)
            if self.failure == "in_backward" and i == 1:
                x.register_hook(_raise_in_backward)   # on the output itself: a group's next member chains it
        return self.loss(x, y)


def _raise_in_backward(grad):
    raise InjectedFailure("in backward")


def build():
    return init_weights(StepModel())


def fail_once(model, grad_fn, inputs, kind):
    """Run the failing step ``kind``; returns the exception's type name (it must raise)."""
    if kind == "plain_grad":
        def plain(v):
            y = ops.sin(v).sum()
            raise InjectedFailure(f"after an op, no AC ({y.shape})")
        fn, args = ms.grad(plain), (inputs[0],)
    else:
        fn, args = grad_fn, inputs
        if kind == "after_op":
            model.layers[1].fail = True
        else:
            model.failure = kind
    try:
        fn(*args)
    except (InjectedFailure, TypeError, RuntimeError) as exc:
        return type(exc).__name__
    finally:
        model.failure = None
        model.layers[1].fail = False
    raise AssertionError(f"the {kind} step did not raise")


def library_state():
    """What the library could have left behind (all falsy when nothing is)."""
    return {"engine_run": ENGINE.top() is not None, "in_recompute": ENGINE.in_recompute(),
            "saved_tensor_hook": bool(pynative_executor.is_saved_tensor_hook_active()),
            "dispatch_modes": dispatch_mode_depth(),
            "swap_group": mac.SwapManager().scheduler.current_group() is not None,
            # the counters a region's intercepting run wraps MindSpore's entry points with: removed with the run
            "entry_points_wrapped": EXECUTOR_CALLS.installed(),
            "grad_calls": EXECUTOR_CALLS.grad_calls()}


def _digests(record):
    loss, grads, params = record
    digest = lambda data: hashlib.sha1(data).hexdigest()   # noqa: E731
    return ([("loss", digest(loss))] + [(f"gradient {i}", digest(g)) for i, g in enumerate(grads)]
            + [(name, digest(p)) for name, p in params])


def schedule(kinds, mode):
    """``(steps, {step: kind})``: step 0 trains, the next ones fail first, one kind each, and train; a budget
    trains on until a step under its settled plan."""
    failures = {1 + i: kind for i, kind in enumerate(kinds)}
    steps = len(kinds) + 1
    return (max(steps + 1, BUDGET_STEPS) if mode in BUDGET_MODES else steps), failures


def train(model, steps, failures, work=None):
    """The history of ``steps`` steps (per step, digests of the loss, every gradient, every parameter), each
    step of ``failures`` failing once first (its kind) and then trained; per kind, the failure's type name
    and what the library left right after it. ``work``: called after every step (its results in a list, the
    fourth value)."""
    model.set_train(True)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history, raised, left, done = [], {}, {}, []
    for step in range(steps):
        if step in failures:
            kind = failures[step]
            raised[kind] = fail_once(model, grad_fn, hidden_batch(step), kind)
            left[kind] = {k: v for k, v in library_state().items() if v}
        loss, grads = grad_fn(*hidden_batch(step))
        opt(grads)
        history.append(_digests(_record(model, loss, grads)))
        if work is not None:
            done.append(work())
    return history, raised, left, done


def _swapped_total():
    """Tensors the process-wide ``SwapManager`` offloaded (where the swap API modes report)."""
    return offloaded(mac.SwapManager().report)


def with_ac(mode):
    """A fresh model under ``mode``; returns it and a function giving (ops re-run, tensors offloaded) so far
    (for a budget mode, by its current plan, and the plan's counters)."""
    model = build()
    layers = list(model.layers)
    swapped_before = _swapped_total()
    stats = mac.RecomputeStats()
    if mode in ("checkpoint_api", "swap_api"):
        counter = install_api(mode, model)
        stats = counter if mode == "checkpoint_api" else stats
    elif mode == "checkpoint_wrapper":
        for layer in layers:
            mac.checkpoint_wrapper(layer, stats=stats)
    elif mode == "swap_wrapper":
        for layer in layers:
            mac.swap_wrapper(layer)
    elif mode == "async_save_on_cpu":
        def run_layer(layer, *args, **kwargs):
            with mac.async_save_on_cpu(block_idx=layers.index(layer), depth=len(layers), params=model):
                return layer(*args, **kwargs)
        object.__setattr__(model, "run_layer", run_layer)
    elif mode in BUDGET_MODES:
        mac.apply_ac(model, config=mac.AcConfig.from_dict(BUDGET))
    else:
        mac.apply_ac(model, config=mac.AcConfig.from_dict(mode_config(mode, PATTERNS["failed_forward"])))
    if mode in API_MODES:
        return model, lambda: (stats.ops_rerun, _swapped_total() - swapped_before)
    if mode in BUDGET_MODES:
        return model, lambda: (*ac_work(model), mac.ac_state(model).recompute_stats)
    return model, lambda: ac_work(model)


def acted(mode, model, work_done):
    """None if ``mode`` did its work, else what it did not do."""
    if mode in API_MODES:
        rerun, swapped = work_done[-1]
        if (rerun if mode.startswith("checkpoint") else swapped) > 0:
            return None
        return f"re-ran {rerun} ops, offloaded {swapped} tensors"
    if mode in BUDGET_MODES:
        controller = mac.ac_state(model).budget
        (rerun_before, swapped_before, plan_before), (rerun, swapped, plan) = work_done[-2], work_done[-1]
        if controller.phase != Phase.SETTLED or controller.installed is None or plan is not plan_before:
            return f"no plan settled before the last step (phase {controller.phase.value})"
        # (the counters of a settled plan: measured steps reset them when they start)
        if rerun - rerun_before + swapped - swapped_before <= 0:
            return f"the plan did nothing on the last step ({controller.summary()})"
        return None
    try:
        assert_acted(mode, model, None, ac_counters(model))
    except AssertionError as exc:
        return str(exc) or "did nothing"
    return None


def run_mode(kinds, mode):
    """One model under ``mode`` through its schedule with the failing steps ``kinds``."""
    started = time.perf_counter()
    model, work = with_ac(mode)
    try:
        history, raised, left, work_done = train(model, *schedule(kinds, mode), work)
    except Exception as exc:  # pylint: disable=broad-exception-caught  # the test shows it, per mode
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    outcome = {"history": history, "raised": raised, "left_behind": left, "not_acted": acted(mode, model, work_done)}
    # nothing of this mode for the next: its wrappers off, AC removed, the process-wide manager empty
    for layer in model.layers if mode.endswith("wrapper") else ():
        (mac.unwrap if mode == "checkpoint_wrapper" else mac.remove_swap_wrapper)(layer)
    if mac.ac_state(model) is not None:
        mac.remove_ac(model)
    mac.SwapManager().reset()
    return {**outcome, "seconds": round(time.perf_counter() - started, 1)}


def train_plain(kinds, plains):
    """``{"plain:" + mode: {"history", "raised"}}`` of the model without AC under each mode's schedule."""
    runs = {}
    for mode in plains:
        history, raised, _, _ = train(build(), *schedule(kinds, mode))
        runs[f"plain:{mode}"] = {"history": history, "raised": raised}
    return runs


def main(jobs):
    """``jobs``: JSON ``[[kinds, [mode, ...], [plain, ...]], ...]``, run in this order. Prints one list of
    ``{mode or "plain:" + mode: outcome}`` per job (a plain run under that mode's schedule)."""
    result = []
    for kinds, modes, plains in json.loads(jobs):
        runs = {}
        for position, mode in enumerate(modes):
            runs[mode] = run_mode(kinds, mode)
            if position == 0:   # the model without AC after the first AC model of the process
                runs.update(train_plain(kinds, plains))
        if not modes:
            runs.update(train_plain(kinds, plains))
        result.append(runs)
    print(json.dumps(result))


if __name__ == "__main__":
    synchronous_pynative("CPU")
    main(sys.argv[1])
