"""One class per action: the plan, its table, summary and YAML, and ``apply_ac`` loop over ``actions.ACTIONS``.

Every registered action answers the whole contract; a plan with all six reads them back through the
``LayerPlan`` attributes (``plan.LAYER_FACTS``); and an action registered from outside (a scratch norm
recompute, written back as the ``recompute_comm`` paths it amounts to) is planned, shown, installed,
bitwise and removed with no change to ``plan.py`` or ``apply.py``; its targets go through every model
check (a jit cell, a cell shared by two layers) and the overlap table, as the six's do.
"""
import dataclasses

import mindspore as ms
import pytest

import mindformers_ac as mac
import mindformers_ac.apply as apply_module
import mindformers_ac.plan as plan_module
from mindformers_ac.actions import ACTIONS, TABLE_COLUMNS, Action, ListFragment, OutputRecompute
from mindformers_ac.actions.base import place
from mindformers_ac.actions.output import install_op_output, op_output_target
from mindformers_ac.harness.models import build_gpt, synthetic_batch

from conftest import model_fingerprint
from steps import first_difference, run_steps

GPT = dict(num_layers=8, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.1, seed=3)
EVERY_ACTION = {
    "recompute": {"mode": "select", "full_recompute_layer": ["0-2"], "group_layers": 2,
                  "select_module": {r".*mlp": [3], r"mlp\.activation_func": [4]}, "exclude_op": ["Softmax"]},
    "recompute_comm": {"enable": True, "select_module": {r"self_attention\.core_attention\.softmax": [4]}},
    "swap": {"enable": True, "layer_swap": [{"layers": [5]}], "op_swap": [{"op_name": r".*mlp", "layers": [6]}]},
}


def _batch(step):
    return synthetic_batch(2, 16, 64, seed=step)


def test_a_plan_with_every_action_reads_back_through_the_layer_plan():
    plan = mac.plan_ac(build_gpt(**GPT), config=EVERY_ACTION)
    kinds = {type(a).__name__ for lp in plan.layers.values() for a in lp.actions}
    assert kinds == {cls.__name__ for cls in ACTIONS}
    lp = plan.layers
    assert lp[0].full_recompute and lp[0].group == (0, 1) and lp[2].group == () and lp[2].full_recompute
    assert lp[3].recompute == ("mlp",) and lp[3].exclude == ("Softmax",) and not lp[3].exclude_by_path
    assert lp[4].recompute == ("mlp.activation_func",)
    assert lp[4].recompute_comm == ("self_attention.core_attention.softmax",)
    assert lp[5].layer_swap and lp[5].prefetch_layer == 6 and lp[6].op_swap == ("mlp",) and lp[6].prefetch_layer == 7
    assert lp[7].is_empty and not lp[7].actions
    # each action fills its own cells of the table and its own part of the summary
    rows = {line.split()[0]: line for line in str(plan).splitlines()[2:10]}
    assert rows["0"].split()[1:4] == ["full", "(group", "0-1)"] and rows["5"].split()[1:] == ["-", "-", "-", "layer", "6"]
    assert plan.summary() == ("full recompute on layers 0-1 (groups of 2: 0-1; keeping Softmax); full recompute on "
                              "layer 2 (keeping Softmax); select recompute on layer 3 (mlp; keeping Softmax); select "
                              "recompute on layer 4 (mlp.activation_func; keeping Softmax); comm recompute on layer 4 "
                              "(self_attention.core_attention.softmax); layer swap on layer 5 (prefetch 1); op swap "
                              "on layer 6 (mlp; prefetch 1)")
    # and its own share of the YAML: planning what the plan writes gives the same actions
    again = mac.plan_ac(build_gpt(**GPT), config=plan.to_dict())
    assert {i: l.actions for i, l in again.layers.items()} == {i: l.actions for i, l in plan.layers.items()}


class _NormRecompute(Action):
    """A scratch action: the outputs of a layer's LayerNorm ops are recomputed, on the layers in ``LAYERS``."""

    name = "norm recompute"
    recomputes = True
    LAYERS = (1, 2)

    def __init__(self, paths):
        self.paths = tuple(paths)

    @classmethod
    def plan(cls, planning):
        for i in cls.LAYERS:
            entries = [e for e in planning.inventory(i) if e.is_op and e.path.endswith("layer_norm")
                       and place(planning, i, op_output_target(e, i), "norm_recompute")]
            planning.plans[i].actions.append(cls(e.path for e in entries))
            planning.plans[i].targets.update({e.path: e for e in entries})

    def targets(self, lp):   # what the model checks and the overlap rules see of it
        return [op_output_target(lp.targets[p], lp.layer_id) for p in self.paths]

    def describe(self):
        return ["norm recompute"]

    def table_cells(self, plan):
        return {"comm recompute": "norms"}

    def summary(self, plan):
        return self.name, f"{len(self.paths)} ops"

    def yaml_lists(self):   # what it amounts to in a config the library reads without it
        return [ListFragment("comm_select", paths=self.paths)]

    def install(self, state, lp, layer, model):
        for path in self.paths:
            install_op_output(state, lp, layer, lp.targets[path], state.stats_for(lp.layer_id))


