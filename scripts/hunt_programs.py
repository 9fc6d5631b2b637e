"""Run many generated layer programs with and without AC and print what was found (issue 49, point 5).

    python scripts/hunt_programs.py --cases 2000 --seed 1 [--modes select,op_swap]

Each case is a program of ``tests/program_generator.py`` in one AC mode, trained 2 steps against its plain
twin: exact, refused on the first backward, or a finding (silently different, refused late). Prints one
line per finding and the counts at the end.
"""
import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import program_generator as gen  # noqa: E402

from mindformers_ac.mindspore_compat import synchronous_pynative  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--modes", default=",".join(gen.MODES),
                        help=f"comma-separated modes to draw from (default: all of {', '.join(gen.MODES)})")
    args = parser.parse_args()
    modes = tuple(args.modes.split(","))
    unknown = set(modes) - set(gen.MODES)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; the modes are {', '.join(gen.MODES)}")
    synchronous_pynative()
    counts, by_mode, start = collections.Counter(), collections.defaultdict(collections.Counter), time.time()
    for program, mode in gen.cases(args.seed, args.cases, modes):
        kind, detail = gen.outcome(program, mode)
        kind = "exact_idle" if kind == "exact" and detail == "idle" else kind   # the mode did nothing
        counts[kind] += 1
        by_mode[mode][kind] += 1
        if kind in ("silent", "late"):
            print(f"FOUND {kind}: {program} under {mode}: {detail}", flush=True)
    for mode in modes:
        print(f"  {mode}: {dict(by_mode[mode])}")
    print(f"{sum(counts.values())} cases in {time.time() - start:.0f} s: {dict(counts)}")


if __name__ == "__main__":
    main()
