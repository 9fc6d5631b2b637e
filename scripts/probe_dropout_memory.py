"""What MindSpore 2.10 keeps per dropout call on CPU, and what a call costs: the kernel forms against a host mask.

    PYTHONPATH=. python scripts/probe_dropout_memory.py [--calls 2000] [--warmup 500]

Each kind runs in a fresh process: ``--warmup`` calls, then ``--calls`` more; the RSS growth over those,
per call. Kinds: a fresh ``ops.Dropout`` per call with the same seeds and with new ones (the reference
model's former ``SeededDropout``, now ``SeededKernelDropout``), a fresh ``ops.UniformReal`` (the MoE's
router jitter), a fresh ``ops.Dropout`` built and never run, and the reference model's ``SeededDropout``
(host-drawn masks). Then the time per call of the fresh primitive and of the host mask at two
shapes, interleaved (best of two rounds of 200). docs/benchmarks.md ("What a model leaves behind") records
the figures.
"""
import argparse
import gc
import json
import subprocess
import sys
import time

SHAPE = (4, 64, 128)
KINDS = ("kernel, same seeds", "kernel, new seeds", "UniformReal", "kernel, built only", "host mask")


def _rss_mib():
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def _host_dropout():
    from mindformers_ac.harness.models import DropoutSeeds, SeededDropout
    cell = SeededDropout(0.1, DropoutSeeds(7))
    cell.set_train(True)
    return cell


def _call(kind, x, i, host_dropout):
    from mindspore import ops
    if kind == "kernel, same seeds":
        return ops.Dropout(0.9, 7, 1)(x)[0]
    if kind == "kernel, new seeds":
        return ops.Dropout(0.9, 7, i + 1)(x)[0]
    if kind == "UniformReal":
        return ops.UniformReal(7, i + 1)(x.shape)
    if kind == "kernel, built only":
        return ops.Dropout(0.9, 7, i + 1)
    host_dropout.seeds.step = i
    return host_dropout(x)


def one_kind(kind, calls, warmup):
    import numpy as np
    from mindspore import Tensor
    x, cell = Tensor(np.ones(SHAPE, np.float32)), _host_dropout()
    for i in range(warmup):
        _call(kind, x, i, cell)
    gc.collect()
    before = _rss_mib()
    for i in range(warmup, warmup + calls):
        _call(kind, x, i, cell)
    gc.collect()
    return (_rss_mib() - before) * 1024 / calls


def call_times():
    import numpy as np
    from mindspore import Tensor
    print("| shape | fresh ops.Dropout | host mask |\n|---|---|---|")
    cell = _host_dropout()
    for shape in [(2, 4, 32, 32), (4, 4, 128, 128)]:
        x = Tensor(np.ones(shape, np.float32))
        best = {}
        for _ in range(2):
            for kind in ("kernel, new seeds", "host mask"):
                start = time.perf_counter()
                for i in range(200):
                    y = _call(kind, x, i, cell)
                y.asnumpy()
                t = (time.perf_counter() - start) / 200 * 1e3
                best[kind] = min(t, best.get(kind, t))
        print(f"| {shape} | {best['kernel, new seeds']:.2f} ms | {best['host mask']:.2f} ms |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--kind", default=None, help=argparse.SUPPRESS)   # the worker process
    a = p.parse_args()
    from mindformers_ac.mindspore_compat import synchronous_pynative
    synchronous_pynative()   # as the harness trains: each op done before the next starts
    if a.kind is not None:
        print(json.dumps(one_kind(a.kind, a.calls, a.warmup)))
        return
    print(f"RSS growth per call on a {SHAPE} input, {a.calls} calls after {a.warmup}, one process per kind")
    print("| kind | KiB per call |\n|---|---|")
    for kind in KINDS:
        out = subprocess.run([sys.executable, __file__, "--calls", str(a.calls), "--warmup", str(a.warmup),
                              "--kind", kind], capture_output=True, text=True, check=True).stdout
        print(f"| {kind} | {json.loads(out.strip().splitlines()[-1]):.1f} |")
    call_times()


if __name__ == "__main__":
    main()
