"""Rule W6s (issue 37's W6, under swap): a tensor a swapped region saved for backward and the code after it
writes in place trains as MindSpore trains it without AC.

What MindSpore 2.10 on CPU does without AC (measured: ``scripts/probe_saved_writes.py``): a write that
advances the version counter (``Tensor.copy_``, InplaceCopy) is refused at the backward ("One of the Tensor
needed for gradient computation has been modified by an inplace operation"), and MindSpore refuses it under
every swap mode too (its check reads the version the graph recorded, whatever the unpack hook returns); a
write that keeps storage and version (``ops.assign_add``, ``ops.assign``) is read by the backward (the
written values); a rebinding (``x[:, 0] = 0``) gives ``x`` new storage, and the backward reads the old
values. Before W6s every swap mode read the host copy taken as the region ended, so after an
``ops.assign_add`` the gradients differed from step 0 (layer swap, op swap, ``swap_wrapper``, ``swap``,
``async_save_on_cpu``: measured). Now a saved tensor of the same storage as the region's output stays on the
device (kept reason ``output``), and ``async_save_on_cpu`` (which does not see its block's output) finishes
a block's copies when the next block ends. The model: layer 0 ends with a sigmoid in its own cell (its
output is what it saved), layer 1 writes its input.
"""
import re

import pytest
import write_cases as wc

import mindformers_ac as mac

from isolated import run_isolated
from model_patterns import hidden_batch
from steps import first_difference, run_steps

SWAP_MODES = ("layer_swap", "op_swap", "swap_wrapper", "swap_api", "async_save_on_cpu")


def _build(how, keeps_input=True):
    return wc.build_layers(wc.writes_input_by(how, keeps_input), first=wc.SavesOutputCellLayer)


def _outputs_kept(report):
    return sum(s.kept_reasons["output"] for s in report.layers.values())


@pytest.mark.parametrize("mode", SWAP_MODES)
@pytest.mark.parametrize("how, keeps_input", [("assign_add", True), ("assign_add", False), ("setitem", True)])
def test_saved_tensor_written_later_trains_bitwise_with_the_plain_twin(mode, how, keeps_input):
    """The next layer writes layer 0's saved output with ``ops.assign_add`` (the backward reads the written
    values) or rebinds it by slice assignment (it reads the old ones), and goes on with it or with a copy:
    bitwise with the model without AC over two steps; the saved output was kept on the device (the API
    modes report to the process-wide manager: counted as a difference)."""
    base = run_steps(_build(how, keeps_input), hidden_batch, steps=2)
    model = _build(how, keeps_input)
    manager = mac.SwapManager().report
    kept_before, offloaded_before = _outputs_kept(manager), sum(s.num_offloaded for s in manager.layers.values())
    wc.swap_first_layer(model, mode)
    got = run_steps(model, hidden_batch, steps=2)
    assert first_difference(base, got) is None, f"{mode}, {how}: {first_difference(base, got)}"
    state = mac.ac_state(model)
    report = state.swap_report if state is not None else manager
    if mode == "async_save_on_cpu":   # it can't see its block's output: the block's copies wait for the next
        assert sum(s.num_offloaded for s in report.layers.values()) > offloaded_before
    else:
        assert _outputs_kept(report) - (0 if state is not None else kept_before) >= 2   # one per step


_COPY_WRITTEN = '''
import mindformers_ac as mac
import write_cases as wc
from model_patterns import hidden_batch
model = wc.build_layers(wc.writes_input_by("copy_", {keeps_input}), first=wc.SavesOutputCellLayer)
if {mode!r} != "plain":
    wc.swap_first_layer(model, {mode!r})
wc.print_one_step_outcome(model, hidden_batch)
'''


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("plain",) + SWAP_MODES)
def test_saved_tensor_written_by_copy_is_refused_as_without_ac(mode):
    """``copy_`` advances the version counter: MindSpore refuses the backward without AC, naming the
    sigmoid's output; every swap mode refuses it too, whether the written tensor stays alive (saved by the
    writer) or dies after the write: the handle compares the version the tensor had when saved with the
    version of what it holds (the kept output, or the device tensor as its deferred copy is taken)."""
    for keeps_input in (True, False):
        proc = run_isolated(_COPY_WRITTEN.format(mode=mode, keeps_input=keeps_input))
        out = proc.stdout
        assert "REFUSED RuntimeError One of the Tensor needed for gradient computation has been modified by an " \
               "inplace operation" in out, out + proc.stderr[-2000:]
        assert re.search(r"its version is 1 ?, expected version 0", out), out
        if mode == "plain":
            assert "which is the 0 's output of Sigmoid" in out, out
        else:   # MindSpore's own check (naming the op) or the swap's, naming the group, before either is read
            assert "output of Sigmoid" in out or "swap group" in out, out


@pytest.mark.parametrize("mode", ["swap_wrapper"])   # the other modes: model_patterns' dataclass_output_assign_add
def test_saved_output_inside_a_dataclass_written_later_trains_bitwise(mode):
    """Issue 49: layer 0 returns ``LayerOutput(hidden=h)`` (a dataclass), layer 1 writes ``h`` with
    ``ops.assign_add`` (no new version: the backward reads the written values). The output is found inside
    the dataclass, so the saved ``h`` stays on the device: bitwise with the model without AC (on main 90
    values differed every step)."""
    base = run_steps(wc.build_dataclass_output("assign_add"), hidden_batch, steps=2)
    model = wc.build_dataclass_output("assign_add")
    manager = mac.SwapManager().report
    kept_before = _outputs_kept(manager)
    wc.swap_first_layer(model, mode)
    got = run_steps(model, hidden_batch, steps=2)
    assert first_difference(base, got) is None, f"{mode}: {first_difference(base, got)}"
    if mode != "async_save_on_cpu":   # it sees no output: its block's copies wait for the next block
        state = mac.ac_state(model)
        report = state.swap_report if state is not None else manager
        assert _outputs_kept(report) - (0 if state is not None else kept_before) >= 2
