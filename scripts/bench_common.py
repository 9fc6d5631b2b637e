"""What the bench_* scripts share: the two model shapes, the interleaved step loop, the ratio table,
and a cProfile of one row (or of several, compared).

Every row is measured in one process, round robin (one step of each row in turn, the order reversed
every other round), so load changes on the shared cores hit all rows alike. Each step is timed in
wall-clock time and in process CPU time (all threads: MindSpore's and the swap copy worker's).
"""
import argparse
import collections
import cProfile
import gc
import importlib
import io
import os
import pstats
import re
import statistics
import subprocess
import sys
import time

from mindformers_ac.harness.spec import add_model_arguments, spec_from_args

# small: dispatch-bound, per-op and per-tensor Python shows; mid: kernel-bound.
SHAPES = {"small": {"layers": 8, "hidden": 64, "seq": 32, "batch": 2},
          "mid": {"layers": 4, "hidden": 256, "seq": 128, "batch": 4}}


# what each ``args.dropout_kind`` is, for the tables' captions
DROPOUT_NAMES = {"seeded": "SeededDropout", "kernel": "SeededKernelDropout", "nn": "nn.Dropout"}


def parse_args(doc, add_arguments=None):
    """Model arguments (defaults from ``--shape``, each overridable), the dropout kind (``--nn-dropout``,
    ``--kernel-dropout``: ``args.dropout_kind``), ``--warmup``,
    ``--steps``, ``--profile ROW``, plus what ``add_arguments(parser)`` adds. The model's dimensions come
    back resolved as ``args.gpt`` (a ``GPTConfig``) and ``args.batch``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--shape", choices=SHAPES, default="mid",
                     help="small: 8 layers, hidden 64, seq 32, batch 2; mid: 4 layers, hidden 256, seq 128, batch 4")
    p = argparse.ArgumentParser(description=doc, parents=[pre], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, **SHAPES[pre.parse_known_args()[0].shape])
    kinds = p.add_mutually_exclusive_group()
    kinds.add_argument("--nn-dropout", action="store_const", dest="dropout_kind", const="nn", default="seeded",
                       help="MindSpore's nn.Dropout instead of the reference model's SeededDropout (host-drawn masks)")
    kinds.add_argument("--kernel-dropout", action="store_const", dest="dropout_kind", const="kernel",
                       help="a fresh seeded ops.Dropout primitive per call (SeededKernelDropout, the reference "
                            "model's dropout before 2026-12-03) instead of SeededDropout")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", metavar="ROW", nargs="+",
                   help="instead of the table: cProfile --steps steps of the row of this name (main-thread CPU "
                        "clock) and print the top entries; several names: profile those rows in alternating "
                        "blocks of 5 steps and compare them per function")
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args()
    spec = spec_from_args(args)
    args.gpt, args.batch = spec.gpt, spec.batch
    return args


class Row:
    """One configuration: ``step()`` runs one training step; ``ref`` names the row its ratio is taken to."""

    def __init__(self, name, step, ref=None):
        self.name, self.step, self.ref = name, step, ref
        self.wall, self.cpu = [], []

    def median(self):
        return statistics.median(self.wall), statistics.median(self.cpu)


def run_interleaved(rows, warmup, steps):
    for row in rows:
        for _ in range(warmup):
            row.step()
    # Many models are alive at once here, unlike in training: keep the cyclic GC from walking all of
    # them on every collection (that cost would land on whichever row allocates most).
    gc.collect()
    gc.freeze()
    for i in range(steps):
        for row in rows if i % 2 == 0 else rows[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            row.step()
            row.wall.append(time.perf_counter() - wall)
            row.cpu.append(time.process_time() - cpu)
    gc.unfreeze()


def print_table(rows, base, extra=None):
    """Markdown table of median step wall / CPU time and their ratios to the ``base`` row and, where
    rows name one, to their ``ref`` row; ``extra(row) -> {header: text}`` adds columns."""
    by_name = {r.name: r for r in rows}
    extras = {r.name: extra(r) if extra else {} for r in rows}
    heads = ["wall ms", "cpu ms", "x base wall", "x base cpu"] + \
        (["x ref wall", "x ref cpu", "ref"] if any(r.ref for r in rows) else []) + list(extras[base])
    print("| config | " + " | ".join(heads) + " |")
    print("|---" + "|---:" * len(heads) + "|")
    for r in rows:
        wall, cpu = r.median()
        cells = [f"{wall * 1e3:.1f}", f"{cpu * 1e3:.1f}", *ratios(r, by_name[base])]
        if len(heads) > 4 + len(extras[base]):
            cells += [*ratios(r, by_name[r.ref]), r.ref] if r.ref else ["-", "-", "-"]
        print(f"| {r.name} | " + " | ".join(cells + list(extras[r.name].values())) + " |")


def ratios(row, ref):
    (wall, cpu), (ref_wall, ref_cpu) = row.median(), ref.median()
    return f"{wall / ref_wall:.3f}", f"{cpu / ref_cpu:.3f}"


# this package's code, not its reference models; ``mac_<rev>`` is another revision's (bench_swap --against)
OWN_CODE = re.compile(r"(mindformers_ac|mac_\w+)[/\\](?!harness)")


def _row_named(rows, name):
    row = next((r for r in rows if r.name == name), None)
    if row is None:
        raise SystemExit(f"--profile: no row {name!r}; rows: {', '.join(r.name for r in rows)}")
    return row


def profile(rows, names, warmup, steps, top=25):
    """cProfile ``steps`` steps of the row called ``names[0]`` (main-thread CPU time): the top entries by own
    time, then this package's own functions by cumulative time. Several names: ``compare_profiles``."""
    if len(names) > 1:
        compare_profiles([_row_named(rows, n) for n in names], warmup, steps, top)
        return
    name = names[0]
    row = _row_named(rows, name)
    for _ in range(warmup):
        row.step()
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(steps):
        row.step()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    print(f"{name}: {stats.total_calls / steps:.0f} Python calls per step, "
          f"{stats.total_tt / steps * 1e3:.1f} ms main-thread CPU per step (profiled)")
    stats.sort_stats("tottime").print_stats(top)
    print(out.getvalue())
    own_tt = sum(_own_time_by_function(stats).values())
    engine = io.StringIO()
    print(f"this package's own code (not its reference models): {own_tt / steps * 1e3:.2f} ms per step of own "
          f"time ({own_tt / stats.total_tt:.1%} of the profiled main thread); its functions by cumulative time "
          "(calls and seconds over all profiled steps):", file=engine)
    pstats.Stats(prof, stream=engine).sort_stats("cumtime").print_stats(OWN_CODE.pattern, top)
    print(engine.getvalue())


