"""MindFormers' ``mtp_block``: multi-token-prediction layer ``i`` is global layer ``num_layers + i``.

The model is MindFormers' shape: ``gpt.decoder`` (a ``TransformerBlock`` with
``config.num_layers``) and ``gpt.mtp`` (a block holding its own ``layers``),
which runs after the decoder on its output; ``apply_ac`` is called on the
decoder with ``mtp_block=gpt.mtp``, as MindFormers' ``parallelize`` does.
Every mode trains bitwise equal to the plain twin (loss, gradients, every
parameter) and acts on the MTP layers.
"""
import copy
import logging
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn

import mindformers_ac as mac
import mindformers_ac.actions.layer_swap as layer_swap_module
from mindformers_ac.harness.models import DropoutSeeds, Embedding, TransformerBlock, TransformerLayer, gpt_config

from conftest import model_fingerprint
from steps import first_difference, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")

NUM_LAYERS, NUM_MTP = 4, 2
CONFIG = gpt_config(num_layers=NUM_LAYERS, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.1)


class MTPBlock(nn.Cell):
    """MTP layers after the decoder: each predicts from the previous one's hidden states."""

    def __init__(self, config, seeds, num_mtp):
        super().__init__()
        self.layers = nn.CellList([TransformerLayer(config, config.num_layers + i, seeds) for i in range(num_mtp)])
        self.final_layernorm = nn.LayerNorm((config.hidden_size,))

    def construct(self, hidden, attention_mask):
        outputs = []
        for layer in self.layers:
            hidden = layer(hidden, attention_mask)
            outputs.append(self.final_layernorm(hidden))
        return outputs


class MTPGPT(nn.Cell):
    def __init__(self, config, num_mtp, seed=0):
        super().__init__()
        self.dropout_seeds = DropoutSeeds(seed)
        self.embedding = Embedding(config, self.dropout_seeds)
        self.decoder = TransformerBlock(config, self.dropout_seeds)
        self.mtp = MTPBlock(config, self.dropout_seeds, num_mtp)
        self.output_layer = mint.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        s = config.seq_length
        self.attention_mask = Tensor(np.triu(np.full((s, s), -1e9, np.float32), 1)[None, None])

    def _loss(self, hidden, labels):
        logits = self.output_layer(hidden)
        return self.loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def construct(self, tokens, labels):
        self.dropout_seeds.step += 1
        hidden = self.decoder(self.embedding(tokens), self.attention_mask)
        loss = self._loss(hidden, labels)
        for out in self.mtp(hidden, self.attention_mask):
            loss = loss + 0.3 * self._loss(out, labels)
        return loss


def build(seed=0):
    ms.set_seed(seed)
    np.random.seed(seed)
    model = MTPGPT(CONFIG, NUM_MTP, seed)
    model.set_train(True)
    return model


def batch(step):
    rng = np.random.default_rng(100 + step)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, CONFIG.seq_length)).astype(np.int32)
    return Tensor(tokens), Tensor(np.roll(tokens, -1, axis=1))


@pytest.fixture(scope="module")
def plain_history():
    return run_steps(build(), batch)


def test_mtp_layers_are_global_ids_after_the_decoder_in_the_plan_and_explain():
    model = build()
    plan = mac.plan_ac(model.decoder, config={"recompute": {
        "mode": "select", "full_recompute_layer": [0, 4], "select_module": {".*mlp": [5]}}}, mtp_block=model.mtp)
    assert list(plan.layers) == [0, 1, 2, 3, 4, 5]
    assert (plan.num_layers, plan.num_mtp_layers, plan.total_layers) == (4, 2, 6)
    assert plan.layers[4].full_recompute and plan.layers[4].mtp_index == 0
    assert plan.layers[5].recompute == ("mlp",) and plan.layers[5].mtp_index == 1
    assert plan.layers[3].mtp_index is None and not plan.layers[3].recomputed
    text = plan.explain()
    assert "4 layers at 'layers' + 2 MTP layers at 'mtp_block.layers' (global ids 0-3, 4-5 (MTP 0-1) of 6: " \
           "4 decoder + 2 MTP)" in text
    assert "\n5 (MTP 1)  mlp" in text and "\n4 (MTP 0)  full" in text
    assert "recompute.select_module['.*mlp'] -> layers 5 (MTP 1)" in text
    assert "layer 5 (MTP 1): mlp" in text
    assert plan.summary() == "full recompute on layers 0, 4 (MTP 0); select recompute on layer 5 (MTP 1) (mlp)"
    # the same through the top-level model (layer list found at decoder.layers), MindFormers' positional call
    rc = mac.RecomputeConfig(mode="full", full_recompute_layer=["4-5"])
    plan = mac.plan_ac(model, rc, None, None, 1, model.mtp)
    assert [i for i, lp in plan.layers.items() if lp.full_recompute] == [4, 5]
    # the plan writes itself back with the global ids
    assert plan.to_dict()["recompute"]["full_recompute_layer"] == ["4-5"]


