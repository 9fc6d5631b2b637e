"""``memory_budget`` on data as users have it: a new sequence length every step, failures in the middle of
profiling, models built and dropped one after another, and timings within noise of each other.

* a new length every step: the plan is chosen within ``profile_steps + 3`` steps (each profiling step is
  scaled by element count to the largest shapes the profile saw), bitwise, and the last step's real peak
  is within the budget;
* a failure at each point of a profiling step (before the forward, in the middle of it, in backward,
  between the forward and its backward) leaves no meter hook and no executor patch: a second model then
  trains with nothing of the first one's meter seeing its tensors;
* after ``remove_ac`` or once the model is gone, nothing of its budget or swap engine is alive;
* two plans whose predicted times are within the noise: the one with fewer bytes, said in the log, and the
  same one whatever the noise.
"""
import gc
import logging
import weakref

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

import mindformers_ac as mac
from mindformers_ac.accounting import measure_step
from mindformers_ac.budget.controller import Phase, measured_peak
from mindformers_ac.budget.solver import TIME_NOISE, Option, OptionKind, Profile, plan_within
from mindformers_ac.meter import SEEN_THROUGH, SavedTensorMeter
from mindformers_ac.mindspore_compat import pynative_executor

from isolated import run_isolated
from model_patterns import PATTERNS, B, H, InjectedFailure
from steps import _record, first_difference, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")

PROFILE_STEPS = 4
# a new sequence length every step (the pattern's positions go up to 16); the longest comes while profiling
LENGTHS = [12, 9, 16, 7, 11, 14, 6, 10, 13, 5, 15, 8]


def budget(activations="0.5x", profile_steps=PROFILE_STEPS, **extra):
    return {"memory_budget": {"activations": activations, "profile_steps": profile_steps, **extra}}


def length_batch(step):
    """(x, y, pos, mask) of length ``LENGTHS[step]``: causal mask, int32 positions."""
    s = LENGTHS[step % len(LENGTHS)]
    rng = np.random.RandomState(500 + step)
    mask = np.broadcast_to(np.triu(np.ones((s, s), bool), 1), (B, s, s)).copy()
    pos = Tensor(np.tile(np.arange(s, dtype=np.int32), (B, 1)))
    return (Tensor(rng.randn(B, s, H).astype(np.float32)), Tensor(rng.randn(B, s).astype(np.float32)), pos,
            Tensor(mask))


def _steps_measuring_the_last(model, steps):
    """``run_steps``'s records, the last step measured by an independent meter: (history, its StepMemory)."""
    model.set_train(True)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history, memory = [], None
    for step in range(steps):
        if step == steps - 1:
            out = []
            memory = measure_step(model, lambda inputs: out.append(grad_fn(*inputs)), length_batch(step))
            loss, grads = out[0]
        else:
            loss, grads = grad_fn(*length_batch(step))
        opt(grads)
        history.append(_record(model, loss, grads))
    return history, memory


def test_a_new_length_every_step_chooses_within_profile_steps_plus_3_bitwise_and_within_the_budget(caplog):
    pattern = PATTERNS["changing_lengths"]
    base, _ = _steps_measuring_the_last(pattern.build(), len(LENGTHS))
    model = pattern.build()
    mac.apply_ac(model, config=budget())
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        auto, memory = _steps_measuring_the_last(model, len(LENGTHS))
    assert first_difference(base, auto) is None
    controller = mac.ac_state(model).budget
    # every profiling step counted although no two had the same shapes: chosen right after them
    assert controller.phase == Phase.SETTLED and controller.profiles == 1
    assert controller.chosen_at is not None and controller.chosen_at <= PROFILE_STEPS + 3
    assert len({s for s in controller.sample_shapes}) == PROFILE_STEPS
    assert controller.profile_shape[0][0] == (B, 16, H)   # the largest the profile saw
    said = [e for e in controller.events if "the 3 profiling steps after the warm-up had 3 input shapes" in e]
    assert len(said) == 1 and "scaled by element count to the largest" in said[0]
    assert any("the largest of 3 input shapes" in r.getMessage() for r in caplog.records)
    # the last step (length 8) measured by a meter of its own: within the budget
    assert measured_peak(memory, range(3), 1) <= controller.budget_bytes
    assert mac.ac_state(model).plan.active_layers()


# -- failures while profiling -------------------------------------------------------------------------

def _packs_seen_by_meters(monkeypatch):
    """A list that grows by one for every tensor any step meter packs from here on."""
    seen = []
    original = SavedTensorMeter.pack

    def pack(self, t):
        seen.append(type(self).__name__)
        return original(self, t)
    setattr(pack, SEEN_THROUGH, True)   # the meter's own pack, as the original is marked
    monkeypatch.setattr(SavedTensorMeter, "pack", pack)
    return seen


