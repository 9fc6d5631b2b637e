"""Where a recompute row's time goes, per native function (kernels, MindSpore's runtime, the OS), next to
another row: each row runs alone in its own process under Linux ``perf``.

    PYTHONPATH=scripts:. python scripts/profile_ops.py --family plain --shape mid [--rows floor full]
                                                       [--steps 20] [--top 20]

Rows (``bench_recompute.py``'s, built by its ``case``): ``baseline``, ``floor`` (baseline + 1 forward),
``builtin`` (``Cell.recompute()`` on each layer), ``full`` (``checkpoint_wrapper`` on each layer). The first row
named is the reference. Prints each row's CPU time per step (all threads, from perf's samples) and
the native functions whose CPU time per step differs most from the reference's, grouped by shared
object. For the Python side per function, see ``bench_recompute.py --profile ROW`` (cProfile).

Needs ``perf`` on the PATH and permission to sample this user's processes
(``kernel.perf_event_paranoid`` <= 2); exits 2 with that message otherwise.
"""
import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile

from mindformers_ac.mindspore_compat import synchronous_pynative

from bench_common import parse_args
from bench_recompute import case, cell_recompute, per_layer

ROWS = ("baseline", "floor", "builtin", "full")
FREQ = 999


def run_row(args):
    """Worker: build and warm up, then ``--steps`` steps of one row with perf's sampling on (perf starts
    it disabled; ``enable`` / ``disable`` go through its control fifo, each acknowledged)."""
    synchronous_pynative()
    setups = {"baseline": (lambda family: None, False), "floor": (lambda family: None, True),
              "builtin": (cell_recompute(), False), "full": (per_layer(), False)}
    setup, extra_forward = setups[args.row]
    step = case(args, args.row, setup, extra_forward=extra_forward).step
    for _ in range(args.warmup):
        step()
    with open(args.ctl, "w", encoding="ascii") as ctl, open(args.ack, encoding="ascii") as ack:
        _perf_command(ctl, ack, "enable")
        for _ in range(args.steps):
            step()
        _perf_command(ctl, ack, "disable")


def _perf_command(ctl, ack, command):
    ctl.write(command + "\n")
    ctl.flush()
    ack.readline()


def samples_by_symbol(data):
    """{(shared object, symbol): samples} from a perf.data file."""
    out = subprocess.run(["perf", "report", "-i", data, "--stdio", "-n", "--sort", "dso,sym"],
                         capture_output=True, text=True, check=True).stdout
    counts = collections.Counter()
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 4 or line.startswith("#") or not parts[1].isdigit():
            continue
        dso, sym = parts[2], parts[3].split("] ", 1)[-1].strip()
        # JIT-generated kernels (oneDNN) and addresses without a symbol differ per process: one row each.
        sym = "(unresolved addresses)" if dso == "[JIT]" or sym.startswith("0x") else _short(sym)
        counts[(dso, sym)] += int(parts[1])
    return counts


def _short(sym):
    """A C++ symbol without its template arguments and parameter list, so one function is one row."""
    depth, kept = 0, []
    for ch in sym:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            kept.append(ch)
    name = "".join(kept).strip()
    return name[:90] or sym[:90]


def main():
    def add(p):
        p.add_argument("--family", choices=("gpt", "plain", "llama"), default="plain")
        p.add_argument("--rows", nargs="+", choices=ROWS, default=["floor", "full"],
                       help="rows to profile, the first is the reference (default: floor full)")
        p.add_argument("--top", type=int, default=20, help="functions listed (default 20)")
        for own in ("--row", "--ctl", "--ack"):   # the worker's own flags
            p.add_argument(own, help=argparse.SUPPRESS)

    a = parse_args(__doc__, add)
    if a.row:
        run_row(a)
        return
    if shutil.which("perf") is None:
        print("profile_ops.py: needs Linux perf on the PATH", file=sys.stderr)
        sys.exit(2)
    per_step = {}
    with tempfile.TemporaryDirectory(prefix="profile-ops-") as tmp:
        for row in a.rows:
            data, ctl, ack = (os.path.join(tmp, f"{row}.{ext}") for ext in ("data", "ctl", "ack"))
            os.mkfifo(ctl)
            os.mkfifo(ack)
            cmd = ["perf", "record", "-q", "-F", str(FREQ), "-D", "-1", f"--control=fifo:{ctl},{ack}", "-o", data,
                   sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--row", row, "--ctl", ctl, "--ack", ack]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"profile_ops.py: perf record of row {row} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                sys.exit(2)
            ms_per_sample = 1e3 / FREQ / a.steps
            per_step[row] = {k: n * ms_per_sample for k, n in samples_by_symbol(data).items()}
    ref = a.rows[0]
    g = a.gpt
    print(f"{a.family}: {g.num_layers} layers, hidden {g.hidden_size}, seq {g.seq_length}, batch {a.batch}, "
          f"dropout {g.dropout}; {a.steps} steps after {a.warmup} warm-up per row, each row alone in its "
          f"process under perf ({FREQ} Hz, sampling the measured steps only); CPU ms per step, all threads")
    print()
    print("| row | CPU ms per step | x " + ref + " |")
    print("|---|---:|---:|")
    totals = {row: sum(v.values()) for row, v in per_step.items()}
    for row in a.rows:
        print(f"| {row} | {totals[row]:.1f} | {totals[row] / totals[ref]:.3f} |")
    for row in a.rows[1:]:
        keys = set(per_step[row]) | set(per_step[ref])
        diff = sorted(keys, key=lambda k: -abs(per_step[row].get(k, 0) - per_step[ref].get(k, 0)))[:a.top]
        print()
        print(f"| shared object | function | {ref} ms | {row} ms | {row} - {ref} ms |")
        print("|---|---|---:|---:|---:|")
        for dso, sym in diff:
            x, y = per_step[ref].get((dso, sym), 0.0), per_step[row].get((dso, sym), 0.0)
            print(f"| {dso} | `{sym}` | {x:.2f} | {y:.2f} | {y - x:+.2f} |")


if __name__ == "__main__":
    main()
