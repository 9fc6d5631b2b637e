"""Runs of the three-run lifetime check (issue 41), in a fresh process.

    python three_runs_worker.py PATTERN MODES OUT.json [real|jump]

Every step is re-seeded and fed its own batch (both by its index), so a run
depends on its own history only. ``MODES`` ``plain``: a plain model alone, all
``STEPS`` steps; ``plain_jump``: a plain model alone, the ``RECORDED`` steps
only (0, 1, 2, then 100, 101, 102: the steps in between are skipped, and the
index is the step-count-dependent state a model sees: its batch, its seed).
Otherwise a comma-separated list of modes, run in this order in this one
process, each a model under that mode, then a fresh plain model: a
``model_patterns.mode_config`` mode, ``budget`` (a ``memory_budget``), or an
API mode (``checkpoint`` / ``swap`` around every layer call, ``checkpoint_wrapper``
/ ``swap_wrapper`` on every layer, MindSpeed's ``async_save_on_cpu`` around
every layer call). With ``real`` (the default) a swap mode trains all
``STEPS`` steps (a swapped layer's state across steps is the pool's, the
prefetch queue's and whatever keeps old graphs alive: it needs the real
history); a recompute mode, whose engine keeps nothing across steps, every
mode with ``jump``, and the plain model after each train the ``RECORDED``
steps only. Each uses ``nn.SGD``; the loss, every gradient and every parameter
of the recorded steps go to ``OUT.json`` as digests (``{"plain": ...}`` or
``{"runs": [{"mode", "steps", "ac", "plain", "offloaded", "rerun",
"seconds"}, ...]}``), with what each mode did (tensors offloaded, ops re-run).
The first mode's model runs first in its process, so its record is the record
of that model alone.
"""
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402

import mindformers_ac as mac  # noqa: E402
from mindformers_ac.mindspore_compat import synchronous_pynative  # noqa: E402

from model_patterns import PATTERNS, mode_config  # noqa: E402

synchronous_pynative("CPU")
RECORDED = (0, 1, 2, 100, 101, 102)
STEPS = tuple(range(RECORDED[-1] + 1))
# modes whose engine keeps nothing across steps: they train the RECORDED steps only
RECOMPUTE_MODES = ("full", "group", "select_cell", "select_op", "exclude_op", "recompute_comm", "checkpoint_api",
                   "checkpoint_wrapper")
API_MODES = ("checkpoint_api", "checkpoint_wrapper", "swap_api", "swap_wrapper", "async_save_on_cpu")
# the budget profiles on the first five training steps, then installs its plan (swap allowed)
BUDGET = {"memory_budget": {"activations": "0.5x", "profile_steps": 5}}


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


def _layer_list(model, pattern):
    layers = model
    for name in pattern.layers.split("."):
        layers = getattr(layers, name)
    return list(layers)


def _route_layer_calls(model, run_layer):
    """The model's layer calls (its ``run_layer``) go through ``run_layer(layer, *args, **kwargs)``."""
    object.__setattr__(model, "run_layer", run_layer)


def _async_save_on_cpu(model, layers):
    def run_layer(layer, *args, **kwargs):
        if layer not in layers:   # an MTP layer after the decoder: not a block of the offloaded depth
            return layer(*args, **kwargs)
        with mac.async_save_on_cpu(block_idx=layers.index(layer), depth=len(layers), params=model):
            return layer(*args, **kwargs)
    _route_layer_calls(model, run_layer)


def _swapped_total():
    return sum(s.num_offloaded for s in mac.SwapManager().report.layers.values())


def with_ac(pattern, mode):
    """A fresh model under ``mode``; returns it and a function counting (tensors offloaded, ops re-run)
    since it was built."""
    model = pattern.build()
    layers = _layer_list(model, pattern)
    swapped_before = _swapped_total()   # the process-wide manager's count (the API modes report there)
    stats = mac.RecomputeStats()
    if mode == "swap_wrapper":
        for layer in layers:
            mac.swap_wrapper(layer)
    elif mode == "checkpoint_wrapper":
        for layer in layers:
            mac.checkpoint_wrapper(layer, stats=stats)
    elif mode == "async_save_on_cpu":
        _async_save_on_cpu(model, layers)
    elif mode == "swap_api":
        _route_layer_calls(model, lambda layer, *a, **k: mac.swap(layer, *a, **k))
    elif mode == "checkpoint_api":
        _route_layer_calls(model, lambda layer, *a, **k: mac.checkpoint(layer, *a, stats=stats, **k))
    elif mode == "budget":
        mac.apply_ac(model, config=BUDGET, layers=pattern.layers)
    else:
        mac.apply_ac(model, config=mode_config(mode, pattern), layers=pattern.layers)
    if mode in API_MODES:
        return model, lambda: (_swapped_total() - swapped_before, stats.ops_rerun)
    state = mac.ac_state(model)

    def work():
        swapped = state.swap_report.layers.values() if state.swap_report is not None else ()
        return (sum(s.num_offloaded for s in swapped), sum(s.ops_rerun for s in state.recompute_stats.values()))
    return model, work


def main(name, modes, out, history="real"):
    pattern = PATTERNS[name]
    if modes in ("plain", "plain_jump"):
        result = {"plain": train(pattern.build(), pattern.batch, STEPS if modes == "plain" else RECORDED)}
    else:
        result = {"runs": []}
        for mode in modes.split(","):
            started = time.perf_counter()
            model, work = with_ac(pattern, mode)
            jump = mode in RECOMPUTE_MODES or history == "jump"
            run = {"mode": mode, "steps": "jump" if jump else "real",
                   "ac": train(model, pattern.batch, RECORDED if jump else STEPS)}
            run["offloaded"], run["rerun"] = work()
            del model
            run["plain"] = train(pattern.build(), pattern.batch, RECORDED)
            run["seconds"] = time.perf_counter() - started
            result["runs"].append(run)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
