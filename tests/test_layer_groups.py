"""``recompute.group_layers`` (MindSpeed's uniform method): runs of N consecutive fully recomputed layers,
each run one region that keeps only its first layer's inputs.

Planning (groups, short runs, the plan's table and summary, the YAML round trip, bad values), what a
group keeps (its first layer's inputs only), bitwise training against the model without AC (the
pattern matrix has a ``group`` mode too), deep copies, ``remove_ac``, and the refusal of a model whose
layers are not chained.
"""
import copy

import mindspore as ms
import pytest

import mindformers_ac as mac
from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.mindspore_compat import pynative_executor

from conftest import model_fingerprint
from model_patterns import PATTERNS, Layer, PatternModel, hidden_batch, init_weights
from steps import first_difference, run_steps

GPT = dict(num_layers=8, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.1)


def grouped(size, layers="0-7", **extra):
    return {"recompute": {"mode": "full", "full_recompute_layer": [layers], "group_layers": size, **extra}}


def _batch(step):
    return synthetic_batch(2, 16, 64, seed=step)


@pytest.fixture(scope="module")
def plain_history():
    return run_steps(build_gpt(**GPT), _batch)


def test_groups_are_runs_of_consecutive_full_layers():
    model = build_gpt(**GPT)
    plan = mac.plan_ac(model, config=grouped(2))
    assert plan.groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert plan.summary() == "full recompute on layers 0-7 (groups of 2: 0-1, 2-3, 4-5, 6-7)"
    assert "\n3      full (group 2-3)" in str(plan)
    assert plan.layers[3].describe() == ["full recompute (group 2-3)"]
    # a gap or the end of a range cuts a group short; a group of one is a layer of its own
    plan = mac.plan_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-2", "4-7"],
                                                    "group_layers": 3}})
    assert plan.groups() == [(0, 1, 2), (4, 5, 6)] and plan.layers[7].group == ()
    assert mac.plan_ac(model, config=grouped(1)).groups() == []
    # exclude_op and other layers' swap go with groups
    plan = mac.plan_ac(model, config={**grouped(2, "0-3", exclude_op=["Softmax"]),
                                      "swap": {"enable": True, "layer_swap": [{"layers": ["4-5"]}]}})
    assert plan.groups() == [(0, 1), (2, 3)] and plan.layers[0].exclude == ("Softmax",) and plan.layers[4].layer_swap


def test_group_layers_round_trips_and_bad_values_name_the_field():
    model = build_gpt(**GPT)
    written = mac.plan_ac(model, config=grouped(4)).to_dict()
    assert written["recompute"]["group_layers"] == 4
    assert mac.plan_ac(model, config=written).groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for bad in (0, -1, "2", True, 2.0):
        before = model_fingerprint(model)
        with pytest.raises(mac.ConfigError, match="expected an integer from 1 to") as err:
            mac.apply_ac(model, config=grouped(bad))
        assert err.value.field == "recompute.group_layers" and model_fingerprint(model) == before


def test_group_layers_without_full_layers_warns():
    plan = mac.plan_ac(build_gpt(**GPT), config={"recompute": {"mode": "select", "select_module": {"mlp": [0]},
                                                               "group_layers": 2}})
    assert any("group_layers has no effect" in w for w in plan.warnings)


@pytest.mark.parametrize("size", [2, 4])
def test_groups_train_bitwise_with_dropout(plain_history, size):
    model = build_gpt(**GPT)
    mac.apply_ac(model, config=grouped(size))
    assert first_difference(plain_history, run_steps(model, _batch)) is None
    stats = mac.ac_state(model).recompute_stats
    assert all(stats[i].recompute_calls == 3 for i in range(8))
    firsts = {0, size, 2 * size, 3 * size} & set(range(8))
    assert all(stats[i].chained_calls == (0 if i in firsts else 3) for i in range(8)), \
        {i: s.chained_calls for i, s in stats.items()}


def _kept(config, steps=2):
    """Per-layer kept bytes at the end of forward, on a light-path step (the checking call keeps more)."""
    model = build_gpt(**GPT)
    mac.apply_ac(model, config=config)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    for step in range(steps):
        grad_fn(*_batch(step))
    memory = mac.measure_step(model, grad_fn, *_batch(steps))
    return [memory.layers[i].kept_bytes for i in range(8)], memory


def test_a_group_keeps_its_first_layers_inputs_only():
    per_layer, _ = _kept(grouped(1))
    kept, memory = _kept(grouped(4))
    hidden = 2 * 16 * 32 * 4   # one (batch, seq, hidden) float32 tensor: a layer's input
    for i in range(8):
        if i in (0, 4):
            assert kept[i] == per_layer[i]
        else:   # the mask is still kept as the member received it; the hidden input is rebuilt
            assert kept[i] == per_layer[i] - hidden
            assert memory.layers[i].recomputed_bytes > 0
    assert sum(kept) < sum(per_layer)


