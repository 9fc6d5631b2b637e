"""Full recompute against the floor on the three model families: each configuration run several times.

    PYTHONPATH=scripts:. python scripts/bench_floor.py [--shape small mid] [--repeat 3] [--steps-small 30]
                                                       [--steps-mid 12] [--only gpt plain llama moe] [--first-config]
                                                       [--against REV]

Each run is one ``bench_recompute.py`` process (every row interleaved in it, medians over its steps);
a ratio moves by a few percent between processes on a shared machine, so each configuration runs
``--repeat`` times and the table gives the median of the runs' ratios and their range. Rows: the
reference GPT with its SeededDropout (host-drawn masks), with its former SeededKernelDropout (a fresh seeded
``ops.Dropout`` per call), with ``nn.Dropout`` and without dropout; the plain
pre-LN transformer with ``nn.Dropout`` and without; the LLaMA of docs/own_model.md (no dropout); the reference MoE GPT (ep=1). The exclude columns:
``exclude_op: [matmul]`` (``exclude_policy(["matmul"])``; ``[AllToAll]`` on the MoE model) on the same
regions, against the same rows without it.

``--against REV``: each process also runs the engine rows with the engine of git revision REV
(``bench_recompute.py --against``, interleaved in the same process), and the table puts this checkout's ratios
to the floor and to ``Cell.recompute()`` beside REV's, row by row: a regression shows within one process.
"""
import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [("gpt", "SeededDropout 0.1", []), ("gpt", "SeededKernelDropout 0.1", ["--kernel-dropout"]),
           ("gpt", "nn.Dropout 0.1", ["--nn-dropout"]),
           ("gpt", "none", ["--dropout", "0"]), ("plain", "nn.Dropout 0.1", ["--dropout", "0.1"]),
           ("plain", "none", ["--dropout", "0"]), ("llama", "none", []), ("moe", "SeededDropout 0.1", [])]
FLOOR, BUILTIN = "floor (baseline + 1 forward)", "Cell.recompute() full"
EXCLUDE = "full + exclude_op"


def run_once(family, flags, shape, steps, against=None):
    """{row name: (wall ms, {column: text})} of one bench_recompute.py process."""
    cmd = [sys.executable, os.path.join(HERE, "bench_recompute.py"), "--family", family, "--shape", shape,
           "--steps", str(steps), *flags, *(["--against", against] if against else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    heads = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = (float(cells[1]), dict(zip(heads, cells)))
    return rows


def ratio(run, row, ref):
    return run[row][0] / run[ref][0]


def spread(values):
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", choices=("small", "mid"), default=["small", "mid"])
    p.add_argument("--repeat", type=int, default=3, help="processes per configuration (default 3)")
    p.add_argument("--steps-small", type=int, default=30, help="interleaved steps per small run (default 30)")
    p.add_argument("--steps-mid", type=int, default=12, help="interleaved steps per mid run (default 12)")
    p.add_argument("--only", nargs="+", choices=("gpt", "plain", "llama", "moe"), help="these families only")
    p.add_argument("--first-config", action="store_true", help="one configuration per family: its first")
    p.add_argument("--against", metavar="REV", help="also the engine rows of git revision REV, side by side")
    a = p.parse_args()
    if a.against:
        against_table(a)
        return
    print(f"median of {a.repeat} processes (range); wall-clock ratios of medians over interleaved steps")
    print("| shape | family | dropout | baseline ms | floor ms | `Cell.recompute()` x floor | full x floor | "
          "full x `Cell.recompute()` | select mlp x `mlp.recompute()` | full + exclude x full | "
          "full + exclude x floor | select mlp + exclude x select mlp | full: light / intercepted calls | "
          "full + exclude: light / intercepted calls |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape, steps, family, dropout, flags in configs(a):
        runs = [run_once(family, flags, shape, steps) for _ in range(a.repeat)]
        base = statistics.median(r["baseline"][0] for r in runs)
        floor = statistics.median(r[FLOOR][0] for r in runs)
        cells = [spread([ratio(r, BUILTIN, FLOOR) for r in runs]), spread([ratio(r, "full", FLOOR) for r in runs]),
                 spread([ratio(r, "full", BUILTIN) for r in runs]),
                 spread([ratio(r, "select mlp", "Cell.recompute() mlp") for r in runs]),
                 spread([ratio(r, EXCLUDE, "full") for r in runs]), spread([ratio(r, EXCLUDE, FLOOR) for r in runs]),
                 spread([ratio(r, "select mlp + exclude_op", "select mlp") for r in runs]),
                 runs[-1]["full"][1]["light / intercepted calls"], runs[-1][EXCLUDE][1]["light / intercepted calls"]]
        print(f"| {shape} | {family} | {dropout} | {base:.1f} | {floor:.1f} | " + " | ".join(cells) + " |",
              flush=True)


def configs(a):
    """(shape, steps, family, dropout, flags) of each configuration the arguments select."""
    for shape in a.shape:
        steps = a.steps_small if shape == "small" else a.steps_mid
        for family, dropout, flags in CONFIGS:
            if (a.only and family not in a.only) or (a.first_config and (family, dropout, flags) !=
                                                     next(c for c in CONFIGS if c[0] == family)):
                continue
            yield shape, steps, family, dropout, flags


def against_table(a):
    """This checkout's engine rows beside those of ``a.against``, each ratio to the same reference row of the
    same process: median of the processes (range)."""
    rev = a.against
    columns = [("full", FLOOR, "full x floor"), (EXCLUDE, FLOOR, "full + exclude x floor"),
               ("select mlp", "Cell.recompute() mlp", "select mlp x `mlp.recompute()`"),
               ("select mlp + exclude_op", "Cell.recompute() mlp", "select mlp + exclude x `mlp.recompute()`")]
    print(f"median of {a.repeat} processes (range); wall-clock ratios of medians over interleaved steps, this "
          f"checkout's engine and {rev}'s in the same processes")
    print("| shape | family | dropout | " + " | ".join(f"{title}: this / {rev}" for _, _, title in columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for shape, steps, family, dropout, flags in configs(a):
        runs = [run_once(family, flags, shape, steps, against=rev) for _ in range(a.repeat)]
        cells = [f"{spread([ratio(r, row, ref) for r in runs])} / {spread([ratio(r, f'{rev}: {row}', ref) for r in runs])}"
                 for row, ref, _ in columns]
        print(f"| {shape} | {family} | {dropout} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
