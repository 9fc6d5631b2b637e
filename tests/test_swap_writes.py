"""Rule W6s (issue 37's W6 under swap; issue 49): a tensor a swapped region saved for backward and the code after
it writes in place trains as MindSpore trains it without AC, whatever object holds it.

What MindSpore 2.10 on CPU does without AC (measured: ``scripts/probe_saved_writes.py``): a write that
advances the version counter (``Tensor.copy_``, InplaceCopy) is refused at the backward ("One of the Tensor
needed for gradient computation has been modified by an inplace operation"); a write that keeps storage and
version (``ops.assign_add``, ``ops.assign``) is read by the backward (the written values); a rebinding
(``x[:, 0] = 0``, ``Tensor.assign_value``, a Tensor's ``set_data``: only a Parameter has ``set_data``) gives
``x`` new storage, and the backward reads the old values. Under swap: a saved tensor of the same storage as
the region's output, found in a tuple (a namedtuple too), list or dict, stays on the device; in any other
object (a dataclass, a custom class) it is offloaded, and the stamp that swap attaches to it at its group's
close (``swap/executor.py``, ``SavedStorage``) serves its live storage at the load, or keeps it when it dies
written, and refuses a ``copy_`` (issue 49: 90 values differed every step when the saved output, held in a
dataclass and written by ``ops.assign_add``, was read from its host copy). The model: layer 0 ends with a
sigmoid in its own cell (its output is what it saved) and returns it in a holder; the next layers write
their input, and go on with it (it stays alive until backward) or with a copy (it dies written).
"""
import collections
import re

import numpy as np
import pytest
from mindspore import Tensor, ops
from write_cases import HOLDERS, INPUT_WRITES

from mindformers_ac.swap.executor import HandleState, SwapExecutor

from isolated import run_isolated

SWAP_MODES = ("layer_swap", "op_swap", "swap_wrapper", "swap_api", "async_save_on_cpu")
# every write kind and holder with the written tensor dying after the write (the stamp compares it as it
# dies); alive until backward (served from its storage) for a holder swap finds (a tuple) and one it doesn't
CASES = [(how, holder, False) for how in INPUT_WRITES for holder in HOLDERS] + \
        [(how, holder, True) for how in INPUT_WRITES for holder in ("tuple", "dataclass")]

_MATRIX = '''
import write_cases as wc
wc.held_output_outcomes({cases!r}, {modes!r})
'''


@pytest.mark.slow
def test_a_write_after_the_save_trains_or_is_refused_as_without_ac_whatever_holds_the_output():
    """Each write kind (``copy_``, ``ops.assign_add``, ``ops.assign``, slice assignment, ``assign_value``) x
    each holder of layer 0's output (tuple, dict, dataclass, namedtuple, custom object) x each swap mode
    (layer swap, op swap, ``swap_wrapper``, ``swap``, ``async_save_on_cpu``), one step: bitwise with the model
    without AC where it trains, refused on the first backward where it refuses (``copy_``: MindSpore names
    the sigmoid's output, swap the group; both give the versions). One process (a refused backward can
    break MindSpore's executor: it is reset after each), about 50 s of one core (175 one-step runs)."""
    proc = run_isolated(_MATRIX.format(cases=CASES, modes=SWAP_MODES), timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in INPUT_WRITES]
    plain = {}
    got = collections.Counter()
    wrong = []
    for line in lines:
        how, holder, keeps, mode, outcome = line.split(" ", 4)
        if mode == "plain":
            plain[how, keeps] = outcome
            expected = "REFUSED" if how == "copy_" else "BITWISE"
            if not outcome.startswith(expected):
                wrong.append(f"without AC, {how}: {outcome[:200]}")
            continue
        got[mode] += 1
        if plain[how, keeps].startswith("REFUSED"):
            ok = (outcome.startswith("REFUSED RuntimeError One of the Tensor needed for gradient computation has "
                                     "been modified by an inplace operation")
                  and re.search(r"version is 1 ?, expected version 0", outcome)
                  and ("output of Sigmoid" in outcome or "swap group" in outcome))
        else:
            ok = outcome == "BITWISE"
        if not ok:
            wrong.append(f"{mode}, {how} into a {holder} output (kept alive: {keeps}): {outcome[:300]}")
    assert not wrong, "\n".join(wrong)
    assert got == {mode: len(CASES) for mode in SWAP_MODES}, (got, proc.stdout[-2000:], proc.stderr[-3000:])


def _stamped(ex, t):
    """Offload ``t`` as a swap group does: finished, then armed once the group dropped its references."""
    h = ex.start_offload(t, key="g")
    ex.finish_offloads([h])
    return h


def test_the_stamp_serves_the_live_storage_keeps_it_when_it_dies_written_and_refuses_a_new_version():
    """``SavedStorage`` on its own (rule W6s): while the caller holds the saved tensor, the load returns its
    storage (an ``ops.assign_add`` after the save is read) and gives the host buffer back; a tensor written
    and then dropped leaves its storage to the handle (the written values, not the host copy); one dropped
    unwritten is loaded from its host copy; a ``copy_`` (a new version) is refused at the load."""
    ex = SwapExecutor()
    held = Tensor(np.arange(64, dtype=np.float32))
    h = _stamped(ex, held)
    ops.assign_add(held, Tensor(np.ones(64, np.float32)))
    loaded = ex.load(h)
    assert np.array_equal(loaded.asnumpy(), np.arange(64, dtype=np.float32) + 1)
    assert loaded.data_ptr() == held.data_ptr() and h.state is HandleState.RELEASED
    assert ex.report.events[-1] == ("load", "g", "live")

    dropped = _stamped(ex, Tensor(np.arange(64, dtype=np.float32)))   # intermediate: dies unwritten at once
    written = Tensor(np.arange(64, dtype=np.float32))
    h = _stamped(ex, written)
    ops.assign(written, Tensor(np.full(64, 7.0, np.float32)))
    del written
    assert np.array_equal(ex.load(h).asnumpy(), np.full(64, 7.0, np.float32))
    assert np.array_equal(ex.load(dropped).asnumpy(), np.arange(64, dtype=np.float32))
    assert ex.report.events[-1] == ("load", "g", "on_demand")

    copied = Tensor(np.arange(64, dtype=np.float32))
    h = _stamped(ex, copied)
    copied.copy_(Tensor(np.zeros(64, np.float32)))
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a tensor swap group 'g' .*"
                                           r"its version is 1, expected version 0"):
        ex.load(h)
    ex.close()