def _own_time_by_function(stats):
    """Own seconds of this package's functions in ``stats`` (``OWN_CODE``), keyed ``file:function`` by file
    name, so that two revisions of one module compare."""
    funcs = collections.defaultdict(float)
    for (path, _, fn), entry in stats.stats.items():
        if OWN_CODE.search(path):
            funcs[f"{os.path.basename(path)}:{fn}"] += entry[2]
    return funcs


def compare_profiles(rows, warmup, steps, top, block=5):
    """cProfile ``rows`` in alternating blocks of ``block`` steps (order reversed every other round), one
    profiler per row, so that the machine's load falls on each alike; prints per row the main thread's
    time, the package's own time and Python calls per step, then the ``top`` functions of the package
    whose own time differs most between the first two rows (functions keyed by file name, so that two
    revisions of one module compare)."""
    profs = {r.name: cProfile.Profile(time.thread_time) for r in rows}
    for r in rows:
        for _ in range(warmup):
            r.step()
    rounds = max(1, steps // block)
    for k in range(rounds):
        for r in (rows if k % 2 == 0 else rows[::-1]):
            profs[r.name].enable()
            for _ in range(block):
                r.step()
            profs[r.name].disable()
    n = rounds * block
    per_function = {}
    print(f"| per profiled step ({n} steps, blocks of {block}) | " + " | ".join(r.name for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    totals = {"main thread, all code (ms)": [], "the package's own Python (ms)": [], "Python calls": []}
    for r in rows:
        stats = pstats.Stats(profs[r.name])
        funcs = per_function[r.name] = _own_time_by_function(stats)
        totals["main thread, all code (ms)"].append(f"{stats.total_tt / n * 1e3:.1f}")
        totals["the package's own Python (ms)"].append(f"{sum(funcs.values()) / n * 1e3:.2f}")
        totals["Python calls"].append(f"{stats.total_calls / n:,.0f}")
    for what, cells in totals.items():
        print(f"| {what} | " + " | ".join(cells) + " |")
    a, b = (per_function[r.name] for r in rows[:2])
    diffs = sorted(set(a) | set(b), key=lambda f: -abs(a.get(f, 0.0) - b.get(f, 0.0)))[:top]
    print(f"\nown time per step (ms), the functions that differ most: {rows[0].name} / {rows[1].name}")
    for f in diffs:
        print(f"  {f:50s} {a.get(f, 0.0) / n * 1e3:7.3f} / {b.get(f, 0.0) / n * 1e3:7.3f}")


def package_of(rev, workdir, module):
    """``mindformers_ac.<module>`` of git revision ``rev`` of this repository, extracted into ``workdir`` under
    the package name ``mac_<rev>`` (the package imports itself only relatively), for rows that compare two
    engines in one process. Raises CalledProcessError for an unknown revision."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = "mac_" + "".join(c if c.isalnum() else "_" for c in rev)
    if not os.path.isdir(os.path.join(workdir, name)):
        archive = subprocess.run(["git", "-C", repo, "archive", rev, "mindformers_ac"], check=True,
                                 capture_output=True)
        subprocess.run(["tar", "-x", "-C", workdir], input=archive.stdout, check=True)
        os.rename(os.path.join(workdir, "mindformers_ac"), os.path.join(workdir, name))
    if workdir not in sys.path:
        sys.path.insert(0, workdir)
    return importlib.import_module(f"{name}.{module}")
