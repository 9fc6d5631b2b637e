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


# Wrong refusals the hunt found over the new modes (issue 49, point 5; --seed 49, see docs/exactness.md): each
# minimal program trains bitwise under full recompute, checkpoint_wrapper and select of its body, and is refused
# by the mode below on its first backward (no step taken, so not a finding of the hunt, but an engine bug).
WRONG_REFUSALS = {
    # nested: a model Parameter handed to the inner region and rebound there (shared.set_data): the outer re-run's
    # replay of the inner region reads the rebound value, which the safety net refuses in 'layers.0.body'
    "nested_argument_set_data": (("outside_set_data",), "nested"),
    # nested: a one-slot buffer write (self.hist[0] = ...) in the inner region: the safety net refuses the
    # outer re-run in 'layers.1' at op #2 Tanh (the hist value the inner replay reads is not the forward's)
    "nested_buffer_slot": (("buffer_slot",), "nested"),
    # select of the body that rebinds the model's Parameter handed to it (shared.set_data): exact under full,
    # refused by the safety net in 'layers.0.body' at op #0 Mul (the select region's re-run reads the value
    # layer 1 rebound after the body's forward; W4 restores only what the region's own forward rebound)
    "select_argument_set_data": (("outside_set_data",), "select"),
}
# Wrong refusals the hunt found that are fixed: each trains bitwise in its mode now (regression cases).
FIXED_REFUSALS = {
    # a Parameter rebound in the inner region after another op: the old per-forward set_data/assign_value
    # wrapper's copy was an op the outer re-run's replay did not run; RebindSlot (once per wrapper) runs none
    "nested_set_data": (("activation", "own_set_data"), "nested"),
    "nested_assign_value": (("activation", "own_assign_value"), "nested"),
    # a random op after another op in the inner region: the safety net compared the kept op's cut in the
    # outer re-run's replay of the inner region, which rebuilds nothing (now only in the region's own re-run)
    "nested_random_after_op": (("activation", "laplace"), "nested"),
}


@pytest.fixture(scope="module")
def wrong_refusals():
    res = run_isolated(f"""
import program_generator as gen
for name, (statements, mode) in {dict(WRONG_REFUSALS, **FIXED_REFUSALS)!r}.items():
    for m in (mode, "full"):
        kind, detail = gen.outcome(gen.Program.of(statements), m)
        print("OUTCOME", name, m, kind, detail.replace(chr(10), " ")[:300])
""", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    outcomes = [line.split(None, 4)[1:] for line in res.stdout.splitlines() if line.startswith("OUTCOME")]
    return {(name, mode): (kind, *detail) for name, mode, kind, *detail in outcomes}


@pytest.mark.parametrize("name", sorted(WRONG_REFUSALS))
def test_wrongly_refused_programs_are_refused_on_the_first_backward_and_exact_under_full(wrong_refusals, name):
    """What the xfail below stands on: today refused (not silent, not late), and exact under full recompute."""
    mode = WRONG_REFUSALS[name][1]
    assert wrong_refusals[(name, mode)][0] == "refused", wrong_refusals[(name, mode)]
    assert "RecomputeError" in wrong_refusals[(name, mode)][1], wrong_refusals[(name, mode)]
    assert wrong_refusals[(name, "full")][0] == "exact", wrong_refusals[(name, "full")]


@pytest.mark.xfail(strict=True, reason="engine bug: refused by nested wrappers / select though exact under full "
                                       "recompute (see WRONG_REFUSALS)")
@pytest.mark.parametrize("name", sorted(WRONG_REFUSALS))
def test_programs_wrongly_refused_by_a_mode_train_bitwise(wrong_refusals, name):
    mode = WRONG_REFUSALS[name][1]
    assert wrong_refusals[(name, mode)][0] == "exact", wrong_refusals[(name, mode)]


@pytest.mark.parametrize("name", sorted(FIXED_REFUSALS))
def test_programs_once_wrongly_refused_train_bitwise(wrong_refusals, name):
    mode = FIXED_REFUSALS[name][1]
    assert wrong_refusals[(name, mode)][0] == "exact", wrong_refusals[(name, mode)]
