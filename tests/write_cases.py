"""Models whose forward writes, each kind of write a region's forward (or the code around it) can make.

The cases of the recompute engine's one model of writes (docs/exactness.md, rules W1-W7): a kept op's
output written in place later in its layer, a kept op that writes its own argument, a buffer written by
slice or ``assign_value``, a trainable weight rebound in forward, a write between two grouped layers, a
tensor a layer saved and the next layer writes, a marker-guarded side effect that keeps a tracked tensor,
and nested regions with replay metadata. Each builds on ``model_patterns``' layer (3 layers, hidden 32) so
that the exactness tests compare it against its plain twin with ``steps.run_steps``.
"""
import collections
import dataclasses

import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

import mindformers_ac as mac

from model_patterns import N_LAYERS, H, Layer, PatternModel, init_weights


class KeptCopyLayer(Layer):
    """A matmul's output (kept by ``exclude_op: [MatMul]``) written in place later by ``copy_``
    (PyTorch's test_checkpointing_without_reentrant_saved_object_identity writes a saved output the same way)."""

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        m = ops.matmul(self.norm2(h), self.mlp.fc1.weight.T)          # MatMul: kept under exclude_op
        m.copy_(m * 0.5 + 1.0)                                        # the kept output written in place
        return h + self.mlp.fc2(ops.gelu(m))


class KeptAssignAddLayer(Layer):
    """As ``KeptCopyLayer``, written by ``ops.assign_add`` (a side-effect op, not an ``Inplace*`` one)."""

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        m = ops.matmul(self.norm2(h), self.mlp.fc1.weight.T)
        ops.assign_add(m, ops.stop_gradient(m) * 0.25)
        return h + self.mlp.fc2(ops.gelu(m))


class KeptSetitemLayer(Layer):
    """As ``KeptCopyLayer``, written by slice assignment (``m[:] = m * 2``: a rebinding of the kept output)."""

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        m = ops.matmul(self.norm2(h), self.mlp.fc1.weight.T)
        m[:] = m * 2.0
        return h + self.mlp.fc2(ops.gelu(m))


class KeptWriterLayer(Layer):
    """A kept op that writes its own argument, as ``mint.distributed.all_reduce(t)`` reduces ``t`` in place:
    here ``t.copy_(...)`` under ``exclude_op: [InplaceCopy]``; the layer goes on with ``t``, not with what
    the op returned."""

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        t = self.norm2(h) * 1.0
        t.copy_(t * 2.0 + 0.5)                                        # kept: re-run must see t written
        return h + self.mlp(t)


class SliceBufferLayer(Layer):
    """A non-trainable buffer written by slice assignment, and read before the write (a running history)."""

    def __init__(self):
        super().__init__()
        self.hist = Parameter(Tensor(np.zeros(8, np.float32)), name="hist", requires_grad=False)

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale) * (1.0 + self.hist[1])
        self.hist[1:4] = ops.stop_gradient(h.mean((0, 1))[:3])
        return h + self.mlp(self.norm2(h))


class AssignValueBufferLayer(Layer):
    """A non-trainable buffer given a new value with ``assign_value`` (no op, no ``set_data``)."""

    def __init__(self):
        super().__init__()
        self.ema = Parameter(Tensor(np.full(H, 0.5, np.float32)), name="ema", requires_grad=False)

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale) * self.ema
        self.ema.assign_value(ops.stop_gradient(self.ema * 0.9 + 0.1 * h.mean((0, 1))))
        return h + self.mlp(self.norm2(h))


class ReboundWeightLayer(Layer):
    """A trainable weight rebound in forward (``self.gain = self.gain * 0.999``: ``Parameter.set_data``), read
    before and after the rebinding."""

    def __init__(self):
        super().__init__()
        self.gain = Parameter(Tensor(np.full(H, 1.0, np.float32)), name="gain")

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale) * self.gain
        self.gain = ops.stop_gradient(self.gain * 0.999)
        return h + self.mlp(self.norm2(h)) * self.gain


