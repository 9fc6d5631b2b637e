"""Small layer programs built from a pool of patterns, trained with and without AC (issue 49, point 5).

``Program(seed)`` draws a few statements from ``PATTERNS`` (random ops of every kind, in-place writes,
setitem, ``set_data`` / ``assign_value`` on the layer's own Parameters and on one the model hands every
layer, ``ops.assign_add`` into a buffer, Python state read in forward, kept ops, outputs in tuples, dicts,
dataclasses and custom objects), and ``outcome(program, mode)`` trains it 2 steps in one AC mode against
the same program without AC: ``exact`` (bitwise: loss, every gradient and parameter), ``refused`` (an
error on the first backward, before any optimizer step) or a finding: ``silent`` (a step differs and
nothing was raised) or ``late`` (refused only after a step was taken). The modes (``MODES``): full, ``exclude_op``, layer
groups, ``checkpoint_wrapper`` (intercepting only), HyperParallel's ``checkpoint_wrapper`` with an exclude
policy, ``select`` of the layer's body (the sub-cell running the statements), layer swap, op swap of the
body, ``async_save_on_cpu`` and nested wrappers (the body ``checkpoint_wrapper``-ed in a recomputed
layer). The test runs a bounded share in CI; ``scripts/hunt_programs.py`` runs thousands.
"""
import dataclasses
import random

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

import mindformers_ac as mac
from mindformers_ac.mindspore_compat import pynative_executor

H = 8
STEPS = 2


@dataclasses.dataclass
class Out:
    """A Hugging Face-style output."""
    hidden: object


class Box:
    """A custom object holding the output."""

    def __init__(self, hidden):
        self.hidden = hidden


def _uniform(cell, h):
    return h * (1.0 + 0.01 * cell.uniform((H,)).mean())


def _laplace(cell, h):
    return h * (1.0 + 0.01 * cell.laplace((H,)).mean())


def _functional_dropout(cell, h):
    return ops.dropout(h, p=0.2)


def _cell_dropout(cell, h):
    return cell.drop(h)


def _copy(cell, h):
    h = h * 1.0
    h.copy_(h * 0.5 + 0.1)
    return h


def _setitem(cell, h):
    h = h * 1.0
    h[:, 0] = 0.25
    return h


def _buffer_assign_add(cell, h):
    h = h * (1.0 + cell.buf)
    ops.assign_add(cell.buf, ops.stop_gradient(h.mean((0,)) * 0.01))
    return h


def _buffer_slot(cell, h):
    h = h * (1.0 + cell.hist[0])
    cell.hist[0] = cell.hist[0] + 0.5
    return h


def _own_set_data(cell, h):
    h = h * cell.gain
    cell.gain.set_data(ops.stop_gradient(cell.gain * 0.99))
    return h


def _own_assign_value(cell, h):
    h = h * cell.gain
    cell.gain.assign_value(ops.stop_gradient(cell.gain * 0.98))
    return h


def _outside_set_data(cell, h, shared):
    h = h * shared
    shared.set_data(ops.stop_gradient(shared * 1.01))
    return h


def _python_state(cell, h):
    cell.calls += 1
    return h * (1.0 + 0.01 * cell.calls)


def _dense(cell, h):
    return cell.fc2(h)


def _activation(cell, h):
    return ops.tanh(h) + ops.sin(h)


# name -> statement(cell, h) (``outside`` ones also take the model's shared Parameter)
PATTERNS = {
    "dense": _dense, "activation": _activation, "uniform": _uniform, "laplace": _laplace,
    "functional_dropout": _functional_dropout, "cell_dropout": _cell_dropout, "copy": _copy,
    "setitem": _setitem, "buffer_assign_add": _buffer_assign_add, "buffer_slot": _buffer_slot,
    "own_set_data": _own_set_data, "own_assign_value": _own_assign_value, "outside_set_data": _outside_set_data,
    "python_state": _python_state,
}
OUTPUTS = ("tensor", "tuple", "dict", "dataclass", "object")
MODES = ("full", "exclude_op", "group", "checkpoint_wrapper", "layer_swap", "select", "op_swap", "async_save_on_cpu",
         "nested", "hyper_api")


