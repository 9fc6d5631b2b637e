"""The light path with per-step tensors passed in tuples, lists and dicts (LLaMA ``freqs_cis``, HF
``position_embeddings``): it is taken from the second step, holds nothing of a finished step, and
stays bitwise equal to training without recompute."""
import gc
import weakref

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn, ops
from test_light_path import light_calls  # noqa: F401  # pylint: disable=unused-import  # the fixture

import mindformers_ac as mac
from mindformers_ac.recompute import path_choice

from steps import first_difference, run_steps

H, B, S, N, STEPS = 32, 2, 8, 3, 6


def pack(kind, cos, sin):
    if kind == "tuple":
        return (cos, sin)
    if kind == "list":
        return [cos, sin]
    if kind == "dict":
        return {"cos": cos, "sin": sin}
    return ({"tables": [cos, (sin,)]}, 2.0)   # nested, with a float


def unpack(kind, rope):
    if kind == "dict":
        return rope["cos"], rope["sin"]
    if kind == "nested":
        tables = rope[0]["tables"]
        return tables[0] * rope[1], tables[1][0]
    return rope[0], rope[1]


class RopeLayer(nn.Cell):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.q = mint.nn.Linear(H, H)
        self.fc = mint.nn.Linear(H, H)

    def construct(self, x, rope):
        cos, sin = unpack(self.kind, rope)
        q = self.q(x)
        return x + self.fc(ops.tanh(q * cos + q.flip((-1,)) * sin))


class RopeModel(nn.Cell):
    """Rotary tables made per step from the step's positions, handed to every layer in one structure."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.layers = nn.CellList([RopeLayer(kind) for _ in range(N)])
        self.inv = Tensor((1.0 / 10000 ** (np.arange(H) / H)).astype(np.float32))
        self.tables = []   # weakrefs to each step's tables
        for name, p in self.parameters_and_names():
            p.set_data(Tensor(np.random.RandomState(len(name)).uniform(-0.3, 0.3, p.shape).astype(np.float32)))

    def construct(self, x, y, pos):
        ang = pos.astype(ms.float32).expand_dims(-1) * self.inv
        cos, sin = ops.cos(ang), ops.sin(ang)
        self.tables.extend([weakref.ref(cos), weakref.ref(sin)])
        rope = pack(self.kind, cos, sin)
        for layer in self.layers:
            x = layer(x, rope)
        return ((x.sum(-1) - y) ** 2).mean()


def batch(step):
    rng = np.random.RandomState(step)
    pos = Tensor(np.arange(S, dtype=np.int32)[None, :] + np.array([[0], [step]], np.int32))
    return Tensor(rng.randn(B, S, H).astype(np.float32)), Tensor(rng.randn(B, S).astype(np.float32)), pos


FULL = {"recompute": {"mode": "full", "full_recompute_layer": [f"0-{N - 1}"]}}


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "nested"])
def test_light_path_with_structured_per_step_tensors(light_calls, kind):  # noqa: F811
    base = run_steps(RopeModel(kind), batch, steps=STEPS)
    model = RopeModel(kind)
    mac.apply_ac(model, config=FULL)
    history = run_steps(model, batch, steps=STEPS)
    assert first_difference(base, history) is None
    # Every layer checks the path on the first step and is light on all the others.
    assert len(light_calls) == N * (STEPS - 1)
    stats = mac.ac_state(model).recompute_stats.values()
    assert sum(s.recompute_calls for s in stats) == N * STEPS
    gc.collect()
    assert len(model.tables) == 2 * STEPS and all(ref() is None for ref in model.tables)
    for layer in model.layers:   # one path check per layer: the signature holds no tensor of a step
        checks = mac.recompute.api._wrap_info(layer).path_checks   # pylint: disable=protected-access
        assert len(checks) == 1
    mac.remove_ac(model)


def test_an_argument_the_signature_cannot_describe_takes_the_full_path(light_calls):  # noqa: F811
    """An object of the caller's own kind is neither held nor guessed at: no path check, intercepting path, exact."""

    class Tables:
        def __init__(self, cos, sin):
            self.cos, self.sin = cos, sin

    assert path_choice.PathChecks.key(None, (Tables(1, 2),), {}) is None
    key = path_choice.PathChecks.key(None, ((Tensor(np.ones(2, np.float32)), 1, 1.0, True, ms.float16),),
                                  {"d": {"a": [None, "s"]}})
    assert key == path_choice.PathChecks.key(None, ((Tensor(np.zeros(2, np.float32)), 1, 1.0, True, ms.float16),),
                                          {"d": {"a": [None, "s"]}})
    assert key != path_choice.PathChecks.key(None, ((Tensor(np.zeros(2, np.float32)), True, 1.0, True, ms.float16),),
                                          {"d": {"a": [None, "s"]}})
    assert not light_calls


class _KeptTanhLayer(nn.Cell):
    """An nn.Dropout and a kept op in an attribute slot: what a checking call records for the light path."""

    def __init__(self):
        super().__init__()
        self.fc = mint.nn.Linear(H, H)
        self.drop = nn.Dropout(p=0.2)
        self.act = ops.Tanh()

    def construct(self, x):
        return x + self.fc(self.act(self.drop(x)) * x)


def test_the_checking_call_is_recorded_apart_from_the_region(monkeypatch):
    """Issue 37: the checking call's Region hands what it observes to a CheckRecorder (saves, the nn.Dropout
    kernel call, the kept op's site), whose ``finish`` fills the PathCheck the light path then only reads;
    the Region builds no light-path data of its own."""
    finished = []
    real = path_choice.CheckRecorder.finish

    def finish(self, region):
        real(self, region)
        finished.append((self, region.kept.policy_saves, {a for a in ("cell_dropouts", "op_sites", "_cells",
                                                                   "path_check") if hasattr(region, a)}))
    monkeypatch.setattr(path_choice.CheckRecorder, "finish", finish)
    ms.set_seed(3)
    net = _KeptTanhLayer()
    net.set_train(True)
    mac.checkpoint_wrapper(net, policy_fn=mac.recompute.exclude_policy(names=["Tanh"]))
    stats = mac.recompute.get_checkpoint_stats(net)
    grad = ms.grad(lambda v: net(v).sum(), grad_position=None, weights=net.trainable_params())
    x = Tensor(np.random.default_rng(0).standard_normal((B, H)).astype(np.float32))
    for _ in range(3):
        grad(x)
    assert len(finished) == 1, "one checking call for the one signature"
    recorder, kept, region_fields = finished[0]
    check = recorder.check
    assert check.ok and (stats.intercepted_calls, stats.light_calls) == (1, 2)
    assert len(recorder.cell_dropouts) == check.n_dropouts == 1
    assert len(kept) == 1 and check.n_kept_ops == 1 and len(check.keep_proxies) == 1
    assert check.fwd == [m for m, key in zip(recorder.fwd, recorder.keys) if key is None or key[0] not in kept]
    assert region_fields == set()
    mac.recompute.unwrap(net)
