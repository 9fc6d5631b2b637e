"""What the bench_* scripts share: the two model shapes, the interleaved step loop, the ratio table,
and a cProfile of one row.

Every row is measured in one process, round robin (one step of each row in turn, the order reversed
every other round), so load changes on the shared cores hit all rows alike. Each step is timed in
wall-clock time and in process CPU time (all threads: MindSpore's and the swap copy worker's).
"""
import argparse
import cProfile
import gc
import io
import pstats
import re
import statistics
import time

from mindformers_ac.harness.spec import add_model_arguments, spec_from_args

# small: dispatch-bound, per-op and per-tensor Python shows; mid: kernel-bound.
SHAPES = {"small": {"layers": 8, "hidden": 64, "seq": 32, "batch": 2},
          "mid": {"layers": 4, "hidden": 256, "seq": 128, "batch": 4}}


def parse_args(doc, add_arguments=None):
    """Model arguments (defaults from ``--shape``, each overridable), ``--nn-dropout``, ``--warmup``,
    ``--steps``, ``--profile ROW``, plus what ``add_arguments(parser)`` adds. The model's dimensions come
    back resolved as ``args.gpt`` (a ``GPTConfig``) and ``args.batch``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--shape", choices=SHAPES, default="mid",
                     help="small: 8 layers, hidden 64, seq 32, batch 2; mid: 4 layers, hidden 256, seq 128, batch 4")
    p = argparse.ArgumentParser(description=doc, parents=[pre], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, **SHAPES[pre.parse_known_args()[0].shape])
    p.add_argument("--nn-dropout", action="store_true",
                   help="MindSpore's nn.Dropout instead of the reference model's replayable SeededDropout")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", metavar="ROW",
                   help="instead of the table: cProfile --steps steps of the row of this name (main-thread CPU "
                        "clock) and print the top entries")
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


def profile(rows, name, warmup, steps, top=25):
    """cProfile ``steps`` steps of the row called ``name`` (main-thread CPU time): the top entries by own
    time, then this package's own functions by cumulative time."""
    row = next((r for r in rows if r.name == name), None)
    if row is None:
        raise SystemExit(f"--profile: no row {name!r}; rows: {', '.join(r.name for r in rows)}")
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
    own = re.compile(r"mindformers_ac[/\\](?!harness)")   # this package's code, not its reference models
    own_tt = sum(entry[2] for (path, _, _), entry in stats.stats.items() if own.search(path))
    engine = io.StringIO()
    print(f"this package's own code (not its reference models): {own_tt / steps * 1e3:.2f} ms per step of own "
          f"time ({own_tt / stats.total_tt:.1%} of the profiled main thread); its functions by cumulative time "
          "(calls and seconds over all profiled steps):", file=engine)
    pstats.Stats(prof, stream=engine).sort_stats("cumtime").print_stats(own.pattern, top)
    print(engine.getvalue())
