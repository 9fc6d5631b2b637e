"""``memory_budget``: the plan chosen on the user's own first training steps, bitwise equal to training
without AC in every step (the profiling steps included), within its budget after the switch.

Each loop a trainer writes is here: ``nn.TrainOneStepCell``, ``ms.value_and_grad``, ``ms.vjp``; on the
reference GPT (with ``nn.Dropout``), the LLaMA and MoE patterns of the catalogue, BatchNorm with dropout
under amp O2; eval forwards in between, new input shapes, a budget nothing fits, ``remove_ac`` and a copy
of the model in the middle of profiling.
"""
import copy
import logging

import mindformers_standin as mf
import mindspore as ms
import numpy as np
import pytest
from mindformers_models import VOCAB, build_mindformers_moe
from mindspore import nn

import mindformers_ac as mac
from mindformers_ac.accounting import measure_step
from mindformers_ac.budget.controller import MAX_PROFILES, Phase, measured_peak, profile_schedule
from mindformers_ac.budget.options import candidate_options
from mindformers_ac.budget.solver import OptionKind
from mindformers_ac.harness.models import SyntheticBatches, build_gpt, use_nn_dropout

from model_patterns import PATTERNS, token_batch, varlen_batch
from steps import first_difference, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")


def budget(activations="0.5x", profile_steps=5, **extra):
    return {"memory_budget": {"activations": activations, "profile_steps": profile_steps, **extra}}


def _gpt(nn_dropout=False):
    """A small reference GPT; its dropout is replayed from a seed per step, or MindSpore's ``nn.Dropout``,
    whose CPU kernel draws alike in two builds for 5 calls only (``use_nn_dropout``): 5 steps at most."""
    model = build_gpt(num_layers=4, hidden_size=64, seq_length=32)
    return use_nn_dropout(model) if nn_dropout else model


GPT_BATCH = SyntheticBatches(2, 32, 256)


def _train_one_step_cell(model, config, steps, measure_last=False):
    """Per step: loss bytes and every parameter (model and optimizer state) after it, through TrainOneStepCell."""
    if config is not None:
        mac.apply_ac(model, config=config)
    opt = nn.Momentum(model.trainable_params(), learning_rate=0.05, momentum=0.9)
    train = nn.TrainOneStepCell(model, opt)
    train.set_train(True)
    history, memory = [], None
    for k in range(steps):
        if measure_last and k == steps - 1:
            memory = measure_step(model, lambda: history.append(train(*GPT_BATCH(k))))
            loss = history.pop()
        else:
            loss = train(*GPT_BATCH(k))
        history.append((loss.asnumpy().tobytes(),
                        [(n, p.asnumpy().tobytes()) for n, p in train.parameters_and_names()]))
    return history, memory


def test_train_one_step_cell_ten_steps_bitwise_and_within_budget(caplog):
    base, _ = _train_one_step_cell(_gpt(), None, 10)
    model = _gpt()
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        auto, memory = _train_one_step_cell(model, budget(), 10, measure_last=True)
    assert base == auto   # loss, every parameter and the optimizer's moments, every step
    state = mac.ac_state(model)
    controller = state.budget
    # chosen after 5 profiling steps; once more on the next if the choice measured over the budget (the
    # bytes a recompute drops are counted by storage address, which the allocator may reuse: a lower bound)
    assert controller.phase == Phase.SETTLED and controller.chosen_at == 5 + controller.replanned
    assert controller.fits
    assert [s.option.kind for s in controller.samples] == [OptionKind.NONE, OptionKind.NONE, OptionKind.FULL,
                                                           OptionKind.SWAP, OptionKind.SELECT]
    # an independent meter, on the last step: the real peak of the chosen plan is within the budget
    assert measured_peak(memory, range(4), 1) <= controller.budget_bytes
    assert controller.measured_peak <= controller.budget_bytes
    assert state.plan.active_layers() and state.plan.to_config().memory_budget.enabled is False
    block = [r.getMessage() for r in caplog.records if "kept bytes and step-time cost per layer" in r.getMessage()]
    assert len(block) == 1 and "chosen:" in block[0] and "measured" in block[0] and "step time:" in block[0]
    # the pinned YAML reproduces the plan without profiling
    pinned = mac.plan_ac(_gpt(), config=state.plan.to_config())
    assert pinned.summary() == state.plan.summary()