class OneIndexSlotLayer(Layer):
    """A 32-element buffer, one slot read and then written (``self.hist[0] = self.hist[0] + 0.5``: a
    ScatterNdUpdate into the buffer, whose other inputs are smaller than it)."""

    def __init__(self):
        super().__init__()
        self.hist = Parameter(Tensor(np.zeros(32, np.float32)), name="hist", requires_grad=False)

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale) * (1.0 + self.hist[0])
        self.hist[0] = self.hist[0] + 0.5
        return h + self.mlp(self.norm2(h))


class SharedCounterLayer(Layer):
    """Counts its calls into a counter every layer shares (``counter``, set by ``build_shared_counter``), read
    before the count."""

    counter = None

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale) * (1.0 + 0.01 * self.counter)
        ops.assign_add(self.counter, Tensor(np.ones(1, np.float32)))
        return h + self.mlp(self.norm2(h))


def build_shared_counter():
    model = build_layers(SharedCounterLayer)
    model.counter = Parameter(Tensor(np.zeros(1, np.float32)), name="counter", requires_grad=False)
    for layer in model.layers:   # the model's Parameter, held by every layer (not one of a layer's own)
        object.__setattr__(layer, "counter", model.counter)
    return model


class SpectralNormLayer(Layer):
    """Spectral norm of the MLP's first weight by one power iteration on a kept vector ``u``, which the forward
    replaces (``set_data``) or assigns (``ops.assign``): ``how``."""

    how = "assign"

    def __init__(self):
        super().__init__()
        rows = self.mlp.fc1.weight.shape[0]
        self.u = Parameter(Tensor(np.full(rows, 0.25, np.float32)), name="u", requires_grad=False)

    def construct(self, x, pos, mask, scale):
        w = ops.stop_gradient(self.mlp.fc1.weight)
        v = ops.matmul(self.u, w)
        v = v / (ops.norm(v) + 1e-6)
        u = ops.matmul(w, v)
        u = u / (ops.norm(u) + 1e-6)
        if self.how == "assign":
            ops.assign(self.u, u)
        else:
            self.u.set_data(u)
        sigma = ops.tensor_dot(self.u, ops.matmul(w, v), 1)
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        return h + self.mlp(self.norm2(h)) / sigma


def spectral_norm_by(how):
    return type(f"SpectralNorm_{how}", (SpectralNormLayer,), {"how": how})


class AssignTrainableLayer(Layer):
    """``ops.assign`` on a trainable weight in forward, read before and after it."""

    def __init__(self):
        super().__init__()
        self.gain = Parameter(Tensor(np.full(H, 1.0, np.float32)), name="gain")

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale) * self.gain
        ops.assign(self.gain, ops.stop_gradient(self.gain * 0.999))
        return h + self.mlp(self.norm2(h)) * self.gain


class RebindsArgumentLayer(Layer):
    """Rebinds the model's Parameter it is handed as ``scale`` (``set_data``), after reading it."""

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        scale.set_data(ops.stop_gradient(scale * 1.01))
        return h + self.mlp(self.norm2(h)) * scale


def build_rebinds_argument():
    """Every layer gets the model's non-trainable Parameter ``scale`` as an argument and rebinds it."""
    model = build_layers(RebindsArgumentLayer)
    model.scale = Parameter(Tensor(np.linspace(0.5, 1.5, H).astype(np.float32)), name="scale", requires_grad=False)
    return model


class ReplacesParameterLayer(Layer):
    """Replaces its own Parameter by a new object in forward (``self.g = Parameter(...)``), after reading it."""

    def __init__(self):
        super().__init__()
        self.g = Parameter(Tensor(np.full(H, 1.0, np.float32)), name="g", requires_grad=False)

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale) * self.g
        self.g = Parameter(ops.stop_gradient(self.g * 0.99), name="g", requires_grad=False)
        return h + self.mlp(self.norm2(h))