def _assert_nothing_left(model, seen):
    controller = mac.ac_state(model).budget
    step = controller._open   # pylint: disable=protected-access  # a step awaiting its backward, at most
    assert step is None or not step.memory_step.in_forward   # the step's meter is out
    assert "push_saved_tensor_hook" not in vars(pynative_executor)   # the meter's chain is unpatched
    for _, cell in model.cells_and_names():
        # what stays is AC's own: a construct patch's copy guard (installed with the plan, not by the meter)
        pre = [fn for fn in cell._forward_pre_hook.values()   # pylint: disable=protected-access
               if not fn.__qualname__.startswith("ConstructPatch.")]
        assert not pre and not cell._forward_hook   # pylint: disable=protected-access
    seen.clear()
    other = PATTERNS["int_bool_inputs"]
    alone = run_steps(other.build(), other.batch, steps=2)
    assert seen == []   # no meter of the first model sees the second one's tensors
    assert first_difference(run_steps(other.build(), other.batch, steps=2), alone) is None


def _profiling_model():
    pattern = PATTERNS["failed_forward"]
    model = pattern.build()
    mac.apply_ac(model, config=budget())
    run_steps(model, pattern.batch, steps=2)   # warm-up and baseline: full recompute is profiled next
    return model, pattern


def test_a_failure_before_the_forward_leaves_no_meter(monkeypatch):
    model, pattern = _profiling_model()
    seen = _packs_seen_by_meters(monkeypatch)

    def refuse():
        raise RuntimeError("injected: the parameters can't be listed")
    monkeypatch.setattr(model, "trainable_params", refuse)   # the controller's bookkeeping, after the meter began
    grad_fn = ms.value_and_grad(model, None, [p for p in model.get_parameters() if p.requires_grad])
    with pytest.raises(RuntimeError, match="injected"):
        grad_fn(*pattern.batch(2))
    pynative_executor.clear_res()
    monkeypatch.undo()
    seen = _packs_seen_by_meters(monkeypatch)
    _assert_nothing_left(model, seen)


@pytest.mark.parametrize("failure", [InjectedFailure, KeyboardInterrupt])
def test_a_failure_in_the_middle_of_the_forward_leaves_no_meter(monkeypatch, failure):
    model, pattern = _profiling_model()
    seen = _packs_seen_by_meters(monkeypatch)

    metering = []

    def raise_it(_cell, _args):
        metering.append("push_saved_tensor_hook" in vars(pynative_executor))
        raise failure("injected failure in layer 1")
    handle = model.layers[1].register_forward_pre_hook(raise_it)
    grad_fn = ms.value_and_grad(model, None, [p for p in model.get_parameters() if p.requires_grad])
    with pytest.raises(failure):
        grad_fn(*pattern.batch(2))
    handle.remove()
    pynative_executor.clear_res()
    assert metering == [True]   # the meter was measuring when layer 1 raised
    _assert_nothing_left(model, seen)
    # the failed step is no sample; training goes on to a choice
    run_steps(model, pattern.batch, steps=PROFILE_STEPS)
    controller = mac.ac_state(model).budget
    assert controller.phase != Phase.PROFILING
    assert [s.option.name for s in controller.samples] == [o.name for o in controller.schedule]


def test_a_failure_between_the_forward_and_its_backward_leaves_no_meter(monkeypatch):
    model, pattern = _profiling_model()
    seen = _packs_seen_by_meters(monkeypatch)
    params = [p for p in model.get_parameters() if p.requires_grad]
    x, y, pos, mask = pattern.batch(2)
    with pytest.raises(InjectedFailure):
        loss, _vjp = ms.vjp(lambda t: model(t, y, pos, mask), x, weights=params)
        raise InjectedFailure("the trainer fails before the backward")   # the step's output is dropped
    del loss, _vjp
    pynative_executor.clear_res()
    _assert_nothing_left(model, seen)
    before = len(mac.ac_state(model).budget.samples)
    run_steps(model, pattern.batch, steps=1)
    assert len(mac.ac_state(model).budget.samples) == before   # the step without a backward is no sample


