"""``swap.min_bytes``, ``swap.max_host_bytes`` and ``swap.backend``: validated with a field-named
``ConfigError`` before anything is touched, shown by the plan, and acted on by the executor
``apply_ac`` builds (bitwise exactness of swap itself is the pattern matrix's)."""
import pytest

import mindformers_ac as mac
from mindformers_ac.harness.models import build_gpt, synthetic_batch

from conftest import model_fingerprint
from steps import first_difference, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")

GPT = dict(num_layers=4, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.0)


def _config(**settings):
    return {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}], **settings}}


def _batch(step):
    return synthetic_batch(2, 16, 64, seed=step)


@pytest.mark.parametrize("settings, field, expected", [
    ({"min_bytes": -1}, "swap.min_bytes", "expected a number of bytes"),
    ({"min_bytes": "1KiB"}, "swap.min_bytes", "expected a number of bytes"),
    ({"min_bytes": True}, "swap.min_bytes", "expected a number of bytes"),
    ({"max_host_bytes": -5}, "swap.max_host_bytes", "or null"),
    ({"max_host_bytes": 1 << 60}, "swap.max_host_bytes", "from 0 to"),
    ({"backend": "gpu"}, "swap.backend", "expected one of auto, host, device"),
    ({"backend": None}, "swap.backend", "expected one of auto, host, device"),
])
def test_bad_settings_name_the_field_and_touch_nothing(settings, field, expected):
    model = build_gpt(**GPT)
    before = model_fingerprint(model)
    with pytest.raises(mac.ConfigError, match=expected) as err:
        mac.apply_ac(model, config=_config(**settings))
    assert err.value.field == field
    assert model_fingerprint(model) == before and mac.ac_state(model) is None


def test_a_device_backend_on_cpu_is_refused_before_anything_is_touched():
    model = build_gpt(**GPT)
    before = model_fingerprint(model)
    with pytest.raises(mac.ConfigError, match="device_target is CPU: use auto or host") as err:
        mac.apply_ac(model, config=_config(backend="device"))
    assert err.value.field == "swap.backend"
    assert model_fingerprint(model) == before and mac.ac_state(model) is None


def test_the_settings_reach_the_executor_and_the_plan_table():
    model = build_gpt(**GPT)
    config = _config(min_bytes=4096, max_host_bytes=1 << 24, backend="host")
    assert "Swap settings: min_bytes 4096, max_host_bytes 16777216, backend host" in str(mac.plan_ac(model, config=config))
    mac.apply_ac(model, config=config)
    ex = mac.ac_state(model).swap_executor
    assert ex.backend.name == "host" and ex.pool.max_bytes == 1 << 24
    mac.remove_ac(model)
    assert "max_host_bytes none (no bound), backend auto" in str(mac.plan_ac(model, config=_config()))


def _offloads(min_bytes=None, max_host_bytes=None):
    settings = {k: v for k, v in (("min_bytes", min_bytes), ("max_host_bytes", max_host_bytes)) if v is not None}
    model = build_gpt(**GPT)
    mac.apply_ac(model, config=_config(**settings))
    history = run_steps(model, _batch, steps=2)
    layers = mac.ac_state(model).swap_report.layers
    return history, {i: layers[i].as_dict() for i in (0, 1)}


def test_min_bytes_and_max_host_bytes_decide_what_is_moved():
    base = run_steps(build_gpt(**GPT), _batch, steps=2)
    history, default = _offloads()
    assert first_difference(base, history) is None
    history, everything = _offloads(min_bytes=0)
    assert first_difference(base, history) is None
    history, nothing = _offloads(min_bytes=1 << 30)
    assert first_difference(base, history) is None
    history, bounded = _offloads(max_host_bytes=0)
    assert first_difference(base, history) is None
    for i in (0, 1):
        assert everything[i]["num_offloaded"] > default[i]["num_offloaded"] > 0
        assert nothing[i]["num_offloaded"] == 0 and nothing[i]["kept_reasons"]["small"] > 0
        assert bounded[i]["num_offloaded"] == 0 and bounded[i]["over_budget_bytes"] > 0
    assert default[0]["kept_reasons"].get("small", 0) > 0   # the default moves no tensor under 1 KiB
