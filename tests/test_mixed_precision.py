"""Mixed precision with AC: ``to_float`` and amp O2/O3, before or after ``apply_ac``, in every AC mode.

PyNative mixed precision is a type that ``Cell.__call__`` pushes around
``construct`` (the executor casts every op's float inputs while it is set).
The recompute re-runs a region from backward, outside that call, and must
push the forward's type itself; the engine's own copies (saved inputs, copies
of written parameters) must not be cast. Each test trains 3 steps and
compares the loss, every gradient and every parameter bitwise with the same
mixed-precision model without AC.

bf16 on CPU (MindSpore 2.10): MatMul, Softmax, the activations, LayerNorm and
Gather have no bf16 kernel, so a bf16 transformer can't run here. The bf16
model below does its elementwise work in bf16 and keeps its MLP (MatMul,
GeLU) and head in fp32 cells, as amp O2 keeps its black list: the region
then mixes two types, which is the harder case for the recompute.

amp O1 rewrites the network into new cells: applied before ``apply_ac`` it is
an ordinary model; applied after, the rewritten network is refused (its cells
carry copies of the original's patches).

Also here: what a region keeps under fp16 (its inputs in their own dtype),
fp16 ``nn.Dropout`` masks kept as bits, and the engine's own copies made
without casts.
"""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, mint, nn, ops

import mindformers_ac as mac

from conftest import model_fingerprint
from isolated import run_isolated
from model_patterns import FFN, MLP, PATTERNS, B, H, Pattern, S, init_weights, mode_config
from steps import assert_acted, first_difference, install_api, run_steps

pytestmark = pytest.mark.usefixtures("fresh_swap_manager")   # each test starts from an empty SwapManager


AC_MODES = ("full", "group", "select_cell", "select_op", "exclude_op", "recompute_comm", "layer_swap", "op_swap",
            "mixed")
ORDERS = ("before", "after")


# -- how a user turns mixed precision on -------------------------------------------------------

def _to_float(dtype):
    def prepare(model):
        model.to_float(dtype)
        return model
    return prepare


def _amp(level, dtype=ms.float16):
    def prepare(model):
        return ms.amp.auto_mixed_precision(model, level, dtype)
    return prepare


def _train_with_ac(pattern, mode, prepare, order):
    """(history, the model apply_ac was applied to) for ``prepare`` before or after ``apply_ac``."""
    model = pattern.build()
    if order == "before":
        net = prepare(model)
        mac.apply_ac(net, config=mode_config(mode, pattern))   # amp O2/O3 wrap it: the layer list is found
        return run_steps(net, pattern.batch), net
    mac.apply_ac(model, config=mode_config(mode, pattern), layers=pattern.layers)
    return run_steps(prepare(model), pattern.batch), model


@pytest.fixture(scope="module")
def baselines():
    cache = {}

    def get(key, pattern, prepare):
        if key not in cache:
            cache[key] = run_steps(prepare(pattern.build()), pattern.batch)
        return cache[key]
    return get


def _check(baselines, key, pattern, prepare, mode, order):
    history, model = _train_with_ac(pattern, mode, prepare, order)
    diff = first_difference(baselines(key, pattern, prepare), history)
    assert diff is None, f"{key} {mode} ({order} apply_ac): {diff}"
    assert_acted(mode, model, None)
    mac.remove_ac(model)
    assert all("construct" not in cell.__dict__ for _, cell in model.cells_and_names())


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", AC_MODES)
def test_to_float_fp16_is_bitwise_in_every_mode(baselines, mode, order):
    pattern = PATTERNS["int_bool_inputs"]
    _check(baselines, "fp16", pattern, _to_float(ms.float16), mode, order)


@pytest.mark.parametrize("mode", ["checkpoint_api", "swap_api"])
def test_to_float_fp16_through_the_checkpoint_and_swap_api(baselines, mode):
    pattern = PATTERNS["int_bool_inputs"]
    model = pattern.build().to_float(ms.float16)
    counter = install_api(mode, model)
    history = run_steps(model, pattern.batch)
    assert first_difference(baselines("fp16", pattern, _to_float(ms.float16)), history) is None
    assert_acted(mode, model, counter)


