"""What a model leaves behind in its process once it is gone: RSS growth per model, built, trained and dropped
one after another, without AC, with layer swap and with a memory budget.

    PYTHONPATH=. python scripts/bench_model_lifetimes.py [--models 10] [--steps 8] [--hidden 256]

Each mode runs in a fresh process: it builds the reference GPT (4 layers), applies the mode, trains
``--steps`` steps (``value_and_grad`` + SGD), drops the model (``remove_ac`` is NOT called: the model just
goes out of scope) and collects garbage, ``--models`` times; the process RSS is read after each. The
growth per model is the slope over the models after the first two (MindSpore's own caches fill on the
first ones). docs/benchmarks.md records the figures; the weak-reference test of the same question is
``tests/test_budget_on_real_data.py::test_nothing_of_the_budget_or_swap_outlives_remove_ac_or_the_model``.
"""
import argparse
import gc
import json
import subprocess
import sys

MODES = {
    "without AC": None,
    "layer swap": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-2"]}]}},
    "memory budget 0.5x": {"memory_budget": {"activations": "0.5x", "profile_steps": 4}},
}


def _rss_bytes():
    with open("/proc/self/statm", encoding="ascii") as f:
        import os
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_mode(name, models, steps, hidden):
    import mindspore as ms
    from mindspore import nn

    import mindformers_ac as mac
    from mindformers_ac.harness.models import SyntheticBatches, build_gpt
    from mindformers_ac.mindspore_compat import synchronous_pynative
    synchronous_pynative()
    batches = SyntheticBatches(2, 64, 256)
    rss = []
    for _ in range(models):
        model = build_gpt(num_layers=4, hidden_size=hidden, num_heads=4, seq_length=64, vocab_size=256)
        if MODES[name] is not None:
            mac.apply_ac(model, config=MODES[name])
        opt = nn.SGD(model.trainable_params(), learning_rate=0.01)
        grad_fn = ms.value_and_grad(model, None, opt.parameters)
        for step in range(steps):
            _, grads = grad_fn(*batches(step))
            opt(grads)
        del model, opt, grad_fn, grads
        gc.collect()
        rss.append(_rss_bytes())
    return rss


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)   # the worker process
    args = parser.parse_args(argv)
    if args.mode is not None:
        print(json.dumps(one_mode(args.mode, args.models, args.steps, args.hidden)))
        return
    print(f"| mode | RSS after model 2 | after model {args.models} | growth per model (models 3-{args.models}) |")
    print("|---|---|---|---|")
    for name in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", name, "--models", str(args.models),
                              "--steps", str(args.steps), "--hidden", str(args.hidden)],
                             capture_output=True, text=True, check=True).stdout
        rss = json.loads(out.strip().splitlines()[-1])
        slope = (rss[-1] - rss[1]) / (len(rss) - 2) / 2 ** 20
        print(f"| {name} | {rss[1] / 2 ** 20:.1f} MiB | {rss[-1] / 2 ** 20:.1f} MiB | {slope:.2f} MiB |")


if __name__ == "__main__":
    main()