def test_layer_ids_are_bounded_by_decoder_and_mtp_layers():
    model = build()
    with pytest.raises(mac.ConfigError, match=r"^recompute\.full_recompute_layer\[0\]: layer 6 is out of range: "
                                              r"the model has 4 decoder layers \(ids 0-3\) and 2 MTP layers "
                                              r"\(ids 4-5\)"):
        mac.plan_ac(model.decoder, config={"recompute": {"mode": "full", "full_recompute_layer": ["5-6"]}},
                    mtp_block=model.mtp)
    with pytest.raises(mac.ConfigError, match=r"^recompute\.full_recompute_layer\[0\]: layer 4 is out of range"):
        mac.plan_ac(model.decoder, config={"recompute": {"mode": "full", "full_recompute_layer": [4]}})
    for field, section in (("recompute.select_module['mlp'][0]", {"recompute": {"mode": "select",
                                                                                "select_module": {"mlp": [6]}}}),
                           ("recompute_comm.select_module['mlp'][0]", {"recompute_comm": {
                               "enable": True, "select_module": {"mlp": [6]}}}),
                           ("swap.op_swap[0].layers[0]", {"swap": {"enable": True, "op_swap": [
                               {"op_name": "mlp", "layers": [6]}]}})):
        with pytest.raises(mac.ConfigError) as info:
            mac.plan_ac(model.decoder, config=section, mtp_block=model.mtp)
        assert info.value.field == field and "2 MTP layers (ids 4-5)" in str(info.value)


def test_swap_prefetch_crosses_into_the_mtp_layers_and_the_last_layer_cannot_be_swapped():
    model = build()

    def swap(layers, p=1):
        return {"swap": {"enable": True, "default_prefetch": p, "layer_swap": [{"layers": layers}]}}
    plan = mac.plan_ac(model.decoder, config=swap([3, 4]), mtp_block=model.mtp)
    # the last decoder layer comes back when MTP layer 0 starts its backward (MTP layers run after the decoder)
    assert (plan.layers[3].prefetch_layer, plan.layers[4].prefetch_layer) == (4, 5)
    row = next(line for line in str(plan).splitlines() if line.startswith("3 "))
    assert row.split()[-4:] == ["layer", "4", "(MTP", "0)"], row
    with pytest.raises(mac.ConfigError, match=r"^swap\.layer_swap\[0\]\.layers: layer 5 \+ default_prefetch 1 must "
                                              r"be < the 6 layers \(4 decoder \+ 2 MTP; .*the last layer that can be "
                                              r"swapped is 4"):
        mac.plan_ac(model.decoder, config=swap([5]), mtp_block=model.mtp)
    with pytest.raises(mac.ConfigError, match=r"^swap\.layer_swap\[0\]\.layers: layer 3 \+ default_prefetch 1 must "
                                              r"be < num_layers 4"):
        mac.plan_ac(model.decoder, config=swap([3]))   # without the MTP block nothing follows layer 3
    assert mac.plan_ac(model.decoder, config=swap([0], p=5), mtp_block=model.mtp).layers[0].prefetch_layer == 5
    with pytest.raises(mac.ConfigError, match=r"^swap\.default_prefetch: must be in \[1, 5\] for a model with 6 "
                                              r"layers \(4 decoder \+ 2 MTP\)"):
        mac.plan_ac(model.decoder, config=swap([0], p=6), mtp_block=model.mtp)