class Program:
    """What one seed draws: the statements of every layer's forward, and how the layer returns its output."""

    def __init__(self, seed):
        rng = random.Random(seed)
        self.seed = seed
        self.statements = rng.sample(sorted(PATTERNS), rng.randint(1, 4))
        self.output = rng.choice(OUTPUTS)

    @classmethod
    def of(cls, statements, output="tensor"):
        """A program of the given statements (a minimal repro of a finding)."""
        program = cls(0)
        program.seed, program.statements, program.output = None, list(statements), output
        return program

    def __repr__(self):
        return f"Program(seed={self.seed}: {' -> '.join(self.statements)}, output {self.output})"


class GenBody(nn.Cell):
    """The drawn statements, in a sub-cell of the layer (what ``select``, ``op_swap`` and ``nested`` act on):
    it holds what they use."""

    def __init__(self, program):
        super().__init__()
        self.program = program
        self.fc2 = nn.Dense(H, H)
        self.uniform = ops.UniformReal(seed=3, seed2=4)
        self.laplace = ops.StandardLaplace(seed=5, seed2=6)
        self.drop = nn.Dropout(p=0.2)
        self.buf = Parameter(Tensor(np.zeros(H, np.float32)), name="buf", requires_grad=False)
        self.hist = Parameter(Tensor(np.zeros(32, np.float32)), name="hist", requires_grad=False)
        self.gain = Parameter(Tensor(np.ones(H, np.float32)), name="gain", requires_grad=False)
        self.calls = 0

    def construct(self, h, shared):
        for name in self.program.statements:
            h = PATTERNS[name](self, h, shared) if name.startswith("outside") else PATTERNS[name](self, h)
        return h


class GenLayer(nn.Cell):
    def __init__(self, program):
        super().__init__()
        self.program = program
        self.fc1 = nn.Dense(H, H)
        self.body = GenBody(program)

    def construct(self, x, shared):
        h = ops.tanh(self.body(self.fc1(x), shared))
        return _wrap(self.program.output, h)


def _wrap(kind, h):
    if kind == "tuple":
        return (h, h.sum())
    if kind == "dict":
        return {"hidden": h}
    if kind == "dataclass":
        return Out(hidden=h)
    if kind == "object":
        return Box(h)
    return h


def _unwrap(out):
    if isinstance(out, tuple):
        return out[0]
    if isinstance(out, dict):
        return out["hidden"]
    if isinstance(out, (Out, Box)):
        return out.hidden
    return out


class GenModel(nn.Cell):
    def __init__(self, program, n_layers=2):
        super().__init__()
        self.layers = nn.CellList([GenLayer(program) for _ in range(n_layers)])
        self.shared = Parameter(Tensor(np.linspace(0.5, 1.5, H).astype(np.float32)), name="shared",
                                requires_grad=False)

    def run_layer(self, layer, *args):
        return layer(*args)

    def construct(self, x):
        for layer in self.layers:
            x = _unwrap(self.run_layer(layer, x, self.shared))
        return (x ** 2).mean()


def build(program):
    model = GenModel(program)
    for name, p in model.parameters_and_names():
        if p.requires_grad:
            rng = np.random.RandomState(sum(map(ord, name.replace(".body.", "."))))   # the names before GenBody
            p.set_data(Tensor(rng.uniform(-0.5, 0.5, p.shape).astype(np.float32)))
    return model


