"""What a training script does around apply_ac: deep copies (EMA, teacher) and checkpoint reloads.

Each test trains against the same script without AC and compares the loss,
every gradient and every parameter bitwise at every step (``run_steps`` of
the model-pattern matrix), and counts that AC acted where it should, and only
there.
"""
import copy

import mindspore as ms
import pytest

import mindformers_ac as mac
from mindformers_ac.construct_patch import patches

from conftest import model_fingerprint
from model_patterns import PATTERNS, RECOMPUTE_MODES, SWAP_MODES, mode_config
from steps import ac_work, first_difference, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")   # each test starts from an empty SwapManager


PATTERN = PATTERNS["llama"]
CONFIG_MODES = ("full", "select_cell", "select_op", "exclude_op", "recompute_comm", "layer_swap", "op_swap", "mixed")


def assert_acted(mode, before, after):
    if mode in RECOMPUTE_MODES:
        assert after[0] > before[0]
    if mode in SWAP_MODES:
        assert after[1] > before[1]


def _library_leftovers(model):
    """Paths of cells that still carry a patch, a forward hook (the policy's path tracker) or a copy hook."""
    return [path for path, cell in model.cells_and_names()
            if patches(cell) or "__deepcopy__" in cell.__dict__ or cell._forward_pre_hook or cell._forward_hook]


# -- copy.deepcopy ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def copy_baseline():
    """Without AC: one step, a deep copy, then three more steps of the copy and of the original."""
    model = PATTERN.build()
    first = run_steps(model, PATTERN.batch, steps=1)
    dup = copy.deepcopy(model)
    return first, run_steps(dup, PATTERN.batch), run_steps(model, PATTERN.batch)


@pytest.mark.parametrize("mode", CONFIG_MODES)
def test_deepcopy_trains_with_its_own_ac_and_leaves_the_original_alone(copy_baseline, mode):
    base_first, base_copy, base_original = copy_baseline
    model = PATTERN.build()
    mac.apply_ac(model, config=mode_config(mode, PATTERN), layers=PATTERN.layers)
    assert first_difference(base_first, run_steps(model, PATTERN.batch, steps=1)) is None
    dup = copy.deepcopy(model)
    state, dup_state = mac.ac_state(model), mac.ac_state(dup)
    assert dup_state is not None and dup_state is not state
    assert str(dup_state.plan) == str(state.plan)
    assert all(dup_state.layer_cells[i] is not cell for i, cell in state.layer_cells.items())

    original_work = ac_work(model)
    assert first_difference(base_copy, run_steps(dup, PATTERN.batch)) is None
    assert ac_work(model) == original_work                 # the copy never ran the original's layers
    assert_acted(mode, (0, 0), ac_work(dup))

    fingerprint = model_fingerprint(model)
    mac.remove_ac(dup)                                   # touches the copy only
    assert model_fingerprint(model) == fingerprint and mac.ac_state(model) is state
    assert _library_leftovers(dup) == [] and mac.ac_state(dup) is None

    assert first_difference(base_original, run_steps(model, PATTERN.batch)) is None
    assert_acted(mode, original_work, ac_work(model))
    mac.remove_ac(model)
    assert _library_leftovers(model) == []


def test_deepcopy_of_a_copy_and_of_a_wrapper_holding_the_model(copy_baseline):
    _, base_copy, _ = copy_baseline
    model = PATTERN.build()
    mac.apply_ac(model, config=mode_config("mixed", PATTERN), layers=PATTERN.layers)
    run_steps(model, PATTERN.batch, steps=1)
    holder = {"student": model, "note": "EMA teacher below"}
    teacher = copy.deepcopy(copy.deepcopy(holder))["student"]
    assert mac.ac_state(teacher) is not None
    assert first_difference(base_copy, run_steps(teacher, PATTERN.batch)) is None
    assert ac_work(teacher)[0] > 0 and ac_work(teacher)[1] > 0


