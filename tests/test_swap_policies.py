"""Swap decisions that must move bytes (issue 38, point 3).

* ``MUST_SWAP`` under ``checkpoint`` with no ``swap_executor`` swaps through
  ``SwapManager``'s executor: HyperParallel's recipe
  (``checkpoint(layer, x, policy_fn=..., swap_inputs=True)``, layers linked by
  ``SwapManager``; its test tests/torch/activation_checkpoint/
  test_activation_checkpoint_swap.py expects a swap policy to keep about what
  recompute keeps on the device) keeps within 1.5x of full recompute's device
  bytes on a small attention block.
* ``async_save_on_cpu(custom_check_fn=f)``: ``f`` returning True offloads
  whatever the size, as PyTorch's ``save_on_cpu`` moves every saved tensor
  (test/test_autograd.py, TestAutograd.test_save_on_cpu_and_checkpoint).
"""
import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

import mindformers_ac as mac
from mindformers_ac.checkpoint_policy import CheckpointPolicy

DIM, SEQ, BATCH = 32, 16, 2


def _dense(seed, n_in, n_out):
    fc = mint.nn.Linear(n_in, n_out, bias=False)
    fc.weight.set_data(Tensor(np.random.RandomState(seed).uniform(-0.3, 0.3, (n_out, n_in)).astype(np.float32)))
    return fc


class AttentionBlock(nn.Cell):
    def __init__(self, seed):
        super().__init__()
        self.qkv = _dense(seed, DIM, 3 * DIM)
        self.out = _dense(seed + 1, DIM, DIM)
        self.up = _dense(seed + 2, DIM, 2 * DIM)
        self.down = _dense(seed + 3, 2 * DIM, DIM)

    def construct(self, x):
        q, k, v = mint.split(self.qkv(x), DIM, dim=-1)
        probs = mint.nn.functional.softmax(mint.matmul(q, k.transpose(0, 2, 1)) * DIM ** -0.5, dim=-1)
        h = x + self.out(mint.matmul(probs, v))
        return h + self.down(ops.silu(self.up(h)))


class Model(nn.Cell):
    def __init__(self, run_layer):
        super().__init__()
        self.layers = nn.CellList([AttentionBlock(10 * i) for i in range(3)])
        self.run_layer = run_layer

    def construct(self, x):
        for layer in self.layers:
            x = self.run_layer(layer, x)
        return (x * x).mean()


X = Tensor(np.random.RandomState(7).randn(BATCH, SEQ, DIM).astype(np.float32))


def swap_matmuls(ctx, op, *args, **kwargs):
    # HyperParallel's guide: MUST_SWAP offloads the op's output to host, MUST_RECOMPUTE rebuilds it
    return CheckpointPolicy.MUST_SWAP if "MatMul" in ctx.op_name else CheckpointPolicy.MUST_RECOMPUTE


def _step(run_layer):
    model = Model(run_layer)
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(model, None, params)(X)
    return [loss.asnumpy().tobytes()] + [g.asnumpy().tobytes() for g in grads], model


def test_must_swap_under_checkpoint_swaps_through_the_swap_manager(fresh_swap_manager):
    expected, _ = _step(lambda layer, x: layer(x))
    recompute, swapped = mac.RecomputeStats(), mac.RecomputeStats()

    got_recompute, _ = _step(lambda layer, x: mac.checkpoint(layer, x, stats=recompute))
    kept_recompute = recompute.peak_kept_bytes

    def linked(layer, x):
        return mac.checkpoint(layer, x, policy_fn=swap_matmuls, swap_inputs=True, stats=swapped)
    model = Model(linked)
    for i in range(len(model.layers) - 1):
        mac.SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    loss, grads = ms.value_and_grad(model, None, model.trainable_params())(X)
    got_swap = [loss.asnumpy().tobytes()] + [g.asnumpy().tobytes() for g in grads]

    assert got_recompute == expected and got_swap == expected
    assert swapped.peak_kept_bytes <= 1.5 * kept_recompute, (swapped.peak_kept_bytes, kept_recompute)
    report = mac.SwapManager().report.as_dict()
    assert report["offloaded_bytes"] > 0
    # the two linked layers count under their keys; the last one (linked to none) under "checkpoint"
    assert len([k for k, v in report["layers"].items() if v["offloaded_bytes"] > 0]) == 3
    assert swapped.ops_reused > 0   # the swapped MatMuls' outputs came back instead of being re-run


class Tiny(nn.Cell):
    def __init__(self, seed):
        super().__init__()
        self.fc = _dense(seed, 4, 4)

    def construct(self, x):
        return ops.sin(ops.exp(self.fc(x)))


def test_custom_check_fn_true_offloads_whatever_the_size(fresh_swap_manager):
    blocks = [Tiny(1), Tiny(2)]
    x = Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))

    def forward(v, offload):
        for i, block in enumerate(blocks):
            if offload:
                with mac.async_save_on_cpu(block_idx=i, depth=3, custom_check_fn=lambda t: True, params=block):
                    v = block(v)
            else:
                v = block(v)
        return v.sum()

    params = [p for b in blocks for p in b.trainable_params()]
    expected = ms.grad(lambda v: forward(v, False), 0, params)(x)
    got = ms.grad(lambda v: forward(v, True), 0, params)(x)
    assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(expected[1], got[1]))
    layers = mac.SwapManager().report.as_dict()["layers"]
    for i in range(2):
        stats = layers[("async_save_on_cpu", i)]
        # every tensor saved in the block is 32 bytes, far under min_bytes (1 KiB): all offloaded anyway
        assert stats["num_offloaded"] >= 2 and stats["kept_reasons"].get("small", 0) == 0, stats
