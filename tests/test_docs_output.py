"""The command output shown in the docs is what the commands print (scripts/regen_docs.py rewrites it)."""
import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _regen_docs():
    spec = importlib.util.spec_from_file_location("regen_docs", REPO / "scripts" / "regen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


regen = _regen_docs()


def _blocks(doc):
    lines = (REPO / doc).read_text().split("\n")
    return lines, regen.parse(lines)


def test_the_documented_outputs_are_marked_for_regeneration():
    lines, blocks = _blocks("README.md")
    runs = [b for b in blocks if b.kind == "run"]
    assert [b.arg for b in runs] == ["mindformers-ac train --report out; show summary"]
    assert lines[runs[0].start].startswith(regen.SUMMARY_FIRST)
    lines, blocks = _blocks("docs/own_model.md")
    commands = [lines[b.start] for b in blocks if b.kind == "run" and not b.arg]
    assert [c.split()[:2] for c in commands] == [["$", "mindformers-ac"]] * 3
    assert [c.split()[2] for c in commands] == ["explain", "train", "plan"]
    summaries = [b for b in blocks if b.kind == "run" and b.arg]   # train --budget: its summary, budget lines too
    assert [b.arg.split()[:2] + b.arg.split()[-4:] for b in summaries] == \
        [["mindformers-ac", "train", "--steps", "12;", "show", "summary"]]
    assert lines[summaries[0].start].startswith(regen.SUMMARY_FIRST)
    # the budget's lines end with the real peak, or with why the plan was chosen twice (a run's timings decide)
    budget_lines = lines[summaries[0].start:summaries[0].end]
    last = len(budget_lines) - (2 if budget_lines[-1].startswith("  chosen twice: ") else 1)
    assert budget_lines[last].startswith("  real peak (kept + largest rebuild + prefetched)")
    assert {b.arg for b in blocks if b.kind == "file"} == {"llama_factory.py", "llama_trainer.yaml"}


def test_check_masks_timing_figures_only():
    documented = ("peak activation memory: 9.08 MiB without AC, 3.02 MiB with AC (saving 66.7%; ...)\n"
                  "step time: 104.5 ms without, 146.1 ms with (ratio 1.40x, median)\n"
                  "process peak RSS (VmHWM, sanity figure): 478.52 MiB without, 478.70 MiB with\n"
                  "profiled swap: +-62.3 ms/step for 1.2 ms of raw copies (100% of the copy hidden behind compute)")
    now = documented.replace("104.5", "98.0").replace("1.40x", "1.52x").replace("478.70", "480.00") \
        .replace("-62.3", "3.1").replace("100%", "87%")
    assert regen.timing_masked(documented) == regen.timing_masked(now)
    assert regen.timing_masked(documented) != regen.timing_masked(documented.replace("3.02 MiB", "2.77 MiB"))
    assert regen.timing_masked(documented) != regen.timing_masked(documented.replace("66.7%", "69.5%"))


@pytest.mark.slow
def test_readme_quick_start_shows_what_train_prints_on_the_default_config(tmp_path):
    lines, blocks = _blocks("README.md")
    block = next(b for b in blocks if b.kind == "run")
    documented = lines[block.start:block.end]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "mindformers_ac.harness.cli", "train"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = regen.summary_lines(proc.stdout)
    assert documented[0].startswith("peak activation memory:")
    assert documented[0] == printed[0]   # bytes and percentages, exactly
    assert documented[-1] == printed[-1] == "losses, gradients and all parameters bitwise equal in every step: yes"
    assert regen.timing_masked("\n".join(documented)) == regen.timing_masked("\n".join(printed))


def test_check_ignores_whether_a_budget_tie_was_said():
    """memory_budget says "a tie:" when the fastest plan was another one within the noise: timing, not the choice."""
    chosen = "memory budget 0.4x = 3.63 MiB: chosen 0-3: full (from step 8)\n"
    peak = "  real peak (kept + largest rebuild + prefetched): predicted 2.78 MiB\n"
    tie = "  a tie: 0-3: select mlp was predicted 8.5 ms faster, within the timing noise: chosen by bytes\n"
    assert regen.timing_masked(chosen + tie + peak) == regen.timing_masked(chosen + peak)
    report = "plan:   0-2: layer swap; 3: full\n"   # plan --budget's report: its tie line is not indented
    assert regen.timing_masked(report + tie.lstrip()) == regen.timing_masked(report)
    assert regen.timing_masked(chosen + peak) != regen.timing_masked(chosen.replace("0-3: full", "0-3: select mlp")
                                                                     + peak)


def test_check_ignores_a_budget_choice_made_again_on_its_step_time():
    """A first choice whose measured step missed its prediction by more than the noise may be made again (one
    step later): timing; a choice made again because it measured over the budget is not."""
    chosen = "memory budget 0.4x = 3.63 MiB: chosen 0-3: full (from step 8; the figures above are from that step on)\n"
    peak = "  real peak (kept + largest rebuild + prefetched): predicted 2.78 MiB\n"
    again = "  chosen twice: the first choice's step time missed its prediction by more than the noise\n"
    assert regen.timing_masked(chosen + peak) == regen.timing_masked(chosen.replace("step 8", "step 9") + peak + again)
    over = "  chosen twice: the first choice measured over the budget\n"
    assert regen.timing_masked(chosen + peak) != regen.timing_masked(chosen + peak + over)


def test_the_code_figures_in_the_docs_are_the_code_s():
    """Every ``<!-- fig: ... -->`` figure (lines, modules) is what ``regen_docs --figures`` computes now; the test
    count, which needs a collection run, is checked by ``.ci/run`` (``regen_docs.py --figures --check``)."""
    markers = []
    for doc in regen.FIGURE_DOCS:
        text = (REPO / doc).read_text()
        markers += [(doc, m) for m in regen.FIGURE.finditer(text) if m.group(1) != "tests"]
        assert regen.figures(text, kinds={"lines", "modules"}) == text, f"{doc}: run python scripts/regen_docs.py --figures"
    assert {m.group(1) for _, m in markers} == {"lines", "modules"} and len(markers) >= 19


def test_a_figure_marker_is_rewritten_and_an_unknown_path_refused():
    text = "(`ledger.py`, <!-- fig: lines mindformers_ac/ledger.py -->1<!-- /fig --> lines)"
    lines = len((REPO / "mindformers_ac" / "ledger.py").read_text().splitlines())
    assert regen.figures(text) == text.replace(">1<", f">{lines:,}<")
    assert regen.figures("<!-- fig: tests -->9<!-- /fig -->", tests=lambda: 1234) == "<!-- fig: tests -->1,234<!-- /fig -->"
    with pytest.raises(SystemExit, match="names no file"):
        regen.figures("<!-- fig: modules no/such/*.py -->3<!-- /fig -->")


NAMED_TEST = re.compile(r"`(tests/test_\w+\.py)::(test_\w+)`")


def test_every_test_a_doc_names_for_a_claim_exists():
    """docs/config.md and docs/exactness.md name the test that holds each claim a user acts on (which call
    styles stay light, what a rule costs, what is refused), docs/architecture.md the tests that hold each rule
    file's invariant: each named test is defined in that file."""
    docs = ("docs/config.md", "docs/exactness.md", "docs/architecture.md")
    named = {(doc, m.groups()) for doc in docs for m in NAMED_TEST.finditer((REPO / doc).read_text())}
    assert {doc for doc, _ in named} == set(docs) and len(named) >= 20
    missing = []
    for doc, (path, name) in sorted(named):
        tree = ast.parse((REPO / path).read_text()) if (REPO / path).exists() else ast.Module(body=[])
        if name not in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}:
            missing.append(f"{doc}: {path}::{name}")
    assert missing == []


def test_the_named_test_scan_sees_a_missing_test():
    text = "(test: `tests/test_plan.py::test_no_such_test`)"
    ((path, name),) = [m.groups() for m in NAMED_TEST.finditer(text)]
    assert name not in {n.name for n in ast.parse((REPO / path).read_text()).body if isinstance(n, ast.FunctionDef)}
