"""Custom autograd functions (MindSpore's torch-style ``_Function``) the way MoE and sparse-attention
models use them, and the reference MoE GPT routed through them.

* ``AuxLossAutoScaler``: Megatron's ``MoEAuxLossAutoScaler``. Forward returns its first input
  unchanged and saves the aux loss (``ctx.save_for_backward``); backward returns the output's
  gradient as it came and ``ones_like(aux_loss) * scale``, where ``scale`` is class-level state
  shared by every model, a tensor created on first use (or set by ``set_loss_scale``, in place
  once it exists).
* ``AttrAuxLossAutoScaler``: MindFormers' variant: the aux loss is a ctx attribute, not saved.
* ``ScaledSilu``: a function with a large saved input (what DSA/CSA save), a float ctx
  attribute, and a class-level per-channel scale created on first use, read in forward and in
  backward.

``build_function_moe`` is ``harness.moe.build_moe_gpt`` (same weights and parameter names) whose
routers inject the aux loss through a scaler (its gradient reaches the router through backward,
not through the loss) and whose experts activate with ``ScaledSilu``; with ``global_aux`` the
routers average the load over the steps in two Parameters the forward updates (MindFormers'
``global_aux_loss``). ``reset_function_state``
forgets the class-level state and the call counters.
"""
import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common._grad_function import _Function

from mindformers_ac.harness.moe import MoEGPTModel, TopKRouter, moe_config


class AuxLossAutoScaler(_Function):
    """Megatron's MoEAuxLossAutoScaler: the aux loss's gradient enters backward here."""

    main_loss_backward_scale = None   # class-level, shared by every model; created on first use
    backward_calls = 0

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        ctx.aux_dtype = aux_loss.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        cls = AuxLossAutoScaler
        cls.backward_calls += 1
        if cls.main_loss_backward_scale is None:
            cls.main_loss_backward_scale = Tensor(1.0, ctx.aux_dtype)
        return grad_output, ops.ones_like(aux_loss) * cls.main_loss_backward_scale

    @staticmethod
    def set_loss_scale(scale):
        cls = AuxLossAutoScaler
        if cls.main_loss_backward_scale is None:
            cls.main_loss_backward_scale = Tensor(scale, ms.float32)
        else:   # in place, as Megatron's copy_: every holder of the tensor sees the new value
            cls.main_loss_backward_scale.copy_(Tensor(scale, ms.float32))


class AttrAuxLossAutoScaler(_Function):
    """MindFormers' _MoEAuxLossAutoScaler: the aux loss is held as a ctx attribute."""

    main_loss_backward_scale = None
    backward_calls = 0

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.aux_loss = aux_loss
        return output

    @staticmethod
    def backward(ctx, grad_output):
        aux_loss = ctx.aux_loss
        cls = AttrAuxLossAutoScaler
        cls.backward_calls += 1
        if cls.main_loss_backward_scale is None:
            cls.main_loss_backward_scale = Tensor(1.0, aux_loss.dtype)
        return grad_output, ops.ones_like(aux_loss) * cls.main_loss_backward_scale


class ScaledSilu(_Function):
    """``x * sigmoid(beta * x) * scale`` with a hand-written backward; ``scale`` (per channel) is
    class-level state created on first use, read in forward and backward."""

    channel_scale = None
    backward_calls = 0

    @staticmethod
    def forward(ctx, x, beta):
        cls = ScaledSilu
        if cls.channel_scale is None or cls.channel_scale.shape[0] != x.shape[-1]:
            cls.channel_scale = Tensor(np.linspace(0.75, 1.25, x.shape[-1]).astype(np.float32))
        ctx.save_for_backward(x)
        ctx.beta = beta
        return x * ops.sigmoid(x * beta) * cls.channel_scale

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        cls = ScaledSilu
        cls.backward_calls += 1
        s = ops.sigmoid(x * ctx.beta)
        return grad_output * cls.channel_scale * (s + x * ctx.beta * s * (1 - s)), None


def scaled_silu(x):
    return ScaledSilu.apply(x, 1.5)


FUNCTIONS = (AuxLossAutoScaler, AttrAuxLossAutoScaler, ScaledSilu)