def test_a_wrong_mtp_block_is_a_config_error_naming_it():
    model = build()
    full = {"recompute": {"mode": "full", "full_recompute_layer": [0]}}
    for wrong, says in ((model.embedding, "got a Embedding cell with no non-empty layer list"),
                        (3, "got int"), (model.decoder, "holds cells of the decoder's layer list")):
        before = model_fingerprint(model)
        with pytest.raises(mac.ConfigError) as info:
            mac.apply_ac(model.decoder, config=full, mtp_block=wrong)
        assert info.value.field == "mtp_block" and says in str(info.value), str(info.value)
        assert model_fingerprint(model) == before and mac.ac_state(model.decoder) is None
    # the layer list itself is fine
    assert list(mac.plan_ac(model.decoder, config=full, mtp_block=model.mtp.layers).layers) == list(range(6))


class _Stage(nn.Cell):
    """A pipeline stage of an 8-layer model with 2 MTP layers: decoder layers layer_start.. of the model."""

    def __init__(self, layer_start, count, mtp_num_layers=2):
        super().__init__()
        self.config = SimpleNamespace(num_layers=8, mtp_num_layers=mtp_num_layers)
        self.layer_start = layer_start
        self.layers = nn.CellList([TransformerLayer(CONFIG, layer_start + i) for i in range(count)])


def test_pipeline_stages_and_config_mtp_num_layers(caplog):
    mtp = MTPBlock(CONFIG, DropoutSeeds(0), 2)
    full = {"recompute": {"mode": "full", "full_recompute_layer": [0, "8-9"]}}
    plan = mac.plan_ac(_Stage(4, 4), config=full, pp=2, mtp_block=mtp)
    assert list(plan.layers) == [4, 5, 6, 7, 8, 9] and plan.layers[9].full_recompute
    # an earlier stage: ids 8-9 are valid (another stage's layers), but the MTP block can't be here
    assert list(mac.plan_ac(_Stage(0, 4), config=full, pp=2).layers) == [0, 1, 2, 3]
    with pytest.raises(mac.ConfigError, match=r"^mtp_block: MTP layers follow the last decoder layer, but this "
                                              r"stage holds decoder layers 0-3 of 8"):
        mac.plan_ac(_Stage(0, 4), config=full, pp=2, mtp_block=mtp)
    with pytest.raises(mac.ConfigError, match=r"^mtp_block: mtp_block\.layers holds 2 layers, but "
                                              r"config\.mtp_num_layers is 3"):
        mac.plan_ac(_Stage(4, 4, mtp_num_layers=3), config=full, pp=2, mtp_block=mtp)
    # the last stage without its MTP block: the MTP ids do nothing, and the plan says so
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        plan = mac.plan_ac(_Stage(4, 4), config=full, pp=2)
    assert list(plan.layers) == [4, 5, 6, 7]
    assert "the config names MTP layers ['8-9'] (config.mtp_num_layers=2) but apply_ac got no mtp_block" \
        in caplog.text


MODES = {
    "full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-5"]}},
    "select": {"recompute": {"mode": "select", "full_recompute_layer": [4],
                             "select_module": {".*mlp": [1, 5], ".*attention": [5]}, "exclude_op": ["matmul"]}},
    "layer_swap": {"swap": {"enable": True, "default_prefetch": 1, "layer_swap": [{"layers": ["3-4"]}]}},
    "op_swap_and_recompute": {"recompute": {"mode": "full", "full_recompute_layer": [5]},
                              "swap": {"enable": True, "op_swap": [{"op_name": ".*mlp", "layers": [2, 4]}]}},
}
ACTS_ON = {"full": ([4, 5], []), "select": ([4, 5], []), "layer_swap": ([], [3, 4]),
           "op_swap_and_recompute": ([5], [4])}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_on_mtp_layers_trains_bitwise_and_remove_restores(plain_history, mode):
    model = build()
    before = model_fingerprint(model)
    mac.apply_ac(model.decoder, config=MODES[mode], mtp_block=model.mtp)
    assert first_difference(plain_history, run_steps(model, batch)) is None
    state = mac.ac_state(model.decoder)
    assert state.layer_cells[4] is model.mtp.layers[0] and state.layer_cells[5] is model.mtp.layers[1]
    recomputed, swapped = ACTS_ON[mode]
    for i in recomputed:
        assert state.recompute_stats[i].ops_rerun > 0 and state.recompute_stats[i].recompute_calls > 0, i
    for i in swapped:
        assert state.swap_report.layers[i].num_offloaded > 0, (i, state.swap_report.as_dict())
    mac.remove_ac(model.decoder)
    assert model_fingerprint(model)[0] == before[0]   # every cell as built (the weights trained)
    assert mac.ac_state(model.decoder) is None