def test_an_action_registered_from_outside_needs_no_change_to_plan_or_apply(monkeypatch):
    _with_norm_recompute(monkeypatch)
    plain, model = build_gpt(**GPT), build_gpt(**GPT)
    before = model_fingerprint(model)
    plan = mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": [0]}})
    assert plan.layers[1].describe() == ["norm recompute"] and plan.layers[1].recomputed
    assert "\n1      -          norms" in str(plan)
    assert plan.summary() == "full recompute on layer 0; norm recompute on layers 1-2 (2 ops)"
    norms = ["input_layernorm.layer_norm", "pre_mlp_layernorm.layer_norm"]
    assert {k: v for k, v in plan.to_dict()["recompute_comm"]["select_module"].items()} == \
        {r"input_layernorm\.layer_norm": ["1-2"], r"pre_mlp_layernorm\.layer_norm": ["1-2"]}
    assert first_difference(run_steps(plain, _batch), run_steps(model, _batch)) is None
    stats = mac.ac_state(model).recompute_stats
    assert stats[1].rerun_by_op == {"LayerNorm.layer_norm": 6} == stats[2].rerun_by_op   # 2 norms x 3 steps
    mac.remove_ac(model)
    assert model_fingerprint(model)[0] == before[0]   # trained, and every patch of the action is gone
    # the written YAML is what the action amounts to for a library without it
    monkeypatch.undo()
    replanned = mac.plan_ac(build_gpt(**GPT), config=plan.to_dict())
    assert replanned.layers[1].actions == [OutputRecompute(norms)]


def _with_norm_recompute(monkeypatch):
    registry = ACTIONS + (_NormRecompute,)
    monkeypatch.setattr(plan_module, "ACTIONS", registry)
    monkeypatch.setattr(apply_module, "ACTIONS", registry)


def _jit_norm(model):
    norm = model.decoder.layers[1].input_layernorm
    norm.construct = ms.jit(norm.construct)


def _shared_norm(model):
    model.decoder.layers[2].input_layernorm = model.decoder.layers[1].input_layernorm


@pytest.mark.parametrize("change, refusal", [
    (_jit_norm, r"^model: layer 1 cell 'input_layernorm' \(\w+\) has a construct compiled by ms\.jit, and the config "
                r"acts on it or inside it \(output recompute of op 'input_layernorm\.layer_norm' in layer 1\)"),
    (_shared_norm, r"^model: the module holding input_layernorm\.layer_norm of layer 1 is also part of layer 2 "
                   r"\(a shared module\) and the config acts on it \(output recompute of op"),
], ids=["jit_cell", "shared_cell"])
def test_an_action_registered_from_outside_goes_through_every_model_check(monkeypatch, change, refusal):
    """The checks read each action's targets, not a list of known actions: a jit cell or a cell shared by two
    layers is refused for the scratch action as for the six, and the model is left untouched."""
    _with_norm_recompute(monkeypatch)
    model = build_gpt(**GPT)
    change(model)
    before = model_fingerprint(model)
    with pytest.raises(mac.ConfigError, match=refusal):
        mac.apply_ac(model, config={})
    assert model_fingerprint(model) == before and mac.ac_state(model) is None
    monkeypatch.undo()   # without the scratch action the same model plans (nothing acts on the cell)
    assert mac.plan_ac(model, config={}).active_layers() == []


def test_the_overlap_rules_hold_for_an_action_registered_from_outside(monkeypatch):
    """A swap planned after the scratch action meets its targets in ``OVERLAPS``: refused on the swap's field."""
    registry = ACTIONS[:4] + (_NormRecompute,) + ACTIONS[4:]   # before the swaps, as a recompute is
    monkeypatch.setattr(plan_module, "ACTIONS", registry)
    config = {"swap": {"enable": True, "op_swap": [{"op_name": "input_layernorm", "layers": [1]}]}}
    with pytest.raises(mac.ConfigError, match=r"^swap\.op_swap\[0\]: input_layernorm in layer 1 overlaps output "
                                              r"recompute of op 'input_layernorm\.layer_norm' in layer 1 \(same "
                                              r"module, parent or child\): recompute and swap can't share a module"):
        mac.plan_ac(build_gpt(**GPT), config=config)


