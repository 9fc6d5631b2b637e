"""`--model MODULE:FUNCTION` for train, plan and explain, on a LLaMA-style factory module written here.

The model differs from the reference GPT in every way `train` and the
planner depend on: its layer list is `model.layers` (`attention.wq ...`,
`feed_forward.w1 ...`), its inputs are int32 tokens, int32 position ids that
pick the rotary angles (`ops.gather`), a bool causal mask (`masked_fill`) and
labels, it has grouped KV heads, an own RMSNorm, and a forward-time counter
(`ops.assign_add` on a non-trainable parameter) that is part of the training
state. Runs that go through backward happen in subprocesses (as a user runs
them); contract errors are raised before any backward, so they run in-process.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from mindformers_ac import AcConfig
from mindformers_ac.harness.cli import main
from mindformers_ac.plan import check_layer_ids

REPO = pathlib.Path(__file__).resolve().parent.parent

LLAMA = '''
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, SEQ, BATCH = 32, 4, 2, 3, 64, 16, 2


class RMSNorm(nn.Cell):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)))
        self.eps = eps

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    x1, x2 = mint.split(x, x.shape[-1] // 2, -1)
    return mint.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)


class Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = mint.nn.Linear(DIM, DIM, bias=False)
        self.wk = mint.nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = mint.nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = mint.nn.Linear(DIM, DIM, bias=False)

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.wq(x).reshape(b, s, HEADS, self.head_dim).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(b, s, KV_HEADS, self.head_dim).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(b, s, KV_HEADS, self.head_dim).transpose(0, 2, 1, 3)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = HEADS // KV_HEADS
        k = k[:, :, None].broadcast_to((b, KV_HEADS, rep, s, self.head_dim)).reshape(b, HEADS, s, self.head_dim)
        v = v[:, :, None].broadcast_to((b, KV_HEADS, rep, s, self.head_dim)).reshape(b, HEADS, s, self.head_dim)
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) / float(np.sqrt(self.head_dim))
        scores = scores.masked_fill(mask, -1e9)
        out = ops.matmul(mint.nn.functional.softmax(scores, dim=-1), v)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, s, DIM))


class FeedForward(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w1 = mint.nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = mint.nn.Linear(4 * DIM, DIM, bias=False)
        self.w3 = mint.nn.Linear(DIM, 4 * DIM, bias=False)

    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def construct(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaModel(nn.Cell):
    def __init__(self, list_name="layers"):
        super().__init__()
        self.list_name = list_name
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        setattr(self, list_name, nn.CellList([DecoderLayer() for _ in range(LAYERS)]))
        self.norm_out = RMSNorm(DIM)
        inv_freq = 1.0 / (10000 ** (np.arange(0, DIM // HEADS, 2) / (DIM // HEADS)))
        angles = np.outer(np.arange(SEQ), inv_freq).astype(np.float32)
        self.cos_table, self.sin_table = Tensor(np.cos(angles)), Tensor(np.sin(angles))
        self.steps_seen = Parameter(Tensor(np.zeros((1,), np.int32)), requires_grad=False)

    def construct(self, tokens, position_ids, mask):
        ops.assign_add(self.steps_seen, Tensor(np.ones((1,), np.int32)))
        cos = ops.gather(self.cos_table, position_ids, 0)[:, None]
        sin = ops.gather(self.sin_table, position_ids, 0)[:, None]
        x = self.tok_embeddings(tokens)
        for layer in getattr(self, self.list_name):
            x = layer(x, cos, sin, mask)
        return self.norm_out(x)


class LlamaForCausalLM(nn.Cell):
    def __init__(self, list_name="layers"):
        super().__init__()
        self.model = LlamaModel(list_name)
        self.lm_head = mint.nn.Linear(DIM, VOCAB, bias=False)
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def construct(self, tokens, position_ids, mask, labels):
        logits = self.lm_head(self.model(tokens, position_ids, mask))
        return self.loss(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_inputs(step, seed=None):
    rng = np.random.default_rng(step if seed is None else seed)
    ids = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1), dtype=np.int32)
    position_ids = np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1))
    mask = np.triu(np.ones((SEQ, SEQ), bool), 1)[None, None]
    return Tensor(ids[:, :-1]), Tensor(position_ids), Tensor(mask), Tensor(ids[:, 1:])


def _model(list_name="layers"):
    ms.set_seed(0)
    np.random.seed(0)
    model = LlamaForCausalLM(list_name)
    model.set_train(True)
    return model


def build():
    return _model(), make_inputs


def build_hidden():
    """The layer list under a name find_layer_stack does not search: model.stack."""
    return _model("stack"), make_inputs


def build_unseeded_data():
    """From step 2 on the batches come from an unseeded RNG, as from a loader that shuffles freshly in every
    process: the training is not reproducible by itself, with or without AC."""
    return _model(), lambda step: make_inputs(step, seed=step if step < 1 else np.random.default_rng().integers(1 << 30))


def tiny_gpt():
    """The older contract: a model alone, called as model(tokens, labels)."""
    from mindformers_ac.harness.models import build_gpt
    return build_gpt(num_layers=2, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.0)


def three_items():
    return _model(), make_inputs, "extra"


def not_a_cell():
    return "llama", make_inputs


def not_callable():
    return _model(), 5


def raises():
    raise ValueError("no checkpoint at /data/llama")


class PerTokenLoss(LlamaForCausalLM):
    def construct(self, tokens, position_ids, mask, labels):
        return self.lm_head(self.model(tokens, position_ids, mask)).sum(-1)


def vector_loss():
    ms.set_seed(0)
    return PerTokenLoss(), make_inputs


def tensor_inputs():
    return _model(), lambda step: make_inputs(step)[0]


def float_tokens_from_step_1():
    """Step 0 is fine; from step 1 on the tokens are floats, which the embedding refuses inside backward's forward."""
    def inputs(step):
        tokens, position_ids, mask, labels = make_inputs(step)
        return (tokens.astype(ms.float32) if step >= 1 else tokens), position_ids, mask, labels
    return _model(), inputs
