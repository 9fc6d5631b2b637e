"""``select_module`` naming a method: ``self_attention.get_query_key_value_tensors``, as MindFormers allows.

MindFormers' whitelist walker lists a cell's class-owned methods, so a
config can name one; ``apply_ac`` recomputes what the method computes (its
calls become checkpoint regions). Bitwise against the plain model (loss,
every gradient, every parameter), with ops re-run counted; ``remove_ac`` and
``copy.deepcopy`` handle the method like any other patch.
"""
import copy
import logging

import pytest

import mindformers_ac as mac
from mindformers_ac.harness.models import SelfAttention, build_gpt, synthetic_batch

from conftest import model_fingerprint
from steps import first_difference, run_steps

METHOD = "self_attention.get_query_key_value_tensors"
DIMS = dict(num_layers=4, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.1)


class QKVAttention(SelfAttention):
    """MindFormers' attention shape: the projection to q, k, v is a method of the attention cell."""

    def construct(self, x, attention_mask):
        b, s, h = x.shape
        q, k, v = self.get_query_key_value_tensors(x)
        context = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(context.permute(0, 2, 1, 3).reshape(b, s, h))

    def get_query_key_value_tensors(self, x):
        b, s, h = x.shape
        qkv = self.linear_qkv(x).reshape(b, s, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        return qkv[0] * qkv[0].sigmoid(), qkv[1], qkv[2]


def build():
    model = build_gpt(**DIMS)
    for layer in model.decoder.layers:
        layer.self_attention.__class__ = QKVAttention   # same cells and weights, MindFormers' method
    return model


def batch(step):
    return synthetic_batch(2, DIMS["seq_length"], DIMS["vocab_size"], seed=step)


@pytest.fixture(scope="module")
def plain_history():
    return run_steps(build(), batch)


def select(patterns, **extra):
    return {"recompute": {"mode": "select", "select_module": patterns, **extra}}


def test_the_whitelist_lists_the_method_and_the_plan_selects_it(caplog):
    model = build()
    assert METHOD in mac.get_single_layer_whitelist(model.decoder.layers[0])
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(model, config=select({r".*\.get_query_key_value_tensors": ["0-3"]}))
    assert "did not match" not in caplog.text
    assert all(lp.recompute == (METHOD,) and lp.method_paths == {METHOD} for lp in plan.layers.values())
    # a module that holds the method covers it
    plan = mac.plan_ac(model, config=select({r"self_attention(\..*)?": [0]}))
    assert plan.layers[0].recompute == ("self_attention",)


@pytest.mark.parametrize("variant", ["method", "exclude", "mlp"])
def test_select_on_a_method_recomputes_its_work_bitwise_and_remove_restores(plain_history, variant):
    model = build()
    before = model_fingerprint(model)
    patterns = {METHOD: ["0-3"], **({"mlp": [1, 3]} if variant == "mlp" else {})}
    extra = {"exclude_op": ["sigmoid"]} if variant == "exclude" else {}
    mac.apply_ac(model, config=select(patterns, **extra))
    attention = model.decoder.layers[0].self_attention
    assert getattr(attention.__dict__.get("get_query_key_value_tensors"), "mac_method_wrapper", False)
    assert first_difference(plain_history, run_steps(model, batch)) is None
    state = mac.ac_state(model)
    for i in range(4):
        stats = state.recompute_stats[i]
        assert stats.ops_rerun > 0 and stats.recompute_calls > 0, (i, stats.as_dict())
    if extra:
        assert sum(s.ops_reused for s in state.recompute_stats.values()) > 0
    mac.remove_ac(model)
    assert "get_query_key_value_tensors" not in vars(attention)
    assert model_fingerprint(model)[0] == before[0]   # every cell as built (the weights trained)
    mac.apply_ac(model, config=select(patterns, **extra))   # and it can be applied again
    mac.remove_ac(model)


def test_deepcopy_gives_the_copy_its_own_method_region(plain_history):
    model = build()
    mac.apply_ac(model, config=select({METHOD: ["0-3"]}))
    dup = copy.deepcopy(model)
    original_wrapper = vars(model.decoder.layers[0].self_attention)["get_query_key_value_tensors"]
    dup_wrapper = vars(dup.decoder.layers[0].self_attention)["get_query_key_value_tensors"]
    assert dup_wrapper is not original_wrapper
    assert dup_wrapper.__wrapped__.__self__ is dup.decoder.layers[0].self_attention
    assert first_difference(plain_history, run_steps(dup, batch)) is None
    assert mac.ac_state(dup).recompute_stats[0].ops_rerun > 0
    assert mac.ac_state(model).recompute_stats[0].ops_rerun == 0
    # a copy of one layer is a plain layer: its attention runs its class's method
    layer = copy.deepcopy(model.decoder.layers[2])
    assert "get_query_key_value_tensors" not in vars(layer.self_attention)
    mac.remove_ac(dup)
    mac.remove_ac(model)


def test_sections_that_cannot_act_on_a_method_say_so(caplog):
    model = build()
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(model, config={
            "recompute": {"mode": "full", "full_recompute_layer": [0], "exclude_op": {METHOD: [0]}},
            "recompute_comm": {"enable": True, "select_module": {METHOD: [1]}},
            "swap": {"enable": True, "op_swap": [{"op_name": METHOD, "layers": [2]}]}})
    assert f"{METHOD} in layer 0 is a method; exclude_op keeps" in caplog.text
    assert f"{METHOD} in layer 1 is a method, not a communication operation" in caplog.text
    assert f"{METHOD} in layer 2 is a method; op_swap swaps what a module saves" in caplog.text
    assert not plan.layers[0].exclude and not plan.layers[1].recompute_comm and not plan.layers[2].op_swap