def test_nn_dropout_through_profiling_and_the_switch_bitwise():
    def steps(model):
        return run_steps(model, GPT_BATCH, steps=5)
    base = steps(_gpt(nn_dropout=True))
    model = _gpt(nn_dropout=True)
    mac.apply_ac(model, config=budget("0.3x", profile_steps=3))   # none, none, full: full is chosen at step 3
    assert first_difference(base, steps(model)) is None
    assert mac.ac_state(model).budget.chosen_at == 3 + mac.ac_state(model).budget.replanned


@pytest.mark.parametrize("name", ["llama", "moe", "failed_forward"])
def test_value_and_grad_on_catalogue_models_bitwise(name):
    pattern = PATTERNS[name]
    fail_at = 2 if name == "failed_forward" else None   # a forward that raises in the middle of profiling
    base = run_steps(pattern.build(), pattern.batch, steps=6, fail_at=fail_at)
    model = pattern.build()
    mac.apply_ac(model, config=budget(profile_steps=4), layers=pattern.layers)
    auto = run_steps(model, pattern.batch, steps=6, fail_at=fail_at)
    assert first_difference(base, auto) is None
    controller = mac.ac_state(model).budget
    assert controller.phase == Phase.SETTLED and controller.measured_peak <= controller.budget_bytes
    # the failed forward is no sample: the profile has one step per option all the same
    assert [s.option.name for s in controller.samples] == [o.name for o in controller.schedule]
    assert controller.chosen_at == (5 if fail_at else 4) + controller.replanned


def test_mindformers_moe_with_its_marker_and_tracker_bitwise_through_profiling():
    """MindFormers' MoE layer guards its aux-loss tracker with its own is_in_recompute(): every profiling
    plan and the chosen one must log the loss once per step, as the plain model does."""
    def train(model):
        trackers = []

        def batch(step):
            trackers.append(model.tracker.snapshot())
            return token_batch(VOCAB)(step)
        return run_steps(model, batch, steps=7), trackers

    with mf.installed():
        base, base_trackers = train(build_mindformers_moe("mindformers"))
        model = build_mindformers_moe("mindformers")
        mac.apply_ac(model, config=budget(profile_steps=5), layers="decoder.layers")
        auto, trackers = train(model)
    assert first_difference(base, auto) is None
    assert all(np.array_equal(a, b) for a, b in zip(base_trackers, trackers))
    assert mac.ac_state(model).budget.phase == Phase.SETTLED


def _vjp_steps(model, steps, eval_every=0):
    """``ms.vjp`` steps of the reference GPT; with ``eval_every``, an eval forward (no gradient) after each."""
    params = model.trainable_params()
    opt = nn.SGD(params, learning_rate=0.05)
    history = []
    for k in range(steps):
        tokens, labels = GPT_BATCH(k)
        loss, vjp_fn = ms.vjp(lambda t: model(t, labels), tokens, weights=params)
        _, grads = vjp_fn(ms.Tensor(1.0, ms.float32))
        opt(grads)
        if eval_every:
            model.set_train(False)
            model(*GPT_BATCH(100 + k))
            model.set_train(True)
        history.append((loss.asnumpy().tobytes(), [g.asnumpy().tobytes() for g in grads],
                        [p.asnumpy().tobytes() for p in model.get_parameters()]))
    return history


def test_vjp_loop_with_eval_forwards_in_between_is_bitwise_and_eval_is_no_profiling_step():
    base = _vjp_steps(_gpt(), 7, eval_every=1)
    model = _gpt()
    mac.apply_ac(model, config=budget(profile_steps=4))
    auto = _vjp_steps(model, 7, eval_every=1)
    assert base == auto
    controller = mac.ac_state(model).budget
    assert controller.forwards == 7 and controller.chosen_at == 4 + controller.replanned
    assert controller.phase == Phase.SETTLED