class WriteBetweenModel(PatternModel):
    """Writes in place into the hidden states between layer 0 and layer 1 (``how``: ``setitem`` rebinds
    the tensor's storage, ``copy`` writes it)."""

    def __init__(self, how):
        super().__init__([Layer() for _ in range(N_LAYERS)])
        self.how = how

    def construct(self, x, y, pos, mask):
        for i, layer in enumerate(self.layers):
            if i == 1:
                if self.how == "setitem":
                    x[:, 0] = 0
                else:
                    x.copy_(x * 0.5)
            x = self.run_layer(layer, x, pos, mask, self.scale)
        return self.loss(x, y)


class SavesOutputLayer(Layer):
    """Ends with a sigmoid, which saves its output for backward."""

    def construct(self, x, pos, mask, scale):
        return ops.sigmoid(super().construct(x, pos, mask, scale))


class WritesInputLayer(Layer):
    """Writes into its input in place (``copy_``) before using it: the previous layer saved that tensor."""

    def construct(self, x, pos, mask, scale):
        x.copy_(x * 0.5)
        return super().construct(x, pos, mask, scale)


class SavedOutputCell(nn.Cell):
    """A sigmoid in its own cell (an ``op_swap`` target): what it saves for backward is its output."""

    def construct(self, x):
        return ops.sigmoid(x)


class SavesOutputCellLayer(Layer):
    """Ends with ``SavedOutputCell``: the layer's output is what its last cell saved."""

    def __init__(self):
        super().__init__()
        self.out_act = SavedOutputCell()

    def construct(self, x, pos, mask, scale):
        return self.out_act(super().construct(x, pos, mask, scale))


INPUT_WRITES = {   # how a layer writes its input in place (the previous layer saved that tensor)
    "copy_": lambda x: x.copy_(x * 0.5),                                   # InplaceCopy: advances the version
    "assign_add": lambda x: ops.assign_add(x, ops.stop_gradient(x) * 0.25),  # same storage, same version
    "setitem": lambda x: x.__setitem__((slice(None), 0), 0.0),             # a rebinding: new storage
    "assign": lambda x: ops.assign(x, ops.stop_gradient(x) * 0.5 + 0.1),    # same storage, same version
    # a Tensor's ``set_data`` (only a Parameter has ``set_data`` in 2.10): a rebinding, new storage
    "assign_value": lambda x: x.assign_value(ops.stop_gradient(x) * 0.5 + 0.1),
}


class WritesInputByLayer(Layer):
    """Writes its input in place with ``INPUT_WRITES[how]`` before using it; ``keeps_input`` False: goes on
    with a copy (``x + 0``, which saves nothing), so the written tensor dies once the layer returns."""

    how, keeps_input = "copy_", True

    def construct(self, x, pos, mask, scale):
        INPUT_WRITES[self.how](x)
        return super().construct(x if self.keeps_input else x + 0.0, pos, mask, scale)


def writes_input_by(how, keeps_input=True):
    """A ``WritesInputByLayer`` class writing with ``how``."""
    return type(f"WritesInputBy_{how}", (WritesInputByLayer,), {"how": how, "keeps_input": keeps_input})


@dataclasses.dataclass
class LayerOutput:
    """A Hugging Face-style layer output: the hidden state inside a dataclass, not a tuple or dict."""
    hidden: object


HiddenTuple = collections.namedtuple("HiddenTuple", "hidden")


class Box:
    """A custom class holding a layer's output (an instance ``__dict__``, no container)."""

    def __init__(self, hidden):
        self.hidden = hidden


# what holds a layer's output: the engine finds a tensor in a tuple (a namedtuple too) or a dict; in any other
# object, swap sees a write into it by the saved tensor's stamp (rule W6s)
HOLDERS = {"tuple": lambda h: (h,), "dict": lambda h: {"hidden": h}, "dataclass": LayerOutput,
           "namedtuple": HiddenTuple, "object": Box}


