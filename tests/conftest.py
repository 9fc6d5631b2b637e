"""Shared test set-up: synchronous PyNative on CPU, small reference models, a model fingerprint."""
import hashlib

import pytest

from mindformers_ac.mindspore_compat import synchronous_pynative

synchronous_pynative("CPU")

# The modules that take longest, longest first (a `--durations` run): pytest.ini hands whole modules to the
# workers in collection order, and a long module started last would keep one worker busy after the others end.
LONGEST_FIRST = ("test_three_runs.py", "test_tp.py", "test_data_parallel.py", "test_ep.py",
                 "test_model_patterns.py", "test_training_run.py", "test_model_lifetimes.py",
                 "test_pipeline_msrun.py", "test_failed_steps.py", "test_user_model.py", "test_moe.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order


def model_fingerprint(model):
    """Everything apply/plan could change: cell tree, instance attributes, hooks, parameter bytes."""
    cells = []
    for path, cell in model.cells_and_names():
        # MindSpore keeps an inert CellBackwardHook primitive after the last backward hook is removed
        attrs = tuple(sorted((k, id(v)) for k, v in vars(cell).items()
                             if (callable(v) or k in ("_cells", "_params")) and not k.startswith("_cell_backward")))
        hooks = tuple(len(getattr(cell, name))
                      for name in ("_forward_pre_hook", "_forward_hook", "_backward_pre_hook",
                                   "_backward_hook", "_forward_pre_hook_with_kwargs", "_forward_hook_with_kwargs"))
        cells.append((path, type(cell).__name__, id(cell), attrs, hooks,
                      tuple(sorted(cell._cells)), getattr(cell, "_saved_tensors_pack_hook", None)))
    params = tuple((p.name, hashlib.sha1(p.asnumpy().tobytes()).hexdigest())
                   for p in model.get_parameters())
    return cells, params


@pytest.fixture
def fresh_swap_manager():
    """The process-wide SwapManager empty before and after the test (the API modes link layers in it)."""
    import mindformers_ac as mac
    mac.SwapManager().reset()
    yield
    mac.SwapManager().reset()


@pytest.fixture(scope="module")
def gpt8():
    from mindformers_ac.harness.models import build_gpt
    return build_gpt(num_layers=8, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.0)