def test_deepcopy_of_the_whole_model_gives_the_copy_its_own_mtp_ac(plain_history):
    model = build()
    mac.apply_ac(model.decoder, config=MODES["full"], mtp_block=model.mtp)
    dup = copy.deepcopy(model)   # copies decoder (its copy hook applies AC) before it reaches mtp
    state, dup_state = mac.ac_state(model.decoder), mac.ac_state(dup.decoder)
    assert dup_state is not None and dup_state is not state
    assert dup_state.layer_cells[4] is dup.mtp.layers[0] and dup_state.layer_cells[5] is dup.mtp.layers[1]
    assert dup_state.mtp_block is dup.mtp
    assert first_difference(plain_history, run_steps(dup, batch)) is None
    assert dup_state.recompute_stats[5].ops_rerun > 0
    assert state.recompute_stats[5].ops_rerun == 0   # the original's layers did not run
    assert first_difference(plain_history, run_steps(model, batch)) is None
    mac.remove_ac(dup.decoder)
    mac.remove_ac(model.decoder)


def test_install_failure_on_an_mtp_layer_leaves_everything_untouched(monkeypatch):
    model = build()
    before = model_fingerprint(model)
    real = layer_swap_module.install_layer_swap
    calls = []

    def failing(layers, ids, **kw):
        calls.append(list(ids))
        if any(i >= NUM_LAYERS for i in ids):
            raise RuntimeError("installer failed on an MTP layer")
        return real(layers, ids, **kw)
    monkeypatch.setattr(layer_swap_module, "install_layer_swap", failing)
    config = {"recompute": {"mode": "full", "full_recompute_layer": [0, 5]},
              "swap": {"enable": True, "layer_swap": [{"layers": ["3-4"]}]}}
    with pytest.raises(RuntimeError, match="installer failed on an MTP layer"):
        mac.apply_ac(model.decoder, config=config, mtp_block=model.mtp)
    assert calls == [[3], [4]]   # the decoder's swap was installed, then rolled back
    assert model_fingerprint(model) == before and mac.ac_state(model.decoder) is None


def test_summary_marks_mtp_layers(caplog):
    model = build()
    config = {"recompute": {"mode": "full", "full_recompute_layer": [0, "4-5"]},
              "swap": {"enable": True, "layer_swap": [{"layers": [2]}]}}
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        mac.apply_ac(model.decoder, config=config, mtp_block=model.mtp)
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("apply_ac:")]
    assert summaries == ["apply_ac: full recompute on layers 0, 4-5 (MTP 0-1); layer swap on layer 2 (prefetch 1)"]
    mac.remove_ac(model.decoder)


def test_measure_step_reports_mtp_layers_under_their_global_ids():
    def measure(model, **kwargs):
        return mac.measure_step(model, ms.value_and_grad(model, None, model.trainable_params()), *batch(0),
                                **kwargs)

    plain = build()
    base = measure(plain, mtp_block=plain.mtp)
    assert sorted(k for k in base.layers if k != "other") == list(range(NUM_LAYERS + NUM_MTP))
    assert all(base.layers[i].kept_bytes > 0 for i in range(NUM_LAYERS + NUM_MTP))
    model = build()
    mac.apply_ac(model.decoder, config={"recompute": {"mode": "full", "full_recompute_layer": ["4-5"]}},
                 mtp_block=model.mtp)
    memory = measure(model)   # the MTP block apply_ac was given
    for i in range(NUM_LAYERS):
        assert memory.layers[i].kept_bytes == base.layers[i].kept_bytes
    for i in (4, 5):
        assert memory.layers[i].kept_bytes < base.layers[i].kept_bytes and memory.layers[i].recomputed_bytes > 0
    assert memory.layers["other"].kept_bytes == base.layers["other"].kept_bytes
