"""Run the commands the docs show and rewrite (or check) the output printed there.

    python scripts/regen_docs.py              # rewrite every marked block (and image) from fresh runs
    python scripts/regen_docs.py --check      # exit 1 when a block differs in more than timing figures
    python scripts/regen_docs.py --only docs/own_model.md
    python scripts/regen_docs.py --figures    # only the code figures (lines, modules, tests): seconds
    python scripts/regen_docs.py --figures --check

A block is regenerated when a marker comment (invisible once rendered) sits
on the line right above its opening fence:

    <!-- regen_docs: run -->
        the block's ``$ COMMAND`` lines are run in order, each followed by
        what it printed on stdout (progress lines go to stderr, not shown);
    <!-- regen_docs: run COMMAND; show summary -->
        COMMAND runs; the block is ``train``'s summary lines only (from
        ``peak activation memory`` to the verdict, and a memory budget's lines);
    <!-- regen_docs: file NAME -->
        the block is written to NAME before the doc's commands run.

A figure about the code, in running text or a table, sits between two inline
markers (invisible once rendered) and is rewritten in place:

    <!-- fig: lines mindformers_ac/ledger.py -->120<!-- /fig -->    lines of the files a glob names
    <!-- fig: modules mindformers_ac/recompute/*.py -->19<!-- /fig -->    how many files it names
    <!-- fig: tests -->1600<!-- /fig -->    tests ``pytest --collect-only`` collects

``--figures`` processes only those markers (in ``FIGURE_DOCS``), running no
command but the collection: what CI and ``tests/test_docs_output.py`` check.

An image marker needs no block: ``<!-- regen_docs: image SRC DEST -->`` copies
SRC, written by a command of the same doc, to DEST (a path in the
repository). Each doc runs in a fresh temporary directory, with
``mindformers-ac`` being this checkout's (``python -m
mindformers_ac.harness.cli``). Timing figures (step times, ratios, RSS,
bandwidth) move from run to run; ``--check`` ignores them and compares every
other figure (bytes, percentages, plan choices, predicted peaks) exactly. A
plan is chosen by profiled step times, though: where two options cost about
the same, another machine may choose the other one, and ``--check`` reports
that as a difference (regenerate, and read the diff).
"""
import argparse
import dataclasses
import difflib
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "docs/own_model.md")
FIGURE_DOCS = ("README.md", "docs/architecture.md", "docs/config.md", "docs/exactness.md")
FIGURE = re.compile(r"<!-- fig: (\w+) ?([^>]*?) -->([^<]*)<!-- /fig -->")
MARKER = re.compile(r"^<!-- regen_docs: (run|file|image)\b ?(.*?) -->$")
SUMMARY_FIRST, SUMMARY_LAST = "peak activation memory:", "losses, gradients and all parameters"
# Figures that depend on the machine's speed or load, per line: masked by --check.
TIMING = [re.compile(p) for p in (
    r"[-+]*\d+(?:\.\d+)? ms",            # step times, swap cost, raw copy time
    r"ratio \d+(?:\.\d+)?x",             # step-time ratio
    r"\d+(?:\.\d+)? GiB/s",              # host copy bandwidth
    r"\d+% of the copy hidden",          # swap overlap
)]
RSS = re.compile(r"^process peak RSS .*$", re.MULTILINE)   # the process's memory: the machine's, not the model's


@dataclasses.dataclass
class Block:
    """A marked fenced block: ``kind``/``arg`` from the marker, ``start``..``end`` its content lines."""
    kind: str
    arg: str
    start: int = 0
    end: int = 0


