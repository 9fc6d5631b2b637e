"""PyTorch's and HyperParallel's checkpoint keywords, and policies checked when given (issue 38, points 4 and 8).

Every PyTorch call site passes ``use_reentrant=False``; HyperParallel's tests
pass ``preserve_rng_state``, ``determinism_check``, ``debug`` and
``early_stop``. They are taken by ``checkpoint`` / ``checkpoint_wrapper``, not
handed to the user's function; other keywords are. A bad value is a
ValueError naming the option; a policy that is not callable a TypeError
naming the argument, raised at the call, not at the first op.
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.recompute import exclude_policy, get_checkpoint_stats, is_checkpoint_wrapped

X = Tensor(np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4))


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(4, 4)
        self.fc.weight.set_data(Tensor(np.linspace(-0.5, 0.5, 16, dtype=np.float32).reshape(4, 4)))
        self.fc.bias.set_data(Tensor(np.linspace(-0.2, 0.2, 4, dtype=np.float32)))

    def construct(self, x, scale=1.0):
        return ops.sin(ops.exp(self.fc(x))) * scale


def _grads(fn):
    block = Block()
    return [g.asnumpy() for g in ms.grad(lambda x: fn(block, x).sum(), 0, block.trainable_params())(X)[1]]


# Ported from HyperParallel tests/torch/activation_checkpoint/checkpoint_cases.py,
# TestCheckpoint.test_invalid_checkpoint_options_raise (debug=True is accepted here: see test_debug_is_accepted)
@pytest.mark.parametrize("option, value, words", [
    ("use_reentrant", True, "use_reentrant=True is not supported: this checkpoint is non-reentrant"),
    ("use_reentrant", 0, "use_reentrant must be False"),
    ("early_stop", 1, "early_stop must be True or False, got int 1"),
    ("preserve_rng_state", 1, "preserve_rng_state must be True or False, got int 1"),
    ("determinism_check", "invalid", "determinism_check must be one of 'default', 'none', got 'invalid'"),
    ("debug", "yes", "debug must be True or False"),
])
@pytest.mark.parametrize("api", ["checkpoint", "checkpoint_wrapper"])
def test_a_bad_option_is_a_value_error_naming_it(api, option, value, words):
    block = Block()
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as info:
        if api == "checkpoint":
            mac.checkpoint(block, X, **{option: value})
        else:
            mac.checkpoint_wrapper(block, **{option: value})
    assert str(info.value).startswith(f"{api}: ")
    assert not is_checkpoint_wrapped(block)   # a rejected wrapper leaves the cell as it was


# Ported from PyTorch test/test_autograd.py TestCheckpoint (every non-reentrant case passes
# use_reentrant=False) and HyperParallel's TestCheckpoint.test_function_keyword_arguments_are_forwarded.
def test_torch_options_are_taken_and_other_keywords_reach_the_function():
    stats = mac.RecomputeStats()
    expected = _grads(lambda b, x: b(x, scale=3.0))
    got = _grads(lambda b, x: mac.checkpoint(b, x, use_reentrant=False, preserve_rng_state=True,
                                             determinism_check="none", early_stop=False, scale=3.0, stats=stats))
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    assert stats.recompute_calls == 1 and stats.ops_rerun > 0


def test_checkpoint_wrapper_takes_the_torch_options():
    block = Block()
    mac.checkpoint_wrapper(block, use_reentrant=False, preserve_rng_state=False, determinism_check="default",
                           early_stop=True)
    got = [g.asnumpy() for g in ms.grad(lambda x: block(x, scale=3.0).sum(), 0, block.trainable_params())(X)[1]]
    expected = _grads(lambda b, x: b(x, scale=3.0))
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    assert get_checkpoint_stats(block).recompute_calls == 1


def test_a_policy_that_is_not_callable_is_refused_at_the_call():
    block = Block()
    with pytest.raises(TypeError, match=r"checkpoint: policy_fn must be a callable \(ctx, op, \*args, \*\*kwargs\) "
                                        r"-> CheckpointPolicy or None, got int 2"):
        mac.checkpoint(block, X, policy_fn=2)   # without grad recording: no op would ever ask it
    with pytest.raises(TypeError, match="checkpoint_wrapper: policy_fn must be a callable"):
        mac.checkpoint_wrapper(block, policy_fn="MatMul")
    assert not is_checkpoint_wrapped(block)
    with pytest.raises(TypeError, match=r"swap: policy_fn must be a callable \(tensor\) -> CheckpointPolicy"):
        mac.swap(block, X, policy_fn=2)
    with pytest.raises(TypeError, match="swap_wrapper: policy_fn must be a callable"):
        mac.swap_wrapper(block, policy_fn=2)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(names=[2]), TypeError, r"exclude_policy\(names=...\): item 0 must be a string \(an op name\), got int 2"),
    (dict(names="MatMul"), TypeError, r"not a string: write names=\['MatMul'\]"),
    (dict(names=5), TypeError, r"takes a list of strings, got int 5"),
    (dict(path_patterns=["attn", None]), TypeError, r"path_patterns=...\): item 1 must be a string"),
    (dict(path_patterns=["("]), ValueError, r"'\(' is not a valid regex"),
    (dict(base_policy=3), TypeError, r"base_policy must be a callable"),
])
def test_exclude_policy_names_the_bad_argument(kwargs, error, words):
    with pytest.raises(error, match=words):
        exclude_policy(**kwargs)


def test_exclude_policy_takes_any_iterable_of_names():
    policy = exclude_policy(names=(n for n in ["MatMul", "Softmax"]), path_patterns=iter([r"attn\..*"]))
    assert policy.exclude_names == ("matmul", "softmax")
    assert policy.exclude_patterns == (r"attn\..*",)