@pytest.mark.parametrize("name, amp", [("batchnorm", None), ("int_bool_inputs", "O2")])
def test_batchnorm_and_amp_o2_bitwise(name, amp):
    # BatchNorm's moving statistics; int and bool inputs under amp O2 (as in test_mixed_precision: O2 keeps
    # LayerNorm in fp32 and wraps the model). Dropout: the GPT tests above.
    pattern = PATTERNS[name]
    def build():
        model = pattern.build()
        return ms.amp.auto_mixed_precision(model, amp, ms.float16) if amp else model
    base = run_steps(build(), pattern.batch, steps=6)
    model = build()
    mac.apply_ac(model, config=budget(profile_steps=4))
    auto = run_steps(model, pattern.batch, steps=6)
    assert first_difference(base, auto) is None
    assert mac.ac_state(model).budget.phase == Phase.SETTLED


def test_a_budget_below_the_least_plan_warns_once_and_trains(caplog):
    pattern = PATTERNS["int_bool_inputs"]
    base = run_steps(pattern.build(), pattern.batch, steps=7)
    model = pattern.build()
    mac.apply_ac(model, config=budget("1KiB", profile_steps=4))
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        auto = run_steps(model, pattern.batch, steps=7)
    assert first_difference(base, auto) is None
    warned = [r.getMessage() for r in caplog.records if "even the plan with the least peak needs" in r.getMessage()]
    assert len(warned) == 1 and "over the budget of 1.00 KiB" in warned[0]
    controller = mac.ac_state(model).budget
    assert not controller.fits and controller.phase == Phase.SETTLED
    least = min(controller.profile.mem[0][~np.isnan(controller.profile.mem[0])])
    assert all(controller.profile.mem[r][k] == least for r, k in enumerate(controller.choice.choice))


def test_new_shapes_profile_again_only_when_over_the_budget_and_at_most_max_profiles(caplog):
    pattern = PATTERNS["changing_lengths"]   # sequence lengths 8, 5, 7, 3 in turn
    lengths = [8] * 6 + [5, 3, 8] + [5] * 1

    def batch(step):
        return varlen_batch({8: 0, 5: 1, 7: 2, 3: 3}[lengths[step]])

    base = run_steps(pattern.build(), batch, steps=len(lengths))
    model = pattern.build()
    mac.apply_ac(model, config=budget("0.6x", profile_steps=4))
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        auto = run_steps(model, batch, steps=len(lengths))
    assert first_difference(base, auto) is None
    controller = mac.ac_state(model).budget
    fits = [e for e in controller.events if "fits the budget" in e]
    assert len(fits) == 2 and controller.profiles == 1   # shorter sequences: predicted within, plan kept

    # a longer sequence than profiled is predicted over the budget: profiled again, then the bound
    config, _ = controller.plans[controller.active_shape]
    controller.plans[controller.active_shape] = (config, controller.budget_bytes)   # any bigger shape: over
    controller.profiles = MAX_PROFILES
    controller._settled_forward((((2, 99, 16), "Float32"),))   # pylint: disable=protected-access
    controller._settled_forward((((2, 98, 16), "Float32"),))   # pylint: disable=protected-access
    bound = [e for e in controller.events if f"{MAX_PROFILES} profiles were taken already" in e]
    assert len(bound) == 1 and controller.phase == Phase.SETTLED


def test_a_longer_sequence_over_the_budget_is_profiled_again_and_stays_bitwise():
    pattern = PATTERNS["changing_lengths"]
    lengths = [3] * 6 + [8] * 6

    def batch(step):
        return varlen_batch({8: 0, 3: 3}[lengths[step]])

    base = run_steps(pattern.build(), batch, steps=len(lengths))
    model = pattern.build()
    mac.apply_ac(model, config=budget("0.6x", profile_steps=4))
    auto = run_steps(model, batch, steps=len(lengths))
    assert first_difference(base, auto) is None
    controller = mac.ac_state(model).budget
    assert controller.profiles == 2 and any("profiling again (profile 2 of" in e for e in controller.events)
    assert controller.phase == Phase.SETTLED and controller.profile_shape[0][0][1] == 8
    # the first profile's baseline: training step 2 (after the warm-up), length 3, and its budget in bytes
    step, shape, kept, at_shape, _ = controller.baseline_from
    assert (step, shape[0][0][1], at_shape) == (2, 3, controller.budget_bytes) and kept > 0
    line = next(x for x in controller.describe() if x.startswith("  baseline: "))
    assert line.startswith(f"  baseline: training step 2 without AC, inputs {list(shape[0][0])} Float32, ")
    assert line.endswith(f", kept {kept:,} B; the budget at those inputs is {at_shape:,} B")