def test_deepcopy_and_remove_ac(plain_history):
    model = build_gpt(**GPT)
    before = model_fingerprint(model)
    mac.apply_ac(model, config=grouped(2))
    dup = copy.deepcopy(model)
    assert mac.ac_state(dup).plan.groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert first_difference(plain_history, run_steps(dup, _batch)) is None
    assert all(s.chained_calls == 3 for i, s in mac.ac_state(dup).recompute_stats.items() if i % 2)
    mac.remove_ac(model)
    assert model_fingerprint(model) == before


class _Unchained(PatternModel):
    """Hands each layer a new tensor (``x * 1.0``), not the previous layer's output."""

    def construct(self, x, y, pos, mask):
        for layer in self.layers:
            x = self.run_layer(layer, x * 1.0, pos, mask, self.scale)
        return self.loss(x, y)


class _Reordered(PatternModel):
    def construct(self, x, y, pos, mask):
        for layer in (self.layers[1], self.layers[0], self.layers[2]):
            x = self.run_layer(layer, x, pos, mask, self.scale)
        return self.loss(x, y)


class _KeywordCalled(PatternModel):
    """Calls each layer by keyword (``layer(x=..., pos=...)``, as ``layer(hidden_states=x)`` in MindFormers)."""

    def construct(self, x, y, pos, mask):
        for layer in self.layers:
            x = self.run_layer(layer, mask=mask, pos=pos, scale=self.scale, x=x)
        return self.loss(x, y)


class _MaskFirst(Layer):
    """Takes the hidden states second: ``layer(mask, x, pos, scale)``."""

    def construct(self, mask, x, pos, scale):   # pylint: disable=arguments-differ
        return super().construct(x, pos, mask, scale)


class _SecondPosition(PatternModel):
    def construct(self, x, y, pos, mask):
        for layer in self.layers:
            x = self.run_layer(layer, mask, x, pos, self.scale)
        return self.loss(x, y)


@pytest.mark.parametrize("cls, layer_cls", [(_KeywordCalled, Layer), (_SecondPosition, _MaskFirst)],
                         ids=["by_keyword", "second_position"])
@pytest.mark.parametrize("light", [True, False], ids=["light", "intercepted"])
def test_the_chained_argument_is_the_one_the_previous_output_went_into(cls, layer_cls, light):
    """The group rebuilds whichever argument (position or keyword) received the previous layer's output."""
    def build():
        return init_weights(cls([layer_cls() for _ in range(3)]))
    base = run_steps(build(), hidden_batch)
    model = build()
    extra = {} if light else {"exclude_op": ["Softmax"]}
    mac.apply_ac(model, config=grouped(3, "0-2", **extra), layers="layers")
    assert first_difference(base, run_steps(model, hidden_batch)) is None
    stats = mac.ac_state(model).recompute_stats
    assert [stats[i].chained_calls for i in range(3)] == [0, 3, 3]   # 3 steps, members 1 and 2 chained
    assert all(stats[i].ops_rerun > 0 for i in range(3))
    if not light:
        assert stats[1].ops_reused > 0


@pytest.mark.parametrize("cls, reason", [
    (_Unchained, "layer 1 of the group of layers 0, 1, 2 did not receive the previous layer's output"),
    (_Reordered, "layer 1 of the group of layers 0, 1, 2 ran without the group's previous layer right before"),
])
def test_layers_that_are_not_chained_are_refused_naming_them(cls, reason):
    model = init_weights(cls([Layer() for _ in range(3)]))
    mac.apply_ac(model, config=grouped(3, "0-2"), layers="layers")
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    with pytest.raises(mac.RecomputeError, match=reason):
        grad_fn(*hidden_batch(0))
    pynative_executor.clear_res()   # docs/exactness.md's failure path, as for any exception in a step
    mac.remove_ac(model)


def test_group_with_exclude_op_next_to_a_swapped_layer_is_bitwise():
    pattern = PATTERNS["int_bool_inputs"]
    base = run_steps(pattern.build(), pattern.batch)
    model = pattern.build()
    mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["1-2"], "group_layers": 2,
                                              "exclude_op": ["Softmax"]},
                                "swap": {"enable": True, "layer_swap": [{"layers": [0]}]}}, layers="layers")
    assert first_difference(base, run_steps(model, pattern.batch)) is None
    state = mac.ac_state(model)
    assert state.recompute_stats[2].chained_calls == 3 and state.recompute_stats[2].ops_reused > 0
    assert state.swap_report.layers[0].num_offloaded > 0