@pytest.mark.parametrize("mode", ("full", "exclude_op", "select_op", "recompute_comm", "op_swap"))
def test_deepcopy_of_one_layer_is_a_plain_layer(mode):
    """A copied layer (or sub-cell) runs its own code, without AC: AC belongs to the model it was applied to."""
    plain = PATTERN.build()
    model = PATTERN.build()
    mac.apply_ac(model, config=mode_config(mode, PATTERN), layers=PATTERN.layers)
    layer = model.model.layers[1]
    for original in (layer, layer.feed_forward):
        dup = copy.deepcopy(original)
        assert _library_leftovers(dup) == []
        assert not any(hasattr(v, "mac_inner") or hasattr(v, "_mac_target")
                       for _, cell in dup.cells_and_names() for v in vars(cell).values())
    dup = copy.deepcopy(layer)
    x, _, pos, mask = PATTERN.batch(0)
    h = plain.model.tok_embeddings(x)
    work = ac_work(model)
    grad = ms.grad(lambda h: dup(h, pos, mask).sum())(h)
    expected = ms.grad(lambda h: plain.model.layers[1](h, pos, mask).sum())(h)
    assert grad.asnumpy().tobytes() == expected.asnumpy().tobytes()
    assert ac_work(model) == work


# -- checkpoint reloads -----------------------------------------------------------------------------

def _train_with_reload(model, path, steps_before=2, steps_after=2):
    """Steps, a save + load_checkpoint + load_param_into_net, more steps; per step: the history and
    the number of tensors swap offloaded (None without AC)."""
    history, offloaded = [], []
    report = mac.ac_state(model).swap_report if mac.ac_state(model) is not None else None
    for phase, steps in (("before", steps_before), ("after", steps_after)):
        if phase == "after":
            ms.save_checkpoint(model, path)
            ms.load_param_into_net(model, ms.load_checkpoint(path))
        for _ in range(steps):
            history += run_steps(model, lambda _step, n=len(history): PATTERN.batch(n), steps=1)
            if report is not None:
                offloaded.append(report.end_step()["num_offloaded"])
    return history, offloaded


@pytest.mark.parametrize("mode", SWAP_MODES)
def test_weights_are_never_offloaded_after_a_checkpoint_reload(tmp_path, mode):
    model = PATTERN.build()
    pointers = [p.data_ptr() for p in model.get_parameters()]
    base, _ = _train_with_reload(model, str(tmp_path / "plain.ckpt"))
    assert [p.data_ptr() for p in model.get_parameters()] != pointers   # the reload gave new storage

    model = PATTERN.build()
    mac.apply_ac(model, config=mode_config(mode, PATTERN), layers=PATTERN.layers)
    history, offloaded = _train_with_reload(model, str(tmp_path / "ac.ckpt"))
    assert first_difference(base, history) is None
    assert offloaded[0] > 0 and len(set(offloaded)) == 1, offloaded   # no weight joins the offloads
    mac.remove_ac(model)


def test_deepcopy_maps_layers_given_as_cells_and_nn_dropout_proxies_to_the_copy():
    from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_nn_dropout
    from mindformers_ac.recompute.op_slot import OpSlot

    def dropout_slot(cell):
        slot = cell.__dict__.get("dropout")
        return isinstance(slot, OpSlot) and slot.mac_dropout > 0

    model = build_gpt(num_layers=2, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.1, seed=3)
    use_nn_dropout(model)
    layers = list(model.decoder.layers)
    mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": ["0-1"]}}, layers=layers)
    dup = copy.deepcopy(model)
    assert [mac.ac_state(dup).layer_cells[i] for i in (0, 1)] == list(dup.decoder.layers)
    pairs = [(a, b) for (_, a), (_, b) in zip(model.cells_and_names(), dup.cells_and_names())
             if dropout_slot(a)]
    assert len(pairs) == 6
    for orig, other in pairs:   # the copy's own proxies, around the copy's own kernels
        assert dropout_slot(other) and other.dropout is not orig.dropout
        assert other.dropout.mac_inner is not orig.dropout.mac_inner
    grad_fn = ms.value_and_grad(dup, None, dup.trainable_params())
    grad_fn(*synthetic_batch(2, 16, 64, seed=0))
    assert sum(s.recompute_calls for s in mac.ac_state(dup).recompute_stats.values()) == 2
    assert sum(s.recompute_calls for s in mac.ac_state(model).recompute_stats.values()) == 0
    mac.remove_ac(dup)
    assert all(not isinstance(b.__dict__["dropout"], OpSlot) for _, b in pairs)
    assert _library_leftovers(dup) == [] and all(dropout_slot(a) for a, _ in pairs)