def test_remove_ac_and_a_copy_in_the_middle_of_profiling():
    pattern = PATTERNS["int_bool_inputs"]
    model = pattern.build()
    before = [p.asnumpy().tobytes() for p in model.get_parameters()]
    mac.apply_ac(model, config=budget(profile_steps=4))
    run_steps(model, pattern.batch, steps=3)   # profiling: full recompute is installed now
    assert mac.ac_state(model).plan.active_layers()
    twin = copy.deepcopy(model)
    assert mac.ac_state(twin).budget is not mac.ac_state(model).budget
    assert mac.ac_state(twin).budget.phase == Phase.PROFILING and not mac.ac_state(twin).budget.samples
    mac.remove_ac(model)
    assert mac.ac_state(model) is None and not model._forward_pre_hook   # pylint: disable=protected-access
    assert before != [p.asnumpy().tobytes() for p in model.get_parameters()]   # it trained
    plain = copy.deepcopy(model)   # nothing of AC is left to copy
    assert first_difference(run_steps(model, pattern.batch, steps=1), run_steps(plain, pattern.batch, steps=1)) is None


def test_profile_schedule_puts_full_and_swap_first_and_keeps_its_length():
    options = candidate_options(build_gpt(num_layers=2).decoder.layers[0])
    schedule = profile_schedule(options, 5, include_swap=True)
    assert [o.name for o in schedule] == ["none", "none", "full", "layer swap", "select self_attention + mlp"]
    assert [o.name for o in profile_schedule(options, 4, include_swap=False)] == ["none", "none", "full",
                                                                                  "select self_attention + mlp"]
    assert profile_schedule(options, 32, True)[-1].name == "full, keep matmuls"


@pytest.mark.parametrize("section, message", [
    ({"activations": "65x"}, "memory_budget.activations: at most 64x"),
    ({"activations": 0.5}, "memory_budget.activations: expected a size (96MiB, 2GiB, a byte count)"),
    ({"activations": "0.5"}, "did you mean 0.5x"),
    ({"activations": "9" * 100}, "a string of 100 characters"),
    ({"activations": "1x", "profile_steps": 2}, "memory_budget.profile_steps: expected an integer from 3 to 32"),
    ({"activations": "1x", "include_swap": "yes"}, "memory_budget.include_swap: expected true or false"),
    ({"activations": "1x", "steps": 3}, "memory_budget.steps: unknown key"),
])
def test_bad_sections_name_the_field_and_leave_the_model_untouched(section, message):
    model = PATTERNS["int_bool_inputs"].build()
    with pytest.raises(mac.ConfigError) as err:
        mac.apply_ac(model, config={"memory_budget": section})
    assert message in str(err.value) and mac.ac_state(model) is None


def test_hand_written_lists_give_way_with_one_warning(caplog):
    model = PATTERNS["int_bool_inputs"].build()
    config = {**budget(), "recompute": {"mode": "full", "full_recompute_layer": [0]},
              "swap": {"enable": True, "layer_swap": [{"layers": [1]}]}}
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(model, config=config)
    warned = [r.getMessage() for r in caplog.records if "memory_budget is set" in r.getMessage()]
    assert len(warned) == 1 and "lists (recompute.full_recompute_layer, swap.layer_swap) are not applied" in warned[0]
    assert not plan.active_layers() and "memory budget 0.5x: the first 5 training steps" in plan.summary()
    assert mac.AcConfig.from_dict(plan.to_dict()).memory_budget == plan.config.memory_budget
