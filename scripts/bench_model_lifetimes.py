"""What a model leaves behind in its process once it is gone: RSS growth per model, built, trained and dropped
one after another, without AC, with full recompute, with layer swap and with a memory budget.

    PYTHONPATH=. python scripts/bench_model_lifetimes.py [--models 10] [--steps 8] [--hidden 256]
        [--dropout seeded|kernel|nn|off] [--optimizer sgd|assign] [--remove-ac]

Each mode runs in a fresh process: it builds the reference GPT (4 layers), applies the mode, trains
``--steps`` steps (``value_and_grad`` + the optimizer), drops the model (the model just goes out of scope,
or ``remove_ac`` first with ``--remove-ac``) and collects garbage, ``--models`` times; the process RSS is
read after each. The growth per model is the slope over the models after the first two (MindSpore's own
caches fill on the first ones, and modules imported on first use create their singletons). The worker also
counts, after each model, the Python objects of mindformers_ac's classes and the Parameters the collector
still finds, and prints how many more of each a model leaves (same slope): no object of mindformers_ac is
the goal; a model's Parameters stay with ``nn.SGD`` (its ``@jit`` construct's compiled graph keeps the
optimizer cell, so its parameters and the model's, for the life of the process), not with ``assign``.

``--dropout``: ``seeded`` is the reference model's ``SeededDropout`` (masks drawn on the host: no kernel
state), ``kernel`` its former ``SeededKernelDropout`` (a fresh ``ops.Dropout`` primitive per call, which
MindSpore 2.10 keeps about 62 KiB of for good on CPU; a recomputed layer calls it twice), ``nn`` is
MindSpore's ``nn.Dropout`` (one primitive per cell), ``off`` is p=0. ``--optimizer assign`` steps
with ``ops.assign(p, p - lr * g)`` instead of ``nn.SGD`` (whose ``@jit`` graph keeps every model alive).
docs/benchmarks.md records the figures; the weak-reference tests of the same question are in
``tests/test_model_lifetimes.py``.
"""
import argparse
import gc
import json
import os
import subprocess
import sys

from mindformers_ac.harness.models import DROPOUT_KINDS

MODES = {
    "without AC": None,
    "full recompute 0-3": {"recompute": {"mode": "full", "full_recompute_layer": ["0-3"]}},
    "layer swap 0-2": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-2"]}]}},
    "memory budget 0.5x": {"memory_budget": {"activations": "0.5x", "profile_steps": 4}},
}


def _rss_bytes():
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _alive_counts():
    """(objects of mindformers_ac's classes, Parameters) the collector still finds."""
    from mindspore import Parameter
    ours = params = 0
    for obj in gc.get_objects():
        kind = type(obj)   # type(), not isinstance: a dead weakref.proxy raises on isinstance
        if str(getattr(kind, "__module__", "")).startswith("mindformers_ac"):
            ours += 1
        elif issubclass(kind, Parameter):
            params += 1
    return ours, params


def _step_fn(model, optimizer):
    import mindspore as ms
    from mindspore import nn, ops
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, params)
    if optimizer == "sgd":
        opt = nn.SGD(params, learning_rate=0.01)
    else:
        def opt(grads):   # no @jit graph: nothing of MindSpore's holds the parameters after the step
            for p, g in zip(params, grads):
                ops.assign(p, p - 0.01 * g)

    def step(batch):
        _, grads = grad_fn(*batch)
        opt(grads)
    return step


def one_mode(name, args):
    import mindformers_ac as mac
    from mindformers_ac.harness.models import SyntheticBatches, build_gpt, use_dropout
    from mindformers_ac.mindspore_compat import synchronous_pynative
    synchronous_pynative()
    batches = SyntheticBatches(2, 64, 256)
    rss, alive = [], []
    for _ in range(args.models):
        model = build_gpt(num_layers=4, hidden_size=args.hidden, num_heads=4, seq_length=64, vocab_size=256,
                          dropout=0.0 if args.dropout == "off" else 0.1)
        if args.dropout != "off":
            use_dropout(model, args.dropout)
        if MODES[name] is not None:
            mac.apply_ac(model, config=MODES[name])
        step = _step_fn(model, args.optimizer)
        for k in range(args.steps):
            step(batches(k))
        if args.remove_ac and MODES[name] is not None:
            mac.remove_ac(model)
        del model, step
        gc.collect()
        rss.append(_rss_bytes())
        alive.append(_alive_counts())
    return {"rss": rss, "alive": alive}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dropout", choices=(*DROPOUT_KINDS, "off"), default="seeded")
    parser.add_argument("--optimizer", choices=("sgd", "assign"), default="sgd")
    parser.add_argument("--remove-ac", action="store_true", help="call remove_ac before dropping each model")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes")
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)   # the worker process
    args = parser.parse_args(argv)
    if args.mode is not None:
        print(json.dumps(one_mode(args.mode, args)))
        return
    forwarded = list(argv if argv is not None else sys.argv[1:])
    print(f"dropout {args.dropout}, optimizer {args.optimizer}{', remove_ac' if args.remove_ac else ''}; "
          f"{args.models} models of {args.steps} steps each, one process per mode")
    print(f"| mode | RSS after model 2 | after model {args.models} | growth per model (models 3-{args.models}) "
          f"| vs without AC | mindformers_ac objects left per model | Parameters left per model |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for name in args.modes.split(","):
        out = subprocess.run([sys.executable, __file__, *forwarded, "--mode", name],
                             capture_output=True, text=True, check=True).stdout
        record = json.loads(out.strip().splitlines()[-1])
        rss, alive = record["rss"], record["alive"]
        slope = (rss[-1] - rss[1]) / (len(rss) - 2) / 2 ** 20
        ours, params = ((alive[-1][i] - alive[1][i]) / (len(alive) - 2) for i in (0, 1))
        base = slope if base is None and MODES[name] is None else base
        delta = "" if base is None or MODES[name] is None else f"{slope - base:+.2f} MiB"
        print(f"| {name} | {rss[1] / 2 ** 20:.1f} MiB | {rss[-1] / 2 ** 20:.1f} MiB | {slope:.2f} MiB | {delta} "
              f"| {ours:g} | {params:g} |", flush=True)


if __name__ == "__main__":
    main()
