"""apply_ac and remove_ac are all or nothing for every BaseException (Ctrl-C, SystemExit) too.

The interrupts are injected from inside an installer or an undo (monkeypatched
module functions), so no backward runs and the tests stay in process.
"""
import pytest

import mindformers_ac as mac
import mindformers_ac.actions.layer_swap as layer_swap_module
import mindformers_ac.actions.op_swap as op_swap_module
import mindformers_ac.actions.region as region_module
from mindformers_ac.actions import FullRecompute, SelectRecompute
from mindformers_ac.harness.models import build_gpt

from conftest import model_fingerprint

CONFIGS = {
    "select_then_swap": {"recompute": {"mode": "select", "select_module": {".*mlp": [0, 3],
                                                                           r"mlp\.activation_func": [1]}},
                         "swap": {"enable": True, "layer_swap": [{"layers": [2]}],
                                  "op_swap": [{"op_name": ".*attention", "layers": [1]}]}},
    "full_and_policy": {"recompute": {"mode": "full", "full_recompute_layer": ["0-3"],
                                      "exclude_op": {r".*core_attention": ["0-3"]}}},
}
RECOMPUTE_ACTION = {"select_then_swap": SelectRecompute, "full_and_policy": FullRecompute}
SWAP_INSTALLERS = {"install_layer_swap": layer_swap_module, "install_op_swap": op_swap_module}


def make_model():
    return build_gpt(num_layers=4, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.1, seed=3)


def _raise_on_call(monkeypatch, owner, name, exc, at):
    """Make ``owner.<name>`` (a module's function, or a class's method) raise ``exc`` on its calls numbered in
    ``at`` (1-based); count all calls."""
    real, calls = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) in at:
            raise exc("injected")
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, wrapper)
    return calls


def _assert_reusable(model, before, config):
    assert model_fingerprint(model) == before and mac.ac_state(model) is None
    mac.apply_ac(model, config=config)
    assert mac.ac_state(model) is not None
    mac.remove_ac(model)
    assert model_fingerprint(model) == before


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_interrupt_in_the_middle_of_installing_leaves_the_model_untouched(monkeypatch, config, exc):
    model = make_model()
    before = model_fingerprint(model)
    # The third layer's recompute: two layers are patched already when it fires.
    calls = _raise_on_call(monkeypatch, RECOMPUTE_ACTION[config], "install", exc, at={3})
    with pytest.raises(exc, match="injected"):
        mac.apply_ac(model, config=CONFIGS[config])
    assert len(calls) == 3
    monkeypatch.undo()
    _assert_reusable(model, before, CONFIGS[config])


@pytest.mark.parametrize("installer", ["install_layer_swap", "install_op_swap"])
def test_interrupt_in_a_swap_installer_after_recompute_is_installed(monkeypatch, installer):
    model = make_model()
    before = model_fingerprint(model)
    _raise_on_call(monkeypatch, SWAP_INSTALLERS[installer], installer, KeyboardInterrupt, at={1})
    with pytest.raises(KeyboardInterrupt):
        mac.apply_ac(model, config=CONFIGS["select_then_swap"])
    monkeypatch.undo()
    _assert_reusable(model, before, CONFIGS["select_then_swap"])


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_interrupt_while_removing_still_restores_everything(monkeypatch, config):
    model = make_model()
    before = model_fingerprint(model)
    mac.apply_ac(model, config=CONFIGS[config])
    calls = _raise_on_call(monkeypatch, region_module, "unwrap", KeyboardInterrupt, at={1})
    with pytest.raises(KeyboardInterrupt, match="injected"):
        mac.remove_ac(model)
    assert len(calls) >= 2   # the interrupted undo ran again, and the others ran too
    monkeypatch.undo()
    _assert_reusable(model, before, CONFIGS[config])


def test_undo_interrupted_twice_stays_pending_and_a_second_remove_finishes(monkeypatch):
    model = make_model()
    before = model_fingerprint(model)
    mac.apply_ac(model, config=CONFIGS["full_and_policy"])
    _raise_on_call(monkeypatch, region_module, "unwrap", KeyboardInterrupt, at={1, 2})
    with pytest.raises(KeyboardInterrupt):
        mac.remove_ac(model)
    state = mac.ac_state(model)
    assert state is not None and state.pending == 1   # only the twice-interrupted layer is left
    assert model_fingerprint(model) != before
    monkeypatch.undo()
    mac.remove_ac(model)
    _assert_reusable(model, before, CONFIGS["full_and_policy"])


def test_rollback_interrupted_twice_attaches_the_state_so_remove_ac_can_finish(monkeypatch):
    model = make_model()
    before = model_fingerprint(model)
    _raise_on_call(monkeypatch, FullRecompute, "install", KeyboardInterrupt, at={3})
    _raise_on_call(monkeypatch, region_module, "unwrap", KeyboardInterrupt, at={1, 2})
    with pytest.raises(KeyboardInterrupt):
        mac.apply_ac(model, config=CONFIGS["full_and_policy"])
    assert mac.ac_state(model).pending == 1
    monkeypatch.undo()
    mac.remove_ac(model)
    _assert_reusable(model, before, CONFIGS["full_and_policy"])
