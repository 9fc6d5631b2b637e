"""The exactness verdict of `train`: digests of the whole training state, and telling AC from the model."""
import copy

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from mindformers_ac.harness.exactness import (
    first_difference,
    judge,
    record_initial_state,
    record_step,
    tensor_digest,
    verdict_line,
)

HEAD = "losses, gradients and all parameters bitwise equal in every step: "


def fake_record(steps=3, params=("w", "bn.moving_mean", "counter"), grads=("w",)):
    """A record as run_variant writes it, with distinct digests for every part."""
    return {"param_names": list(params), "grad_names": list(grads),
            "initial_param_digests": [f"init-{p}" for p in params],
            "loss_digests": [f"loss-{k}" for k in range(steps)],
            "grad_digests": [[f"grad-{k}-{g}" for g in grads] for k in range(steps)],
            "param_digests": [[f"param-{k}-{p}" for p in params] for k in range(steps)]}


def changed(record, key, step, index=None):
    other = copy.deepcopy(record)
    if index is None:
        other[key][step] += "'"
    else:
        other[key][step][index] += "'"
    return other


def test_equal_runs_need_no_second_run():
    calls = []
    summary, again = judge(fake_record(), fake_record(), lambda: calls.append(1))
    assert summary["verdict"] == "equal" and again is None and calls == []
    assert summary["losses_match_bitwise"] and summary["grads_match_bitwise"] and summary["params_match_bitwise"]
    assert verdict_line(summary) == HEAD + "yes"


def test_a_non_trainable_parameter_that_differs_is_named():
    base = fake_record()
    ac = changed(base, "param_digests", 1, index=1)   # moving mean after step 2; loss and gradients equal
    summary, again = judge(base, ac, fake_record)
    assert summary["losses_match_bitwise"] and summary["grads_match_bitwise"]
    assert not summary["params_match_bitwise"]
    assert summary["first_difference"] == {"step": 2, "what": "parameter", "name": "bn.moving_mean"}
    assert summary["verdict"] == "ac" and again == fake_record()
    assert verdict_line(summary) == HEAD + ("NO: with AC the run first differs in parameter 'bn.moving_mean' after "
                                            "step 2, where two runs without AC agree, so AC caused it")


def test_the_first_difference_in_the_order_things_happen():
    base = fake_record()
    both = changed(changed(base, "param_digests", 0, index=2), "loss_digests", 1)
    assert first_difference(base, both) == {"step": 1, "what": "parameter", "name": "counter"}
    grad = changed(changed(base, "grad_digests", 2, index=0), "param_digests", 2, index=0)
    assert first_difference(base, grad) == {"step": 3, "what": "gradient", "name": "w"}
    init = changed(base, "initial_param_digests", 2)
    assert first_difference(base, init) == {"step": 0, "what": "initial parameters", "name": "counter"}
    renamed = dict(base, param_names=["w", "bn.moving_mean", "steps"])
    assert first_difference(base, renamed)["what"] == "parameter set"
    shorter = {k: (v[:2] if k.endswith("digests") and k != "initial_param_digests" else v) for k, v in base.items()}
    assert first_difference(base, shorter) == {"step": 3, "what": "loss", "name": None}


def test_the_models_own_nondeterminism_is_not_blamed_on_ac():
    base = fake_record()
    ac = changed(base, "loss_digests", 1)
    again = changed(base, "loss_digests", 1)      # without AC the model differs at the same point
    summary, second = judge(base, ac, lambda: again)
    assert summary["verdict"] == "model" and second is again and summary["baseline_rerun"]
    assert summary["model_difference"] == {"step": 2, "what": "loss", "name": None}
    assert verdict_line(summary) == HEAD + (
        "undecided: the model is not reproducible by itself: two runs without AC already differ in the loss of "
        "step 2; with AC the run matched the run without AC up to there, so AC is not the cause")
    # the model differs earlier than AC's run did: still the model
    earlier = changed(base, "grad_digests", 0, index=0)
    assert judge(base, ac, lambda: earlier)[0]["verdict"] == "model"


def test_a_difference_before_the_models_own_is_blamed_on_ac():
    base = fake_record()
    ac = changed(base, "grad_digests", 0, index=0)
    later = changed(base, "loss_digests", 2)      # the model is reproducible only up to step 3
    summary, _ = judge(base, ac, lambda: later)
    assert summary["verdict"] == "ac"
    assert verdict_line(summary).startswith(HEAD + "NO: with AC the run first differs in the gradient of 'w' in "
                                                   "step 1, where two runs without AC agree")


def test_unseeded_weights_are_explained_and_no_second_run_means_unchecked():
    base = fake_record()
    ac = changed(base, "initial_param_digests", 0)
    summary, _ = judge(base, ac, lambda: changed(base, "initial_param_digests", 0))
    assert summary["verdict"] == "model"
    assert "differ in parameter 'w' as built, before step 1 (the factory builds different weights in each " \
           "process: seed it" in verdict_line(summary)
    summary, again = judge(base, changed(base, "loss_digests", 0))
    assert summary["verdict"] == "unchecked" and again is None
    assert verdict_line(summary) == HEAD + ("NO: with AC the run first differs in the loss of step 1 (no second "
                                            "run without AC was made to rule out the model's own nondeterminism)")


class _Stateful(nn.Cell):
    """A trainable weight, BatchNorm moving statistics and a forward-time counter."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.calls = Parameter(Tensor(np.zeros((1,), np.int32)), requires_grad=False)

    def construct(self, x):
        ops.assign_add(self.calls, Tensor(np.ones((1,), np.int32)))
        return self.bn(self.dense(x)).sum()


def test_records_digest_every_parameter_trainable_or_not():
    ms.set_seed(0)
    model = _Stateful()
    model.set_train(True)
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, params)
    record = {}
    record_initial_state(record, model, [p.name for p in params])
    x = Tensor(np.arange(8, dtype=np.float32).reshape(2, 4))
    loss, grads = grad_fn(x)
    for p, g in zip(params, grads):
        p.set_data(p - 0.1 * g)
    record_step(record, model, loss, grads)
    names = record["param_names"]
    assert {"bn.moving_mean", "bn.moving_variance", "calls", "dense.weight"} <= set(names)
    assert "calls" not in record["grad_names"] and "bn.moving_mean" not in record["grad_names"]
    moved = {n for n, a, b in zip(names, record["initial_param_digests"], record["param_digests"][0]) if a != b}
    assert {"bn.moving_mean", "bn.moving_variance", "calls", "dense.weight"} <= moved
    assert tensor_digest(Tensor(np.zeros(2, np.float32))) != tensor_digest(Tensor(np.zeros(2, np.int32)))
    assert tensor_digest(Tensor(np.zeros((2, 1), np.float32))) != tensor_digest(Tensor(np.zeros(2, np.float32)))


@pytest.mark.parametrize("what, words", [
    ({"step": 4, "what": "parameter", "name": "a.b"}, "parameter 'a.b' after step 4"),
    ({"step": 2, "what": "gradient", "name": None}, "the gradients of step 2"),
])
def test_difference_wording(what, words):
    from mindformers_ac.harness.exactness import describe_difference
    assert describe_difference(what) == words