def reset_function_state():
    """Forget the class-level state and the call counters (the next use creates the state again)."""
    AuxLossAutoScaler.main_loss_backward_scale = None
    AttrAuxLossAutoScaler.main_loss_backward_scale = None
    ScaledSilu.channel_scale = None
    for fn in FUNCTIONS:
        fn.backward_calls = 0


class AuxScalerCell(nn.Cell):
    """MindFormers' wrapper cell: the router calls the function through a sub-cell."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def construct(self, output, aux_loss):
        return self.function.apply(output, aux_loss)


class FunctionRouter(TopKRouter):
    """``TopKRouter`` whose load-balancing loss reaches backward through ``aux_scaler`` (applied to
    the top-k weights, as Megatron applies it to the router's probabilities)."""

    def construct(self, x):
        weights, indices, aux = super().construct(x)
        return self.aux_scaler(weights, aux * self.aux_coeff), indices, aux


class GlobalAuxRouter(FunctionRouter):
    """MindFormers' ``global_aux_loss``: the load is averaged over the steps so far, in two
    non-trainable Parameters the forward updates with ``+=`` (``Cell.__setattr__`` then gives the
    Parameter the sum's storage: a ``set_data``, not an op)."""

    def construct(self, x):
        logits = ops.matmul(x, self.weight.T)
        scores = ops.softmax(logits, -1)
        weights, indices = ops.topk(scores, self.top_k)
        chosen = ops.one_hot(indices, self.num_experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        self.global_tokens_per_expert += ops.stop_gradient(chosen.sum((0, 1)))
        self.ga_steps += 1
        averaged = self.global_tokens_per_expert / self.ga_steps
        aux = (scores.sum(0) * averaged).sum() * (self.num_experts / (self.top_k * x.shape[0] ** 2))
        return self.aux_scaler(weights, aux * self.aux_coeff), indices, aux


class FunctionMoEGPT(MoEGPTModel):
    """The loss is the cross-entropy alone: the aux loss's gradient comes from the routers' scalers."""

    def construct(self, tokens, labels):
        self.dropout_seeds.step += 1
        s = tokens.shape[1]
        hidden, _ = self.decoder(self.embedding(tokens), self.attention_mask[:, :, :s, :s])
        logits = self.output_layer(hidden)
        return self.loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


DIMS = dict(num_layers=4, hidden_size=16, num_heads=2, seq_length=8, vocab_size=24, dropout=0.0,
            num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coeff=0.05)
BATCH = 2


def build_function_moe(scaler=AuxLossAutoScaler, seed=0, global_aux=False, **dims):
    """The reference MoE GPT (``DIMS``, every layer MoE) with ``scaler`` in every router and
    ``ScaledSilu`` in every expert; every build has the same weights. ``global_aux``: the routers
    are ``GlobalAuxRouter`` (with their two counters)."""
    config = moe_config(**{**DIMS, **dims})
    ms.set_seed(seed)
    np.random.seed(seed)
    model = FunctionMoEGPT(config, seed)
    for layer in model.decoder.layers:
        if not layer.is_moe_layer:
            continue
        router = layer.mlp.router
        # The reference router keeps its weight and parameter names: only construct differs.
        router.__class__ = GlobalAuxRouter if global_aux else FunctionRouter
        router.aux_scaler = AuxScalerCell(scaler)
        router.aux_coeff = config.aux_loss_coeff
        if global_aux:
            router.global_tokens_per_expert = Parameter(Tensor(np.zeros(config.num_experts, np.float32)),
                                                        name="global_tokens_per_expert", requires_grad=False)
            router.ga_steps = Parameter(Tensor(0.0, ms.float32), name="ga_steps", requires_grad=False)
        for expert in (*layer.mlp.experts.local_experts, layer.mlp.shared_experts):
            expert.activation_func = scaled_silu
    model.set_train(True)
    ms.set_seed(seed)
    return model


def function_batch(step):
    """(tokens, labels) of ``step``: a fixed random stream, the same for every model."""
    rng = np.random.default_rng(1000 + step)
    tokens = rng.integers(0, DIMS["vocab_size"], size=(BATCH, DIMS["seq_length"] + 1), dtype=np.int32)
    return Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])