def unwrap(out):
    """The hidden state in a layer's output, whatever ``HOLDERS`` entry holds it."""
    if isinstance(out, dict):
        return out["hidden"]
    if isinstance(out, tuple):
        return out[0]
    return out.hidden if isinstance(out, (LayerOutput, Box)) else out


class HeldOutputLayer(SavesOutputCellLayer):
    """Returns its output (what its last cell saved) in ``HOLDERS[holder]``."""

    holder = "dataclass"

    def construct(self, x, pos, mask, scale):
        return HOLDERS[self.holder](super().construct(x, pos, mask, scale))


class UnwrapsOutputsModel(PatternModel):
    """Takes the hidden state out of what each layer returns (``unwrap``)."""

    def construct(self, x, y, pos, mask):
        for layer in self.layers:
            x = unwrap(self.run_layer(layer, x, pos, mask, self.scale))
        return self.loss(x, y)


def build_held_output(how, holder, keeps_input):
    """Layer 0 returns its saved output ``h`` in ``HOLDERS[holder]``; the next layers write their input with
    ``INPUT_WRITES[how]`` and go on with it (``keeps_input``: it stays alive until backward) or with a copy
    (``h`` dies written)."""
    first = type(f"HeldOutput_{holder}", (HeldOutputLayer,), {"holder": holder})
    layers = [first()] + [writes_input_by(how, keeps_input)() for _ in range(N_LAYERS - 1)]
    return init_weights(UnwrapsOutputsModel(layers))


def held_output_outcomes(cases, modes, steps=1):
    """For issue 49's matrix (one process: ``tests/test_swap_writes.py``): per ``(how, holder, keeps_input)``
    of ``cases``, train the model under each of ``modes`` and print one line per mode:
    ``<how> <holder> <keeps_input> <mode> BITWISE`` with the model without AC (or ``DIFFERS <where>``,
    ``REFUSED <error>``). The model without AC (mode ``plain``, printed too) runs once per ``(how,
    keeps_input)``: the holder changes no value. After a refused backward MindSpore's executor is reset
    (``clear_res``); the next case's bitwise comparison shows it recovered."""
    from mindformers_ac.mindspore_compat import pynative_executor

    from model_patterns import hidden_batch
    from steps import first_difference, run_steps

    def one(model):
        try:
            return run_steps(model, hidden_batch, steps=steps), None
        except Exception as exc:   # noqa: BLE001  (the test compares the refusal with MindSpore's own)
            pynative_executor.clear_res()
            return None, f"{type(exc).__name__} {exc}".replace("\n", " ")

    plain = {}
    for how, holder, keeps_input in cases:
        if (how, keeps_input) not in plain:
            plain[how, keeps_input] = one(build_held_output(how, "tuple", keeps_input))
            refused = plain[how, keeps_input][1]
            print(how, "-", keeps_input, "plain", "BITWISE" if refused is None else "REFUSED " + refused, flush=True)
        base = plain[how, keeps_input][0]
        for mode in modes:
            model = build_held_output(how, holder, keeps_input)
            swap_first_layer(model, mode)
            got, refused = one(model)
            if mac.ac_state(model) is not None:
                mac.remove_ac(model)
            if refused is not None:
                outcome = "REFUSED " + refused
            else:
                where = first_difference(base, got) if base is not None else "trained where plain was refused"
                outcome = "BITWISE" if where is None else f"DIFFERS {where}"
            print(how, holder, keeps_input, mode, outcome, flush=True)