FULL = {"recompute": {"mode": "full", "full_recompute_layer": ["0-1"]}}
CONFIGS = {
    "full": FULL,
    "exclude_op": {"recompute": {"mode": "full", "full_recompute_layer": ["0-1"], "exclude_op": ["MatMul"]}},
    "group": {"recompute": {"mode": "full", "full_recompute_layer": ["0-1"], "group_layers": 2}},
    # min_bytes 0: the generator's tensors (4 x 8 float32) are below the default 1024 bytes
    "layer_swap": {"swap": {"enable": True, "min_bytes": 0, "layer_swap": [{"layers": [0]}]}},
    "select": {"recompute": {"mode": "select", "select_module": {"body": ["0-1"]}}},
    "op_swap": {"swap": {"enable": True, "min_bytes": 0, "op_swap": [{"op_name": "body", "layers": [0]}]}},
}


def install(model, mode):
    """``mode`` on ``model``: an apply_ac config (``CONFIGS``) or an API: ``checkpoint_wrapper`` on each layer
    (intercepting path only), HyperParallel's ``checkpoint_wrapper`` with ``exclude_policy(["MatMul"])``
    (``hyper_api``), each layer call a block of ``async_save_on_cpu`` (every saved tensor offloaded), or
    ``nested``: the body ``checkpoint_wrapper``-ed inside layers ``apply_ac`` recomputes."""
    if mode == "checkpoint_wrapper":
        for layer in model.layers:
            mac.recompute.checkpoint_wrapper(layer, light_path=False)
    elif mode == "hyper_api":
        policy = mac.recompute.exclude_policy(["MatMul"])
        for layer in model.layers:
            mac.checkpoint_wrapper(layer, policy_fn=policy)
    elif mode == "async_save_on_cpu":
        layers = list(model.layers)

        def run_layer(layer, *args):
            with mac.async_save_on_cpu(block_idx=layers.index(layer), depth=len(layers), params=model,
                                       custom_check_fn=lambda t: True):
                return layer(*args)
        object.__setattr__(model, "run_layer", run_layer)
    elif mode == "nested":
        for layer in model.layers:
            mac.checkpoint_wrapper(layer.body)
        mac.apply_ac(model, config=FULL)
    else:
        mac.apply_ac(model, config=CONFIGS[mode])


def _batch(step):
    return Tensor(np.random.RandomState(step).randn(4, H).astype(np.float32))


def train(model):
    """Per step (loss, grads, params) bytes; stops at the first error: ``(history, error or None)``."""
    ms.set_seed(0)
    opt = nn.SGD(model.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    history = []
    for step in range(STEPS):
        try:
            loss, grads = grad_fn(_batch(step))
        except (RuntimeError, ValueError, TypeError) as exc:
            pynative_executor.clear_res()   # docs/exactness.md, "Failure paths"
            return history, exc
        opt(grads)
        history.append((loss.asnumpy().tobytes(), [g.asnumpy().tobytes() for g in grads],
                        [p.asnumpy().tobytes() for _, p in model.parameters_and_names()]))
    return history, None


def outcome(program, mode):
    """``(kind, detail)``: kind is exact, refused, silent, late, or plain_fails (the program fails without AC)."""
    base, error = train(build(program))
    if error is not None:
        return "plain_fails", str(error)[:200]
    model = build(program)
    install(model, mode)
    got, error = train(model)
    if error is not None:
        return ("refused" if not got else "late"), f"{type(error).__name__}: {str(error)[:300]}"
    diff = next((i for i, (a, b) in enumerate(zip(base, got)) if a != b), None)
    if diff is not None:
        return "silent", f"step {diff} differs"
    return "exact", "idle" if _idle(model) else ""


def _idle(model):
    """True when an apply_ac mode re-ran and offloaded nothing (a select or op swap the planner skipped)."""
    state = mac.ac_state(model)
    if state is None:
        return False
    reran = sum(s.ops_rerun for s in state.recompute_stats.values())
    offloaded = sum(s.num_offloaded for s in state.swap_report.layers.values()) if state.swap_report else 0
    return reran == 0 and offloaded == 0


def cases(seed, n, modes=MODES):
    """``n`` (program, mode) pairs drawn from ``seed``, the modes among ``modes``."""
    rng = random.Random(seed)
    for _ in range(n):
        yield Program(rng.randrange(1 << 30)), rng.choice(modes)