# amp after apply_ac is O2's case: O3 casts every cell alike, before or after (suite time)
@pytest.mark.slow
@pytest.mark.parametrize("mode", [m for m in AC_MODES if m != "group"])   # groups: fp16 and bf16 below/above
@pytest.mark.parametrize("level, order", [("O2", "before"), ("O2", "after"), ("O3", "before")])
def test_amp_o2_o3_fp16_is_bitwise_in_every_mode(baselines, level, mode, order):
    """O2 keeps LayerNorm in fp32 behind an _OutputTo16 wrapper and wraps the model in _OutputTo32."""
    pattern = PATTERNS["int_bool_inputs"]
    _check(baselines, level, pattern, _amp(level), mode, order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["full", "select_cell", "exclude_op", "mixed"])
def test_batchnorm_under_fp16_writes_its_fp32_statistics_once(baselines, mode, order):
    """BatchNorm's moving statistics are fp32 Parameters that mixed precision does not cast; the recompute
    hands BatchNorm copies of them, which must not be cast either."""
    pattern = PATTERNS["batchnorm"]
    _check(baselines, "batchnorm-fp16", pattern, _to_float(ms.float16), mode, order)


# -- bf16 -----------------------------------------------------------------------------------------

class Mix(nn.Cell):
    """Elementwise work in the layer's type. On CPU bf16 has Mul/Add/Sub kernels but no ReduceSum: the gate
    has the activations' full shape, so its gradient needs no reduction."""

    def __init__(self):
        super().__init__()
        self.gate = Parameter(Tensor(np.ones((B, S, H), np.float32)), name="gate")

    def construct(self, x):
        h = x * self.gate
        return x - h * h * 0.1


class Scores(nn.Cell):
    """Parameter-free attention over the sequence (MatMul and Softmax: fp32 only on CPU)."""

    def construct(self, x):
        p = mint.nn.functional.softmax(ops.matmul(x, x.swapaxes(-1, -2)) * (H ** -0.5), dim=-1)
        return ops.matmul(p, x)


class Bf16Layer(nn.Cell):
    """bf16 elementwise work, then fp32 cells (``to_float(fp32)`` on them): attention scores and an MLP with
    an op attribute and a comm slot."""

    def __init__(self):
        super().__init__()
        self.mix = Mix()
        self.scores = Scores()
        self.mlp = MLP()

    def construct(self, x):
        h = x + self.mix(x)
        h = h + self.scores(h)
        return h + self.mlp(h)


class Head(nn.Cell):
    """The regression loss (MatMul, Pow, Mean: fp32 only on CPU)."""

    def __init__(self):
        super().__init__()
        self.proj = mint.nn.Linear(H, 1)

    def construct(self, x, y):
        return ((self.proj(x).squeeze(-1) - y) ** 2).mean()