def test_a_failure_in_backward_leaves_no_meter():
    """In a subprocess: an exception inside MindSpore's grad can break the executor of the process."""
    result = run_isolated("""
        import mindspore as ms
        import mindformers_ac as mac
        from mindformers_ac.meter import SEEN_THROUGH, SavedTensorMeter
        from mindformers_ac.mindspore_compat import pynative_executor
        from model_patterns import PATTERNS
        from steps import run_steps

        seen = []
        original = SavedTensorMeter.pack
        def pack(self, t):
            seen.append(1)
            return original(self, t)
        pack.__dict__.update(original.__dict__)
        SavedTensorMeter.pack = pack

        pattern = PATTERNS["failed_forward"]
        model = pattern.build()
        mac.apply_ac(model, config={"memory_budget": {"activations": "0.5x", "profile_steps": 4}})
        run_steps(model, pattern.batch, steps=2)
        def fail_in_backward(cell, grad_in, grad_out):
            raise RuntimeError("injected failure in backward")
        handle = model.layers[1].register_backward_hook(fail_in_backward)
        grad_fn = ms.value_and_grad(model, None, [p for p in model.get_parameters() if p.requires_grad])
        try:
            grad_fn(*pattern.batch(2))
        except RuntimeError as exc:
            assert "injected failure in backward" in str(exc), exc
        else:
            raise AssertionError("the backward did not raise")
        handle.remove()
        pynative_executor.clear_res()
        assert "push_saved_tensor_hook" not in vars(pynative_executor)
        # what stays is AC's own: a construct patch's copy guard (installed with the plan, not by the meter)
        assert all(not c._forward_hook and all(f.__qualname__.startswith("ConstructPatch.")
                                               for f in c._forward_pre_hook.values())
                   for _, c in model.cells_and_names())
        seen.clear()
        other = PATTERNS["int_bool_inputs"]
        run_steps(other.build(), other.batch, steps=2)
        assert seen == [], len(seen)
        controller = mac.ac_state(model).budget
        print("OK", len(controller.samples), controller.phase.value)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK 2 profiling" in result.stdout   # the step that failed in backward is no sample


# -- lifetimes -----------------------------------------------------------------------------------------

def _trained_with_budget():
    pattern = PATTERNS["int_bool_inputs"]
    model = pattern.build()
    mac.apply_ac(model, config=budget(profile_steps=4))
    run_steps(model, pattern.batch, steps=4)   # none, none, full, layer swap: the swap engine exists
    state = mac.ac_state(model)
    refs = {"budget": weakref.ref(state.budget), "meter": weakref.ref(state.budget.meter),
            "state": weakref.ref(state)}
    assert state.swap_executor is not None
    refs.update(swap_executor=weakref.ref(state.swap_executor), swap_engine=weakref.ref(state.swap_engine))
    return model, refs


def test_nothing_of_the_budget_or_swap_outlives_remove_ac_or_the_model():
    model, refs = _trained_with_budget()
    mac.remove_ac(model)
    gc.collect()
    assert {name: ref() is None for name, ref in refs.items()} == {name: True for name in refs}
    assert mac.SwapManager()._links == {} or all(   # pylint: disable=protected-access
        ref() is None for ref in refs.values())

    model, refs = _trained_with_budget()
    refs["model"] = weakref.ref(model)
    del model
    gc.collect()
    assert {name: ref() is None for name, ref in refs.items()} == {name: True for name in refs}


# -- timing ties ---------------------------------------------------------------------------------------

def _two_option_profile(full_cost_s, select_cost_s, layers=4):
    options = [Option("none", OptionKind.NONE), Option("select mlp", OptionKind.SELECT, select=("mlp",)),
               Option("full", OptionKind.FULL)]
    mem = np.tile([100.0, 60.0, 10.0], (layers, 1))
    time = np.tile([0.0, select_cost_s, full_cost_s], (layers, 1))
    transient = np.tile([0.0, 40.0, 90.0], (layers, 1))
    return Profile(options=options, mem=mem, time=time, transient=transient, other_bytes=0,
                   baseline_step_s=0.100)


def test_plans_within_the_timing_noise_are_chosen_by_bytes_and_do_not_flip():
    budget_bytes = 290   # select on every layer (60 * 4 + 40) fits, so does full (10 * 4 + 90); none nowhere
    rng = np.random.RandomState(0)
    picks = set()
    for _ in range(20):   # select slightly cheaper or slightly dearer than full, by less than the noise
        jitter = rng.uniform(-0.2, 0.2) * TIME_NOISE * 0.100 / 4
        plan, fits = plan_within(_two_option_profile(0.002, 0.002 + jitter), budget_bytes)
        assert fits
        picks.add(plan.summary())
    assert picks == {"0-3: full"}
    plan, _ = plan_within(_two_option_profile(0.002, 0.0019), budget_bytes)
    assert plan.tie is not None and "chosen by bytes" in plan.tie and "within the timing noise" in plan.tie
    # a difference beyond the noise is a real one: the faster plan
    plan, _ = plan_within(_two_option_profile(0.010, 0.001), budget_bytes)
    assert plan.summary() == "0-3: select mlp" and plan.tie is None


def test_train_summary_says_the_tie():
    from mindformers_ac.harness.report import budget_lines
    record = {"activations": "0.4x", "budget_bytes": 3 << 20, "chosen": "0-3: full", "first_step": 8,
              "predicted_peak_bytes": 2 << 20, "measured_peak_bytes": 2 << 20, "fits": True, "replanned": False,
              "tie": "0-3: select mlp was predicted 1.0 ms faster, within the timing noise ...: chosen by bytes"}
    lines = budget_lines(record)
    assert lines[1] == f"  a tie: {record['tie']}" and lines[-1].startswith("  real peak")
    assert not any("a tie" in line for line in budget_lines({**record, "tie": None}))