def swap_first_layer(model, mode):
    """Swap layer 0 (the one whose saved output layer 1 writes) by ``mode``: ``layer_swap``, ``op_swap`` (its
    ``out_act``), ``swap_wrapper``, ``swap_api`` (``swap(layer, ...)``) or ``async_save_on_cpu`` (every layer
    a block: the last keeps its tensors)."""
    first = model.layers[0]
    if mode == "layer_swap":
        mac.apply_ac(model, config={"swap": {"enable": True, "layer_swap": [{"layers": [0]}]}})
    elif mode == "op_swap":
        mac.apply_ac(model, config={"swap": {"enable": True, "op_swap": [{"op_name": "out_act", "layers": [0]}]}})
    elif mode == "swap_wrapper":
        mac.swap_wrapper(first)
    elif mode == "swap_api":
        object.__setattr__(model, "run_layer",
                           lambda layer, *a, **k: mac.swap(layer, *a, **k) if layer is first else layer(*a, **k))
    elif mode == "async_save_on_cpu":
        layers = list(model.layers)

        def run_layer(layer, *args, **kwargs):
            with mac.async_save_on_cpu(block_idx=layers.index(layer), depth=len(layers), params=model):
                return layer(*args, **kwargs)
        object.__setattr__(model, "run_layer", run_layer)
    else:
        raise ValueError(f"swap_first_layer: unknown mode {mode!r}")


TRACKER = []   # a module-level aux-loss logger, as MindFormers' tracker: it keeps the attached loss


class TrackerLayer(Layer):
    """MindFormers 2.1.0's MoE router on MindSpore 2.10: the layer's aux loss added to a module-level
    tracker, attached to the graph (no ``detach``), skipped under the recompute marker; the add saves
    tensors for backward, but nothing the loss differentiates reads it."""

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale)
        aux = (h * h).mean()
        if not mac.is_in_recompute():
            TRACKER.append(aux * aux)          # Mul of two tracked inputs: saves them
        return h + self.mlp(self.norm2(h)) + aux * 0.01


class MetadataAttention(nn.Cell):
    """Hands a host value from its forward to its re-run (MindFormers' ``save_for_recompute``)."""

    def __init__(self):
        super().__init__()
        self.q = mint.nn.Linear(H, H)

    def construct(self, x):
        if mac.is_in_recompute():
            k = mac.get_recompute_metadata("k")
        else:
            k = int(np.argmax(np.abs(x.asnumpy()).sum((0, 1)))) % 4 + 1
            mac.save_for_recompute("k", k)
        return ops.sin(self.q(x)) * float(k)


class NestedLayer(Layer):
    """A sub-cell the user wrapped with ``checkpoint_wrapper`` inside a layer that apply_ac recomputes."""

    def __init__(self):
        super().__init__()
        self.inner = MetadataAttention()

    def construct(self, x, pos, mask, scale):
        h = x + self.attn(self.norm1(x), pos, mask, scale) + self.inner(x)
        return h + self.mlp(self.norm2(h))


def build_layers(layer_cls, first=None):
    layers = [layer_cls() for _ in range(N_LAYERS)]
    if first is not None:
        layers[0] = first()
    return init_weights(PatternModel(layers))


def build_nested():
    model = build_layers(NestedLayer)
    for layer in model.layers:
        mac.checkpoint_wrapper(layer.inner)
    return model


ALL = f"0-{N_LAYERS - 1}"
FULL = {"recompute": {"mode": "full", "full_recompute_layer": [ALL]}}


def exclude(*names):
    return {"recompute": {"mode": "full", "full_recompute_layer": [ALL], "exclude_op": list(names)}}


GROUP = {"recompute": {"mode": "full", "full_recompute_layer": [ALL], "group_layers": N_LAYERS}}
SELECT_ATTN = {"recompute": {"mode": "select", "select_module": {"attn": [ALL]}}}
LAYER_SWAP = {"swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}}


def print_one_step_outcome(model, batch):
    """For the refusal tests' subprocesses: train one step and print ``TRAINED``, or ``REFUSED`` with the
    exception's type and text."""
    from steps import run_steps
    try:
        run_steps(model, batch, steps=1)
    except Exception as exc:   # noqa: BLE001  (the caller compares the refusal with MindSpore's own)
        print("REFUSED", type(exc).__name__, exc)
    else:
        print("TRAINED")
