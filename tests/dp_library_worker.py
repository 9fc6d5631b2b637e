"""Under msrun (2 ranks): the library needs nothing data-parallel. A PyNative loop with MindSpore's own
reducer (``nn.DistributedGradReducer`` after ``set_auto_parallel_context(DATA_PARALLEL)``), each rank on its own
batches, trained without AC and with AC applied

* ``before_reducer``: ``apply_ac`` first, the reducer built from the model's parameters after;
* ``after_reducer``: the reducer built first, then ``apply_ac`` on the model its parameters come from;
* ``accumulation``: two microbatches per step, their gradients summed before the reduce.

    dp_library_worker.py OUT_DIR   -> OUT_DIR/rank{r}.json: {scenario: {"equal": bool, "rerun": n, "offloaded": n}}
"""
import json
import os
import sys

import mindspore as ms
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

import mindformers_ac as mac
from mindformers_ac.harness.models import SyntheticBatches, build_gpt
from mindformers_ac.mindspore_compat import synchronous_pynative

CONFIG = {"recompute": {"mode": "full", "full_recompute_layer": ["0-1"], "group_layers": 2},
          "swap": {"enable": True, "layer_swap": [{"layers": [2]}]}}
STEPS = 2


def _model():
    return build_gpt(num_layers=4, hidden_size=16, num_heads=2, seq_length=8, vocab_size=64, dropout=0.1, seed=5)


def train(rank, scenario, with_ac):
    """Per step: loss, every averaged gradient and every parameter, as bytes; and what AC did."""
    model = _model()
    batches = SyntheticBatches(2, 8, 64, seed=100 + 1000 * rank)   # each rank its own batches
    if with_ac and scenario != "after_reducer":
        mac.apply_ac(model, config=CONFIG)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    reducer = nn.DistributedGradReducer(opt.parameters, mean=True, degree=get_group_size())
    if with_ac and scenario == "after_reducer":
        mac.apply_ac(model, config=CONFIG)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history = []
    for step in range(STEPS):
        if scenario == "accumulation":
            (loss, grads), (_, more) = grad_fn(*batches(2 * step)), grad_fn(*batches(2 * step + 1))
            grads = tuple(a + b for a, b in zip(grads, more))
        else:
            loss, grads = grad_fn(*batches(step))
        grads = reducer(grads)
        opt(grads)
        history.append((loss.asnumpy().tobytes(), [g.asnumpy().tobytes() for g in grads],
                        [p.asnumpy().tobytes() for p in model.get_parameters()]))
    state = mac.ac_state(model)
    rerun = sum(s.ops_rerun for s in state.recompute_stats.values()) if state else 0
    offloaded = sum(s.num_offloaded for s in state.swap_report.layers.values()) if state and state.swap_report else 0
    return history, rerun, offloaded


def main(out_dir):
    synchronous_pynative("CPU")
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=2)
    init()
    rank = get_rank()
    results = {}
    for scenario in ("before_reducer", "after_reducer", "accumulation"):
        base, _, _ = train(rank, scenario, False)
        ac, rerun, offloaded = train(rank, scenario, True)
        results[scenario] = {"equal": base == ac, "rerun": rerun, "offloaded": offloaded,
                             "grad_digest_step1": [g[:16].hex() for g in base[0][1][:2]]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
