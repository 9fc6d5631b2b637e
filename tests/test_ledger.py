"""One ledger of activation bytes (issue 37): recompute regions and swap groups count through
``ledger.ActivationLedger``, and ``RecomputeStats``, the swap report and ``LayerMeter`` read its totals."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import mindformers_ac as mac
from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.ledger import ActivationLedger, LedgerTotals


def test_the_ledger_counts_each_key_once_and_weights_never():
    weight, a = Tensor(np.ones((4, 4), np.float32)), Tensor(np.ones((8, 4), np.float32))
    view = a[:2]
    ledger = ActivationLedger({weight.data_ptr()})
    ledger.keep(weight)                  # a weight: never
    ledger.keep(a)
    ledger.keep(view)                    # the same storage as ``a``: once
    assert ledger.keep_bytes(("bits", 0), 16)
    assert not ledger.keep_bytes(("bits", 0), 16)   # a key already kept
    ledger.swap_bytes("handle", 32)
    ledger.swap_bytes("given up", 64)
    ledger.unswap("given up")
    ledger.rebuilt(100)
    totals = ledger.close()
    assert totals == LedgerTotals(kept=a.nbytes + 16, dropped=100, swapped=32, num_kept=2, num_swapped=1)
    assert ledger.kept is None and ledger.dropped_total == 100   # only the totals stay


@pytest.fixture
def closed_ledgers(monkeypatch):
    """Every ledger closed while the fixture is active: ``(param_ptrs is None, totals)`` (swap groups leave
    weights out themselves and give no weight pointers; recompute regions give theirs)."""
    closed = []
    close = ActivationLedger.close

    def recording_close(ledger):
        totals = close(ledger)
        closed.append((ledger.param_ptrs is None, totals))
        return totals
    monkeypatch.setattr(ActivationLedger, "close", recording_close)
    return closed


def test_the_engines_figures_are_the_ledgers_totals(closed_ledgers):
    """Layer swap on layers 0-1 and full recompute on 2-3 of the reference GPT, one training step: the swap
    report's offloaded and resident figures are the sums of its groups' ledgers, ``RecomputeStats``' kept
    and dropped bytes the sums of its regions', and ``measure_step`` reads the same."""
    ms.set_seed(0)
    model = build_gpt(num_layers=4, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64)
    mac.apply_ac(model, recompute={"mode": "full", "full_recompute_layer": ["2-3"]},
                 swap={"enable": True, "layer_swap": [{"layers": ["0-1"]}]})
    batch = synthetic_batch(2, 16, 64, seed=1)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    grad_fn(*batch)   # the first call of each region checks its signature
    closed_ledgers.clear()
    state = mac.ac_state(model)
    memory = mac.measure_step(model, grad_fn, *batch)   # resets the engines' step figures first
    swap = [t for is_swap, t in closed_ledgers if is_swap]
    regions = [t for is_swap, t in closed_ledgers if not is_swap]
    assert len(swap) == 2 and len(regions) == 2   # one group per swapped layer, one region per recomputed one

    snap = state.swap_report.as_dict()   # the measured step's
    assert snap["offloaded_bytes"] == sum(t.swapped for t in swap) > 0
    assert snap["num_offloaded"] == sum(t.num_swapped for t in swap)
    assert snap["resident_bytes"] == sum(t.kept for t in swap)
    assert snap["num_resident"] == sum(t.num_kept for t in swap)
    assert sum(s.kept_bytes for s in state.recompute_stats.values()) == sum(t.kept for t in regions) > 0
    assert sum(s.dropped_bytes for s in state.recompute_stats.values()) == sum(t.dropped for t in regions) > 0
    assert sum(memory.layers[i].offloaded_bytes for i in (0, 1)) == snap["offloaded_bytes"]
    assert sum(memory.layers[i].recomputed_bytes for i in (2, 3)) == sum(t.dropped for t in regions)
