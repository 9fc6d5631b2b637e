"""What MindSpore does, without AC, with a tensor saved for backward and written in place afterwards (rule W6s
of docs/exactness.md), and what each swap mode does with the same model.

    python scripts/probe_saved_writes.py            # the table of docs/exactness.md (W6s), one process per row

Part 1 (without AC, ``ms.grad`` of ``sum(sigmoid(a))`` with the sigmoid's output written after the sum): per
writer, whether the write changed the values and the version counter, and whether the backward refused,
read the written values, or read the old ones. Part 2: the write-cases model (layer 0 ends with a sigmoid
in its own cell, layer 1 writes its input), one step without AC and under each swap mode, bitwise or not.
Each swap row runs in its own process (a refused backward can break MindSpore's executor for the process).
"""
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

WRITERS = {
    "copy_": lambda x: x.copy_(x * 0.5),
    "add_": lambda x: x.add_(1.0),
    "mul_": lambda x: x.mul_(0.5),
    "assign_add": lambda x: __import__("mindspore").ops.assign_add(x, x * 0 + 1.0),
    "assign": lambda x: __import__("mindspore").ops.assign(x, x * 0 + 0.25),
    "setitem": lambda x: x.__setitem__((slice(None), 0), 0.0),
    "assign_value": lambda x: x.assign_value(x * 0 + 0.25),
    "set_data": lambda x: x.set_data(x * 0 + 0.25),
}


def without_ac():
    import mindspore as ms
    from mindspore import Tensor, ops

    from mindformers_ac.mindspore_compat import synchronous_pynative, tensor_stamp
    synchronous_pynative()
    a = Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
    print("| writer | values written | version | backward without AC |\n|---|---|---|---|")
    for name, write in WRITERS.items():
        seen = {}

        def f(a, write=write, seen=seen):
            y = ops.sigmoid(a)
            out = y.sum()
            before, old = tensor_stamp(y), y.asnumpy().copy()
            write(y)
            seen.update(changed=not np.array_equal(old, y.asnumpy()), before=before, after=tensor_stamp(y),
                        old=old, new=y.asnumpy().copy())
            return out
        try:
            g = ms.grad(f)(a).asnumpy()
        except (RuntimeError, AttributeError) as exc:
            how = "refused: " + str(exc).split("\n")[0][:60] + "..."
            if "before" not in seen:   # raised before the write was made: a Tensor has no set_data
                print(f"| `{name}` | no | - | {how} |")
                continue
        else:
            reads = [k for k in ("old", "new") if np.allclose(g, seen[k] * (1 - seen[k]), atol=1e-6)]
            how = "reads the " + ("written" if reads == ["new"] or (seen["changed"] and "new" in reads)
                                  else "old") + " values"
        moved = "new storage" if seen["before"][0] != seen["after"][0] else \
            f"{seen['before'][1]} -> {seen['after'][1]}"
        print(f"| `{name}` | {'yes' if seen['changed'] else 'no (not in place on CPU)'} | {moved} | {how} |")
    parameter_set_data()


def parameter_set_data():
    """A Parameter saved for backward (the weight of a matmul, which the input's gradient reads), rebound by
    ``set_data`` after the save."""
    import mindspore as ms
    from mindspore import Parameter, Tensor, ops

    from mindformers_ac.mindspore_compat import tensor_stamp
    x = Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
    w = Parameter(Tensor(np.eye(4, dtype=np.float32)), name="w")
    seen = {}

    def f(x):
        out = ops.matmul(x, w).sum()
        before = tensor_stamp(w)
        w.set_data(Tensor(np.full((4, 4), 2.0, np.float32)))
        seen.update(before=before, after=tensor_stamp(w))
        return out
    g = ms.grad(f)(x).asnumpy()   # d/dx of sum(x @ w) reads w: ones @ w.T
    reads = "reads the old values" if np.allclose(g, 1.0) else "reads the written values" if np.allclose(g, 8.0) \
        else "?"
    moved = "new storage" if seen["before"][0] != seen["after"][0] else f"{seen['before'][1]} -> {seen['after'][1]}"
    print(f"| `set_data` (a saved Parameter) | yes | {moved} | {reads} (a weight is never offloaded) |")


_ROW = """
import sys
sys.path.insert(0, {tests!r})
from mindformers_ac.mindspore_compat import synchronous_pynative
synchronous_pynative()
import write_cases as wc
from model_patterns import hidden_batch
from steps import first_difference, run_steps
build = lambda: wc.build_layers(wc.writes_input_by({how!r}), first=wc.SavesOutputCellLayer)
model = build()
if {mode!r} != "without AC":
    wc.swap_first_layer(model, {mode!r})
try:
    got = run_steps(model, hidden_batch, steps=1)
except RuntimeError as exc:
    import re
    print("refused (" + ("swap group" if "swap group" in str(exc) else "MindSpore") + ": "
          + re.search(r"version is \\d+ ?, expected version \\d+", str(exc)).group(0) + ")")
else:
    print("trained, " + ("bitwise" if first_difference(run_steps(build(), hidden_batch, steps=1), got) is None
                         else "DIFFERS from without AC"))
"""


def per_mode():
    modes = ("without AC", "layer_swap", "op_swap", "swap_wrapper", "swap_api", "async_save_on_cpu")
    print("\n| write in layer 1 | " + " | ".join(modes) + " |\n" + "|---" * (len(modes) + 1) + "|")
    for how in ("copy_", "assign_add", "assign", "setitem", "assign_value"):
        cells = []
        for mode in modes:
            proc = subprocess.run([sys.executable, "-c", _ROW.format(tests=os.path.join(ROOT, "tests"), how=how,
                                                                      mode=mode)],
                                  capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
            cells.append((proc.stdout.strip().splitlines() or ["crashed: " + proc.stderr[-80:]])[-1])
        print(f"| `{how}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    without_ac()
    per_mode()