def parse(lines):
    """The marked blocks and image markers of a doc's ``lines`` (in order)."""
    found = []
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match:
            continue
        kind, arg = match.groups()
        if kind == "image":
            found.append(Block(kind, arg, i, i))
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise SystemExit(f"line {i + 1}: a regen_docs marker must be right above a fenced block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise SystemExit(f"line {i + 2}: the fenced block is not closed")
        found.append(Block(kind, arg, i + 2, end))
    return found


def _shell(command):
    """``command`` with a leading ``mindformers-ac`` replaced by this checkout's CLI."""
    if command.startswith("mindformers-ac"):
        return shlex.join([sys.executable, "-m", "mindformers_ac.harness.cli"]) + command[len("mindformers-ac"):]
    return command


def run(command, cwd):
    """What ``command`` prints on stdout, run in ``cwd`` as a user would; raises SystemExit if it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", "-c", _shell(command)], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"`{command}` failed with exit status {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def summary_lines(output):
    """``train``'s summary: the lines from the memory line to the verdict, and the memory budget's after it."""
    lines = output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(SUMMARY_FIRST))
    last = next(i for i, line in enumerate(lines) if line.startswith(SUMMARY_LAST))
    while last + 1 < len(lines) and lines[last + 1].startswith(("memory budget", "  ")):
        last += 1
    return lines[first:last + 1]


def regenerate(block, lines, cwd):
    """The new content lines of a ``run`` block."""
    if block.arg:
        command, _, show = block.arg.partition(";")
        if show.strip() != "show summary":
            raise SystemExit(f"regen_docs: run {block.arg!r}: the only selection is '; show summary'")
        return summary_lines(run(command.strip(), cwd))
    commands = [line[2:] for line in lines[block.start:block.end] if line.startswith("$ ")]
    if not commands:
        raise SystemExit(f"line {block.start}: a 'run' block without `$ COMMAND` lines")
    new = []
    for command in commands:
        print(f"  $ {command}", file=sys.stderr)
        new += [f"$ {command}"] + run(command, cwd).rstrip("\n").splitlines()
    return new


# memory_budget's (and plan --budget's) "a tie:" line is there when the fastest plan was another one by less than the timing noise:
# whether it is, is timing too (the plan chosen, on the line above it, is compared); so is a choice made again
# because the first one's step time missed its prediction, and the step the plan runs from after it
TIE_LINE = re.compile(r"^(?:  )?a tie: .*\n?", re.MULTILINE)   # indented in train's summary, not in plan's report
TIMED_AGAIN = re.compile(r"^  chosen twice: the first choice's step time missed .*\n?", re.MULTILINE)
FROM_STEP = re.compile(r"\(from step \d+;")


def timing_masked(text):
    text = TIMED_AGAIN.sub("", TIE_LINE.sub("", text))
    text = FROM_STEP.sub("(from step <timing>;", text)
    for pattern in TIMING:
        text = pattern.sub("<timing>", text)
    return RSS.sub("<rss>", text)


def _files(pattern):
    paths = sorted(glob.glob(os.path.join(REPO, pattern)))
    if not paths:
        raise SystemExit(f"regen_docs: fig {pattern!r} names no file")
    return paths


def collected_tests():
    """How many tests ``pytest --collect-only`` finds in this checkout."""
    out = run(shlex.join([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"]),
              REPO)
    match = re.search(r"^(\d+) tests? collected", out, re.MULTILINE)
    if match is None:
        raise SystemExit(f"regen_docs: pytest --collect-only printed no count:\n{out[-2000:]}")
    return int(match.group(1))


def figure_value(kind, arg, tests=None):
    """The figure a ``<!-- fig: KIND ARG -->`` marker shows, as the docs write it (``1,234``); ``tests``: a
    callable giving the collected test count (collected once per run)."""
    if kind == "lines":
        value = 0
        for path in _files(arg):
            with open(path, encoding="utf-8") as f:
                value += sum(1 for _ in f)
    elif kind == "modules":
        value = len(_files(arg))
    elif kind == "tests":
        value = (tests or collected_tests)()
    else:
        raise SystemExit(f"regen_docs: unknown figure kind {kind!r} (lines, modules, tests)")
    return f"{value:,}"


def figures(text, tests=None, kinds=None):
    """``text`` with every figure marker's value (of ``kinds``, default all) computed now."""
    def value(match):
        kind, arg, _ = match.groups()
        if kinds is not None and kind not in kinds:
            return match.group(0)
        return f"<!-- fig: {kind}{' ' + arg if arg else ''} -->{figure_value(kind, arg, tests)}<!-- /fig -->"
    return FIGURE.sub(value, text)


def process_figures(docs, check):
    """Rewrite (or compare) the figure markers of ``docs``; returns the differences."""
    cache = []

    def tests():
        if not cache:
            cache.append(collected_tests())
        return cache[0]
    differences = []
    for doc in docs:
        path = os.path.join(REPO, doc)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = figures(text, tests)
        if new != text:
            differences += difflib.unified_diff(text.splitlines(), new.splitlines(), f"{doc} (docs)",
                                                f"{doc} (code now)", lineterm="", n=0)
            if not check:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    return differences


def process(doc, check):
    """Regenerate ``doc``'s blocks; returns the differences (check) or writes the doc (no check)."""
    path = os.path.join(REPO, doc)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks = parse(lines)
    if not blocks:
        return []
    print(f"{doc}:", file=sys.stderr)
    new_lines, differences = list(lines), []
    with tempfile.TemporaryDirectory(prefix="regen-docs-") as cwd:
        for block in blocks:
            if block.kind == "file":
                with open(os.path.join(cwd, block.arg), "w", encoding="utf-8") as f:
                    f.write("\n".join(lines[block.start:block.end]) + "\n")
        replacements = [(b, regenerate(b, lines, cwd)) for b in blocks if b.kind == "run"]
        for block in blocks:
            if block.kind == "image" and not check:
                source, dest = block.arg.split()
                shutil.copyfile(os.path.join(cwd, source), os.path.join(REPO, dest))
    for block, content in reversed(replacements):   # from the end: earlier line numbers stay valid
        old = "\n".join(lines[block.start:block.end])
        if timing_masked(old) != timing_masked("\n".join(content)):
            differences += difflib.unified_diff(old.splitlines(), content, f"{doc} (docs)", f"{doc} (run now)",
                                                lineterm="")
        new_lines[block.start:block.end] = content
    if not check:
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(new_lines))
    return differences


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare instead of rewriting; exit 1 on a difference beyond timing (default: rewrite)")
    parser.add_argument("--only", nargs="+", default=None, metavar="DOC",
                        help=f"docs to process, repository paths (default: {' '.join(DOCS)}; with --figures: "
                             f"{' '.join(FIGURE_DOCS)})")
    parser.add_argument("--figures", action="store_true",
                        help="only the code figures (lines, modules, tests), running no documented command")
    args = parser.parse_args(argv)
    differences = process_figures(args.only or FIGURE_DOCS, args.check)
    for doc in ([] if args.figures else args.only or DOCS):
        differences += process(doc, args.check)
    if differences:
        print("\n".join(differences))
        print("\nthe docs differ from what the commands print now beyond timing figures, or from the code's "
              f"figures: run python scripts/regen_docs.py{' --figures' if args.figures else ''}", file=sys.stderr)
        return 1 if args.check else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