@pytest.mark.parametrize("action", ACTIONS, ids=lambda cls: cls.__name__)
def test_every_action_keeps_the_whole_contract(action):
    """Each registered class overrides what the loops call (an omission would be a NotImplementedError at
    plan or apply time on some config), and its cells are columns of the table."""
    for name in ("plan", "targets", "describe", "table_cells", "summary", "yaml_lists"):
        assert getattr(action, name) is not getattr(Action, name), name
    assert action.install is not Action.install or action.install_all is not Action.install_all
    plan = mac.plan_ac(build_gpt(**GPT), config=EVERY_ACTION)
    for lp in plan.layers.values():
        for a in lp.actions:
            if type(a) is action:
                assert set(a.table_cells(plan)) <= set(TABLE_COLUMNS)
                assert a.describe() and a.summary(plan)[0] and a.yaml_lists()


def test_the_registry_order_is_the_install_order(monkeypatch):
    installed = []
    reals = {cls: cls.install_all.__func__ for cls in ACTIONS}   # before any is patched (groups inherit full's)
    for cls, real in reals.items():
        monkeypatch.setattr(cls, "install_all", classmethod(
            lambda c, state, items, model, real=real: (installed.append(c.__name__), real(c, state, items, model))))
    model = build_gpt(**GPT)
    mac.apply_ac(model, config=EVERY_ACTION)
    assert installed == [cls.__name__ for cls in ACTIONS]
    mac.remove_ac(model)


def test_each_section_reaches_its_engine_whole(monkeypatch):
    """Settings reach the engines in one place: the recompute regions and the swap scheduler hold the section
    ``apply_ac`` was given (``Region.settings``, ``SwapScheduler.settings``), so a new field one of them
    reads needs no line in between (docs/architecture.md's change-cost table); ``early_stop`` is read from it,
    with no keyword of its own on the way."""
    import mindformers_ac.recompute.region as region_module
    import mindformers_ac.swap.scheduler as scheduler_module

    seen = []
    for module, cls in ((region_module, "Region"), (scheduler_module, "SwapScheduler")):
        real = getattr(module, cls).__init__

        def spy(self, *args, real=real, **kwargs):
            real(self, *args, **kwargs)
            seen.append(self.settings)
        monkeypatch.setattr(getattr(module, cls), "__init__", spy)
    config = {"recompute": {"mode": "select", "select_module": {r".*mlp": [0], r"self_attention": [1]},
                            "exclude_op": ["Softmax"], "early_stop": False},
              "swap": {"enable": True, "layer_swap": [{"layers": [3]}], "min_bytes": 0}}
    model = build_gpt(**GPT)
    mac.apply_ac(model, config=config)
    run_steps(model, _batch, steps=1)
    given = mac.ac_state(model).config
    assert seen and {id(s) for s in seen} == {id(given.recompute), id(given.swap)}
    assert "early_stop" not in region_module.Region.__init__.__code__.co_varnames   # read from the section
    # min_bytes and default_prefetch travel in the section only: the engine lists no field of it
    from mindformers_ac.actions.swap_section import SwapEngine
    assert {f.name for f in dataclasses.fields(SwapEngine)} == {"executor", "params", "mtp", "settings"}
    mac.remove_ac(model)


class _UnplacedNormRecompute(_NormRecompute):
    """The scratch action with a ``plan`` that does not ``place`` its targets (a contract half kept)."""

    config_field = "norm_recompute"

    @classmethod
    def plan(cls, planning):
        for i in cls.LAYERS:
            entries = [e for e in planning.inventory(i) if e.is_op and e.path.endswith("layer_norm")]
            planning.plans[i].actions.append(cls(e.path for e in entries))
            planning.plans[i].targets.update({e.path: e for e in entries})


def test_an_action_that_does_not_place_its_targets_is_still_refused_where_it_meets_another(monkeypatch):
    monkeypatch.setattr(plan_module, "ACTIONS", ACTIONS + (_UnplacedNormRecompute,))   # after the swaps
    model = build_gpt(**GPT)
    before = model_fingerprint(model)
    config = {"swap": {"enable": True, "op_swap": [{"op_name": "input_layernorm", "layers": [1]}]}}
    with pytest.raises(mac.ConfigError, match=r"^norm_recompute: output recompute of op 'input_layernorm\.layer_norm'"
                                              r" in layer 1 overlaps op swap of 'input_layernorm' in layer 1: "
                                              r"recompute and swap can't share a module"):
        mac.apply_ac(model, config=config)
    assert model_fingerprint(model) == before and mac.ac_state(model) is None
