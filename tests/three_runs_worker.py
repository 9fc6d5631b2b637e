"""One run of the three-run lifetime check (issue 41), in a fresh process.

    python three_runs_worker.py PATTERN MODE OUT.json

Every step is re-seeded and fed its own batch (both by its index), so a run
depends on its own history only. ``MODE`` ``plain``: a plain model alone, all
``STEPS`` steps; ``plain_jump``: a plain model alone, the ``RECORDED`` steps
only (0, 1, 2, then 100, 101, 102: the steps in between are skipped, and the
index is the step-count-dependent state a model sees: its batch, its seed).
Any other mode: a model under that mode (a ``model_patterns.mode_config``
mode, ``swap_wrapper`` on every layer, or MindSpeed's ``async_save_on_cpu``
around every layer call), then a fresh plain model, in this one process. A
swap mode trains all ``STEPS`` steps (a swapped layer's state across steps is
the pool's, the prefetch queue's and whatever keeps old graphs alive: it needs
the real history); a recompute mode, whose engine keeps nothing across steps,
and the plain model after it train the ``RECORDED`` steps only. Each uses
``nn.SGD``; the loss, every gradient and every parameter of the recorded
steps go to ``OUT.json`` as digests (``{"ac": ..., "plain": ...}``), with what
the mode did (tensors offloaded, ops re-run). The AC model runs first in its
process, so its record is the record of that model alone.
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402

import mindformers_ac as mac  # noqa: E402
from mindformers_ac.mindspore_compat import synchronous_pynative  # noqa: E402

from model_patterns import PATTERNS, mode_config  # noqa: E402

synchronous_pynative("CPU")
RECORDED = (0, 1, 2, 100, 101, 102)
STEPS = tuple(range(RECORDED[-1] + 1))
RECOMPUTE_MODES = ("full", "group", "select_cell", "select_op", "exclude_op", "recompute_comm")


def _digest(tensor):
    return hashlib.sha1(tensor.asnumpy().tobytes()).hexdigest()


def train(model, batch, steps):
    """``{step: [(what, digest), ...]}`` of the recorded steps, training ``steps`` (step indices)."""
    model.set_train(True)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    record = {}
    for step in steps:
        ms.set_seed(step)
        loss, grads = grad_fn(*batch(step))
        opt(grads)
        if step in RECORDED:
            record[step] = ([("loss", _digest(loss))]
                            + [(f"grad {p.name}", _digest(g)) for p, g in zip(opt.parameters, grads)]
                            + [(name, _digest(p)) for name, p in model.parameters_and_names()])
    return record


def _async_save_on_cpu(model):
    depth = len(model.layers)

    def run_layer(layer, *args, **kwargs):
        with mac.async_save_on_cpu(block_idx=list(model.layers).index(layer), depth=depth, params=model):
            return layer(*args, **kwargs)
    object.__setattr__(model, "run_layer", run_layer)


def with_ac(pattern, mode):
    """A fresh model under ``mode``; returns it and a function counting (tensors offloaded, ops re-run)."""
    model = pattern.build()
    layers = model
    for name in pattern.layers.split("."):
        layers = getattr(layers, name)
    if mode == "swap_wrapper":
        for layer in layers:
            mac.swap_wrapper(layer)
    elif mode == "async_save_on_cpu":
        _async_save_on_cpu(model)
    else:
        mac.apply_ac(model, config=mode_config(mode, pattern), layers=pattern.layers)
    if mode in ("swap_wrapper", "async_save_on_cpu"):
        report = mac.SwapManager().report
        return model, lambda: (sum(s.num_offloaded for s in report.layers.values()), 0)
    state = mac.ac_state(model)
    swapped = state.swap_report.layers.values() if state.swap_report is not None else ()
    return model, lambda: (sum(s.num_offloaded for s in swapped),
                           sum(s.ops_rerun for s in state.recompute_stats.values()))


def main(name, mode, out):
    pattern = PATTERNS[name]
    result = {}
    if mode not in ("plain", "plain_jump"):
        model, work = with_ac(pattern, mode)
        result["ac"] = train(model, pattern.batch, RECORDED if mode in RECOMPUTE_MODES else STEPS)
        result["offloaded"], result["rerun"] = work()
        del model
    result["plain"] = train(pattern.build(), pattern.batch, STEPS if mode == "plain" else RECORDED)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
