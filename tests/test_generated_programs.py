"""Layer programs no list names (issue 49, point 5): a seeded draw of ``program_generator`` programs, each
trained 2 steps with and without AC in one mode, must be bitwise or refused on its first backward, never
silently different or refused only after an optimizer step. A bounded share runs here (one subprocess: a
refusal goes through backward); ``scripts/hunt_programs.py`` runs thousands, and every program it ever
found is a fixed case below."""
import pytest

from isolated import run_isolated

# Found by scripts/hunt_programs.py. Seed 1: buffer_slot's written temporary freed, its address reused by the
# next step's input, which the re-run took for the written buffer (refused at step 1 on ce633c2). Seed 7:
# Python state before a kept MatMul, whose output (handed back as it was) hid the divergence from the
# region's output: silently different at step 0 (the safety net samples at kept ops now). Seeds 7, 11 and
# 49: a Parameter rebound in forward freed its address, which a later activation took and the region took
# for the Parameter (refused at step 1, on ce633c2 too).
FOUND = [(253228484, "checkpoint_wrapper"), (19767455, "checkpoint_wrapper"), (653360214, "exclude_op"),
         (440701291, "exclude_op"), (786372625, "exclude_op"), (288454308, "checkpoint_wrapper"),
         (854206912, "full"), (175390580, "group")]
CI_CASES, CI_SEED = 40, 49


@pytest.mark.parametrize("draw", ["found", "seeded"])
def test_generated_programs_are_exact_or_refused_on_the_first_backward(draw):
    cases = (f"[(gen.Program(s), m) for s, m in {FOUND!r}]" if draw == "found"
             else f"list(gen.cases({CI_SEED}, {CI_CASES}))")
    res = run_isolated(f"""
import collections
import program_generator as gen
counts = collections.Counter()
for program, mode in {cases}:
    kind, detail = gen.outcome(program, mode)
    counts[kind] += 1
    if kind not in ("exact", "refused"):
        print("FOUND", kind, program, mode, detail.replace(chr(10), " ")[:300])
print("COUNTS", sorted(counts.items()))
""", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "FOUND" not in res.stdout, res.stdout
    counts = dict(eval(res.stdout.split("COUNTS", 1)[1]))   # noqa: S307  (our own printout)
    assert counts.get("exact", 0) >= (2 if draw == "found" else CI_CASES // 2), counts
    assert counts.get("refused", 0) >= (2 if draw == "found" else 1), counts   # the safety net acted