'''

BROKEN = '''
import os
VALUE = int(os.environ.get("NOT_SET_ANYWHERE", "x"))
'''

# A whole trainer YAML: the AC sections plus keys mindformers-ac ignores. Layer swap and select recompute
# of the feed-forward block, which both leave the int/bool inputs outside any recomputed region.
TRAINER_YAML = """
seed: 0
runner_config:
  epochs: 1
  batch_size: 2
model:
  model_config:
    type: LlamaConfig
    num_layers: 3
recompute:
  mode: select
  select_module:
    '.*feed_forward': [1-2]
swap:
  enable: true
  default_prefetch: 1
  layer_swap:
    - layers: [0]
"""
SWAP_YAML = "swap:\n  enable: true\n  layer_swap:\n    - layers: [0]\n"


@pytest.fixture
def factory_dir(tmp_path, monkeypatch):
    """The factory modules in a fresh directory, which is the current one; sys.path and sys.modules restored."""
    (tmp_path / "llama_factory.py").write_text(LLAMA)
    (tmp_path / "broken_factory.py").write_text(BROKEN)
    (tmp_path / "trainer.yaml").write_text(TRAINER_YAML)
    (tmp_path / "swap.yaml").write_text(SWAP_YAML)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the loader puts the current directory on it
    for name in ("llama_factory", "broken_factory"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path
    for name in ("llama_factory", "broken_factory"):
        sys.modules.pop(name, None)


def run_cli(cwd, *args, timeout=600):
    """``mindformers-ac ARGS`` in ``cwd``, this checkout's package first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mindformers_ac.harness.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- explain: the plan on the user's model, no step run -------------------------------------------------


def test_explain_plans_the_llama_factory(factory_dir, capsys):
    assert main(["explain", "trainer.yaml", "--model", "llama_factory:build"]) == 0
    out = capsys.readouterr().out
    assert "3 layers at 'model.layers'" in out
    assert "recompute.select_module['.*feed_forward'] -> layers ['1-2']" in out
    assert "layer 1: feed_forward" in out and "layer 2: feed_forward" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:5]}
    assert rows["0"] == ["0", "-", "-", "-", "layer", "1"]          # layer swap, fetched back at layer 1
    assert rows["1"] == ["1", "feed_forward", "-", "-", "-", "-"]


def test_layer_list_not_found_names_the_flag_and_layer_list_finds_it(factory_dir, capsys):
    assert main(["explain", "swap.yaml", "--model", "llama_factory:build_hidden"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model: llama_factory:build_hidden: no transformer layer list found in "
                          "LlamaForCausalLM")
    assert "layers='path.to.layers'" in err and "--layer-list PATH" in err and "Traceback" not in err
    assert main(["explain", "swap.yaml", "--model", "llama_factory:build_hidden", "--layer-list",
                 "model.stack"]) == 0
    assert "3 layers at 'model.stack'" in capsys.readouterr().out
    assert main(["explain", "swap.yaml", "--model", "llama_factory:build_hidden", "--layer-list",
                 "model.nope"]) == 2
    assert "error: --layer-list: 'model.nope' is not a non-empty list of cells in LlamaForCausalLM" \
        in capsys.readouterr().err


def test_the_docs_example_explains_as_the_docs_show(tmp_path, monkeypatch, capsys):
    text = (REPO / "docs" / "own_model.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    config = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    shown = text.split("$ mindformers-ac explain llama_trainer.yaml --model llama_factory:build\n", 1)[1]
    (tmp_path / "llama_docs_factory.py").write_text(code)
    (tmp_path / "llama_trainer.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert main(["explain", "llama_trainer.yaml", "--model", "llama_docs_factory:build"]) == 0
    finally:
        sys.modules.pop("llama_docs_factory", None)
    assert capsys.readouterr().out == shown.split("```", 1)[0]


# --- every breach of the contract is named, exit 2, no traceback ----------------------------------------

BUILD_ERRORS = [
    ("no_such_module:build",
     "--model: cannot import module 'no_such_module': not found in the current directory"),
    ("broken_factory:build",
     "--model: cannot import module 'broken_factory': importing it raised ValueError: invalid literal for int() "
     "with base 10: 'x' (at broken_factory.py:3)"),
    ("llama_factory:buildd", "--model: module 'llama_factory' ("),
    ("llama_factory", "--model: expected MODULE:FUNCTION (e.g. my_models:build), got 'llama_factory'"),
    ("llama_factory:DIM", "--model: llama_factory:DIM is a int, not a function"),
    ("llama_factory:three_items", "--model: llama_factory:three_items() returned a tuple of 3 items; "
                                  "expected (model, make_inputs)"),
    ("llama_factory:not_a_cell", "--model: llama_factory:not_a_cell() returned (str, function): the model is a "
                                 "str, not a mindspore.nn.Cell"),
    ("llama_factory:not_callable", "--model: llama_factory:not_callable() returned (LlamaForCausalLM, int): "
                                   "make_inputs is a int, not a function of the step number"),
    ("llama_factory:raises", "--model: llama_factory:raises() raised ValueError: no checkpoint at /data/llama "
                             "(at llama_factory.py:"),
]


@pytest.mark.parametrize("spec, message", BUILD_ERRORS, ids=[s for s, _ in BUILD_ERRORS])
def test_a_broken_factory_is_named(factory_dir, capsys, spec, message):
    assert main(["explain", "swap.yaml", "--model", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message), err
    assert "Traceback" not in err and len(err) < 2000


def test_a_missing_function_lists_what_the_module_defines(factory_dir, capsys):
    assert main(["explain", "swap.yaml", "--model", "llama_factory:buildd"]) == 2
    err = capsys.readouterr().err
    assert "has no function 'buildd'; it defines: " in err
    assert "build, build_hidden, build_unseeded_data" in err and "make_inputs" in err


STEP_ERRORS = [
    ("llama_factory:vector_loss", "--model: model(*make_inputs(0)) of llama_factory:vector_loss returned a Float32 "
                                  "Tensor of shape (2, 16); expected the step's loss: a floating-point scalar Tensor"),
    ("llama_factory:tensor_inputs", "--model: make_inputs(0) of llama_factory:tensor_inputs returned a Tensor; "
                                    "expected a tuple of the model's inputs"),
]


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("spec, message", STEP_ERRORS, ids=[s for s, _ in STEP_ERRORS])
def test_inputs_or_loss_that_break_the_contract_stop_the_first_step(factory_dir, capsys, command, spec, message):
    # train checks one forward before its runs start; plan checks the first profiled step (a vector loss goes
    # through value_and_grad without an error, so this runs in-process)
    args = ["train", "swap.yaml"] if command == "train" else ["plan", "--budget", "0.5x"]
    assert main([*args, "--model", spec]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: " + message), captured.err
    assert "[baseline]" not in captured.err and "profiled" not in captured.out


@pytest.mark.parametrize("flags, message", [
    (["--hidden", "64"], "error: --hidden: applies to the reference GPT only; with --model llama_factory:build "
                         "the factory builds the model"),
    (["--dropout", "0.2"], "error: --dropout: applies to the reference GPT only"),
    (["--seq", "16"], "error: --seq: llama_factory:build() returns its own make_inputs, which makes the inputs; "
                      "--seq shapes only the synthetic batch of a factory that returns a model alone"),
    (["--tp", "2"], "error: --tp: tensor parallel trains the reference GPT only"),
])
def test_reference_model_flags_are_refused_with_model(factory_dir, capsys, flags, message):
    assert main(["train", "swap.yaml", "--model", "llama_factory:build", *flags]) == 2
    assert capsys.readouterr().err.startswith(message)


def test_train_with_model_needs_a_config(factory_dir, capsys):
    assert main(["train", "--model", "llama_factory:build"]) == 2
    assert capsys.readouterr().err.startswith("error: CONFIG: train --model needs the YAML config to apply")


def test_layers_is_a_count_and_layer_list_a_path_each_in_its_place(factory_dir, capsys):
    # one flag, one meaning: --layers N sizes the reference GPT, --layer-list PATH names a --model's layer list
    with pytest.raises(SystemExit) as exit_info:   # argparse's usage error: status 2
        main(["train", "--layers", "model.layers"])
    assert exit_info.value.code == 2
    assert ("argument --layers: expected the reference GPT's number of layers (a positive integer), got "
            "'model.layers'; a --model's layer-list path is --layer-list PATH") in capsys.readouterr().err
    assert main(["train", "--layer-list", "model.layers"]) == 2
    assert capsys.readouterr().err.startswith("error: --layer-list: names the layer list of a --model factory's "
                                              "model; the reference GPT's is found by itself")
    assert main(["train", "trainer.yaml", "--model", "llama_factory:build", "--layers", "4"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: --layers: applies to the reference GPT only; with --model llama_factory:build the factory builds "
        "the model; name its layer list with --layer-list PATH")


# --- the runs themselves (subprocesses) -----------------------------------------------------------------


@pytest.mark.slow
def test_train_compares_the_llama_without_and_with_ac(factory_dir):
    proc = run_cli(factory_dir, "train", "trainer.yaml", "--model", "llama_factory:build", "--steps", "3",
                   "--report", "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "losses, gradients and all parameters bitwise equal in every step: yes" in proc.stdout
    assert "AcPlan: 3 layers at 'model.layers'" in proc.stdout and "ops re-run" in proc.stdout
    report = json.loads((factory_dir / "out" / "report.json").read_text())
    s = report["summary"]
    assert s["verdict"] == "equal" and s["losses_match_bitwise"] and s["grads_match_bitwise"]
    assert s["params_match_bitwise"] and "baseline_again" not in report
    assert s["ac_peak_activation_bytes"] < 0.8 * s["baseline_peak_activation_bytes"]
    rows = {row["layer"]: row for row in report["layers"]}
    assert set(rows) == {"0", "1", "2", "other"}
    assert rows["0"]["applied"][0] == "layer swap" and rows["0"]["offloaded_bytes"] > 0
    assert rows["1"]["applied"] == ["recompute feed_forward"] and rows["1"]["recomputed_bytes"] > 0
    assert rows["1"]["kept_bytes"] < rows["1"]["baseline_kept_bytes"]
    # the whole training state: the non-trainable forward-time counter is compared too, and it moves
    names = report["ac"]["param_names"]
    assert "model.layers.0.attention.wq.weight" in names and "model.layers.2.feed_forward.w3.weight" in names
    counter = names.index("model.steps_seen")
    digests = [step[counter] for step in report["ac"]["param_digests"]]
    assert len(set(digests + [report["ac"]["initial_param_digests"][counter]])) == 4
    assert "model.steps_seen" not in report["ac"]["grad_names"]
    assert (factory_dir / "out" / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_train_does_not_blame_ac_for_a_model_that_is_not_reproducible(factory_dir):
    proc = run_cli(factory_dir, "train", "swap.yaml", "--model", "llama_factory:build_unseeded_data",
                   "--steps", "3", "--report", "out")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert ("losses, gradients and all parameters bitwise equal in every step: undecided: the model is not "
            "reproducible by itself: two runs without AC already differ in the loss of step 2; with AC the run "
            "matched the run without AC up to there, so AC is not the cause") in proc.stdout
    assert "running without AC again" in proc.stderr
    report = json.loads((factory_dir / "out" / "report.json").read_text())
    s = report["summary"]
    assert s["verdict"] == "model" and s["baseline_rerun"]
    assert s["first_difference"] == {"step": 2, "what": "loss", "name": None}
    assert s["model_difference"] == {"step": 2, "what": "loss", "name": None}
    assert report["baseline"]["loss_digests"][0] == report["baseline_again"]["loss_digests"][0]
    assert report["baseline"]["loss_digests"][1] != report["baseline_again"]["loss_digests"][1]


@pytest.mark.slow
def test_train_finds_the_layer_list_by_its_path(factory_dir):
    proc = run_cli(factory_dir, "train", "swap.yaml", "--model", "llama_factory:build_hidden",
                   "--layer-list", "model.stack", "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AcPlan: 3 layers at 'model.stack'" in proc.stdout
    assert "losses, gradients and all parameters bitwise equal in every step: yes" in proc.stdout


@pytest.mark.slow
def test_a_model_failing_in_a_later_step_is_reported_on_one_line(factory_dir):
    train = run_cli(factory_dir, "train", "swap.yaml", "--model", "llama_factory:float_tokens_from_step_1",
                    "--steps", "3")
    assert train.returncode == 2, train.stderr[-3000:]
    assert "error: the baseline training run failed (exit 1): " in train.stderr
    assert "Traceback" not in train.stderr and "[ with AC]" not in train.stderr   # stopped at the first run
    plan = run_cli(factory_dir, "plan", "--budget", "0.5x", "--model", "llama_factory:float_tokens_from_step_1",
                   "--profile-steps", "1")
    assert plan.returncode == 2, plan.stderr[-3000:]
    assert "error: profiling --model llama_factory:float_tokens_from_step_1 failed: " in plan.stderr
    assert "Traceback" not in plan.stderr
    last = [line for line in plan.stderr.splitlines() if line.startswith("error: ")]
    assert len(last) == 1 and len(last[0]) < 700


@pytest.mark.slow
def test_plan_profiles_the_llama_and_writes_a_yaml_for_it(factory_dir):
    proc = run_cli(factory_dir, "plan", "--budget", "0.5x", "--model", "llama_factory:build",
                   "--profile-steps", "1", "--out", "plan.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profiled --model llama_factory:build" in proc.stdout and "wrote plan.yaml" in proc.stdout
    text = (factory_dir / "plan.yaml").read_text()
    config = AcConfig.from_yaml(str(factory_dir / "plan.yaml"))
    assert config.recompute.enabled or config.swap.enable
    check_layer_ids(config, 3)
    assert "feed_forward" in text or "attention" in text or "layer_swap" in text or "full" in text
    assert yaml.safe_load(text)


@pytest.mark.slow
def test_plan_keeps_the_model_only_factory_contract(factory_dir):
    # a factory returning a model alone is fed the reference synthetic batch, shaped by the data flags
    proc = run_cli(factory_dir, "plan", "--budget", "0.4x", "--model", "llama_factory:tiny_gpt",
                   "--seq", "16", "--vocab", "64", "--batch", "2", "--profile-steps", "1", "--out", "plan.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profiled --model llama_factory:tiny_gpt" in proc.stdout
    config = AcConfig.from_yaml(str(factory_dir / "plan.yaml"))
    check_layer_ids(config, 2)
    assert config.recompute.enabled or config.swap.enable