class Bf16Model(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([Bf16Layer() for _ in range(3)])
        self.head = Head()

    def construct(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return self.head(x, y)


def _bf16(model):
    """bf16 where CPU kernels exist, fp32 for the cells that need MatMul or GeLU (set after, so they win)."""
    model.to_float(ms.bfloat16)
    for layer in model.layers:
        layer.scores.to_float(ms.float32)
        layer.mlp.to_float(ms.float32)
    model.head.to_float(ms.float32)
    return model


def _bf16_batch(step):
    rng = np.random.RandomState(300 + step)
    return Tensor(rng.randn(B, S, H).astype(np.float32)), Tensor(rng.randn(B, S).astype(np.float32))


BF16 = Pattern("bf16", lambda: init_weights(Bf16Model()), _bf16_batch, cell="mix", op=r"mlp\.act",
               comm=r"mlp\.all_gather", op_swap="mix")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", AC_MODES)
def test_bf16_with_fp32_cells_is_bitwise_in_every_mode(baselines, mode, order):
    _check(baselines, "bf16", BF16, _bf16, mode, order)


def test_bf16_activations_are_swapped_as_bf16():
    """op swap of the bf16 module: its bf16 activations go to host memory and come back bitwise."""
    model = _bf16(BF16.build())
    mac.apply_ac(model, config=mode_config("op_swap", BF16))
    run_steps(model, BF16.batch, steps=1)
    layers = mac.ac_state(model).swap_report.layers
    elements = B * S * H
    for layer_id in (0, 1):
        # x * x saves x, twice-used: one bf16 tensor of the hidden shape at least (2 bytes an element)
        assert layers[layer_id].num_offloaded > 0
        assert layers[layer_id].offloaded_bytes >= 2 * elements


# -- what the engine keeps, under fp16 -----------------------------------------------------------------

def test_saved_inputs_keep_their_dtype_under_fp16():
    """A region keeps its inputs as they came: layer 0 gets the fp32 batch (not cast to fp16 by the layer's
    mixed precision), later layers the fp16 hidden states; the fp32 constant stays fp32."""
    pattern = PATTERNS["int_bool_inputs"]
    model = pattern.build().to_float(ms.float16)
    mac.apply_ac(model, config=mode_config("full", pattern))
    run_steps(model, pattern.batch, steps=1)
    stats = mac.ac_state(model).recompute_stats
    pos, mask, scale = B * S * 4, B * S * S, H * 4
    assert stats[0].kept_bytes == B * S * H * 4 + pos + mask + scale
    assert stats[1].kept_bytes == stats[2].kept_bytes == B * S * H * 2 + pos + mask + scale


# -- amp O1 -------------------------------------------------------------------------------------------

class PlainLayer(nn.Cell):
    """Cells amp O1's rewrite can parse (it reads every construct's source)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(H, FFN)
        self.act = nn.GELU()
        self.fc2 = nn.Dense(FFN, H)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x))) + x


class PlainModel(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([PlainLayer() for _ in range(3)])

    def construct(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x.mean(-1) - y) ** 2).mean()


def _plain():
    return init_weights(PlainModel())


FULL = {"recompute": {"mode": "full", "full_recompute_layer": ["0-2"]}}


@pytest.fixture
def in_tmp_dir(tmp_path, monkeypatch):
    """amp O1's rewrite writes the new network's source under ./rewritten_network: keep it out of the repo."""
    monkeypatch.chdir(tmp_path)


def test_amp_o1_before_apply_ac_is_bitwise(in_tmp_dir):
    base = run_steps(ms.amp.auto_mixed_precision(_plain(), "O1"), _bf16_batch)
    net = ms.amp.auto_mixed_precision(_plain(), "O1")
    mac.apply_ac(net, config=FULL)
    assert first_difference(base, run_steps(net, _bf16_batch)) is None
    assert sum(s.recompute_calls for s in mac.ac_state(net).recompute_stats.values()) == 9


@pytest.mark.parametrize("config", [FULL, {"recompute": {"mode": "select", "select_module": {"fc1": ["0-2"]}}},
                                    {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}}],
                         ids=["full", "select", "layer_swap"])
def test_amp_o1_after_apply_ac_is_refused(config, in_tmp_dir):
    """O1 builds new cells (copying the patches) and puts them in the original model's tree too: neither
    network can be restored, so remove_ac, apply_ac and plan_ac refuse both and change nothing."""
    model = _plain()
    mac.apply_ac(model, config=config)
    net = ms.amp.auto_mixed_precision(model, "O1")
    assert net is not model and type(model.layers[0]).__name__.startswith("PlainLayerOpt")
    for target in (net, model):
        before = model_fingerprint(target)
        for call in (mac.remove_ac, lambda n: mac.apply_ac(n, config=FULL), lambda n: mac.plan_ac(n, config=FULL)):
            with pytest.raises(mac.ConfigError, match=r"^model: cell ('[\w.]+' )?\(\w+Opt\w*\) carries the") as info:
                call(target)
            assert "apply mixed precision first, then apply_ac" in str(info.value)
            assert model_fingerprint(target) == before


@pytest.mark.slow
def test_forward_of_a_network_rewritten_after_apply_ac_raises(tmp_path):
    """Its layers would run the original cells' code (without O1's casts) through the copied patches."""
    res = run_isolated("""
        import mindformers_ac as mac
        from test_mixed_precision import _plain, _bf16_batch, FULL
        model = _plain(); mac.apply_ac(model, config=FULL)
        net = ms.amp.auto_mixed_precision(model, 'O1')
        ms.value_and_grad(net, None, net.trainable_params())(*_bf16_batch(0))
    """, cwd=tmp_path)
    assert res.returncode != 0
    assert "RuntimeError: mindformers_ac: cell (PlainLayerOpt" in res.stderr, res.stderr[-3000:]
    assert "apply mixed precision first" in res.stderr


@pytest.mark.slow
def test_a_type_set_on_an_enclosing_cell_only_fails_naming_the_cast():
    """``add_flags(fp16=True)`` on the model alone (not recursive): the layers run under the model's type,
    which the recompute of a layer can't see; it fails in backward with a hint, not silently."""
    res = run_isolated("""
        import mindformers_ac as mac
        from model_patterns import PATTERNS, mode_config
        from steps import run_steps
        p = PATTERNS['int_bool_inputs']
        model = p.build(); model.add_flags(fp16=True)
        mac.apply_ac(model, config=mode_config('full', p))
        run_steps(model, p.batch, steps=1)
    """)
    assert res.returncode != 0
    assert "recompute diverged from forward at op #" in res.stderr and "forward ran Cast" in res.stderr, \
        res.stderr[-3000:]
    assert "call to_float on the region's cell as well" in res.stderr


def test_engine_copies_under_a_cells_fp16_type_reach_their_target():
    """Swap's device copies and the recompute's input copies run inside a layer's call. There, under fp16,
    MindSpore 2.10 runs ``dst.copy_(src)`` on a cast copy of ``dst`` and leaves ``dst`` unchanged;
    ``no_casts`` (what those copies run under) gives the exact bytes."""
    from mindspore._c_expression import MixedPrecisionType

    from mindformers_ac.precision import no_casts, under_precision

    src = Tensor(np.array([1.0001, 2.00001, 3.3333333], np.float32))
    dst = Tensor(np.zeros(3, np.float32))
    with under_precision(MixedPrecisionType.FP16):
        with no_casts():
            dst.copy_(src)
            kept = ops.stop_gradient(src)
    assert dst.asnumpy().tobytes() == src.asnumpy().tobytes()
    assert kept.dtype == ms.float32 and kept.asnumpy().tobytes() == src.asnumpy().tobytes()


def test_fp16_nn_dropout_keeps_its_mask_as_bits_and_is_bitwise(caplog):
    """fp16 Dropout: the CPU kernel computes in float32 and rounds once; the rebuild from the mask does the
    same, so the mask is kept as bits (no fallback to keeping outputs) on both paths, bitwise."""
    from test_recompute_engine import assert_bitwise_equal, train

    def fp16(model):
        model.to_float(ms.float16)

    def fp16_ac(model):
        fp16(model)
        mac.apply_ac(model, config={"recompute": {"mode": "full", "full_recompute_layer": [0, 1]}})
        return mac.ac_state(model)

    base = train(fp16, dropout_kind="nn")[0]
    with caplog.at_level(logging.WARNING, logger="mindformers_ac"):
        history, state, _ = train(fp16_ac, dropout_kind="nn")
    assert_bitwise_equal(base, history)
    assert "can't be rebuilt bitwise" not in caplog.text
    from mindformers_ac.recompute.state import ENGINE
    assert ENGINE.dropout_formula_ok._ok[("Float16", 0.9)] is True   # process-wide: checked once per dtype
    assert all(s.recompute_calls == 3 and s.ops_reused > 0 for s in state.recompute_stats.values())
