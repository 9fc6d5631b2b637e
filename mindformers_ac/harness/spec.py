"""What one ``mindformers-ac`` comparison trains: the model (reference GPT, MoE GPT or the user's), its data
and schedule (``TrainSpec``), and the command-line flags that set them.

``add_model_arguments`` / ``spec_from_args`` are the one mapping between the
short flags (``--layers --hidden ...``) and the model's (MindFormers') field
names; ``profile_spec`` runs the planner's profile on the model a spec builds.
"""
import argparse
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError, quote
from .models import GPTConfig, SyntheticBatches

# The reference GPT's command-line flags and the ``GPTConfig`` field each one sets: the one mapping
# between the short flag names and the model's (MindFormers') field names.
GPT_FLAGS = (("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_heads"),
             ("seq", "seq_length"), ("vocab", "vocab_size"), ("dropout", "dropout"))


# Flags that shape only the reference synthetic batch and the weights' seed: with ``--model`` they
# still feed a factory that returns a model only (called as ``model(tokens, labels)``).
DATA_FLAGS = ("batch", "seq", "vocab", "seed")


# Expert-parallel rank r trains on the synthetic batches of seed ``seed + EP_DATA_STRIDE * r``.
EP_DATA_STRIDE = 1000


@dataclass
class TrainSpec:
    """Model, data and schedule of one comparison; the same for every run.

    Without ``factory``: the reference GPT ``gpt`` trained on ``SyntheticBatches``
    of ``batch`` x ``gpt.seq_length`` tokens. With ``factory``
    (``"module:function"``): the user's model and its ``make_inputs``, its layer
    list at ``layer_list`` (None: found automatically); ``gpt``, ``batch`` and
    ``seed`` then only shape the synthetic batch of a factory that returns a
    model alone, and ``data_flags`` names the data flags the user gave
    (an error for a factory that returns its own ``make_inputs``).
    """

    gpt: GPTConfig = field(default_factory=GPTConfig)
    batch: int = 4
    steps: int = 20
    seed: int = 0
    lr: float = 0.05
    tp: int = 1
    ep: int = 1                    # expert-parallel size (MoE model only)
    pp: int = 1                    # pipeline stages (reference GPT only: 2, one per rank)
    microbatches: int = 1          # microbatches in flight per step with pp > 1 (GPipe order)
    dp: int = 1                    # data-parallel replicas (harness.data_parallel), of the TP group or pipeline
    moe: Optional[dict] = None     # MoEConfig fields beyond ``gpt``: the reference MoE GPT instead of the dense one
    factory: Optional[str] = None
    layer_list: Optional[str] = None
    data_flags: tuple = ()

    @classmethod
    def from_dict(cls, values):
        """The inverse of ``dataclasses.asdict`` (how a spec travels to a worker process as JSON)."""
        values = dict(values)
        return cls(gpt=GPTConfig(**values.pop("gpt")), data_flags=tuple(values.pop("data_flags", ())), **values)

    def synthetic_batches(self, rank=0):
        """``make_inputs`` of the reference synthetic data for this spec (expert parallel: rank ``rank``'s)."""
        seed = self.seed + EP_DATA_STRIDE * rank
        return SyntheticBatches(self.batch, self.gpt.seq_length, self.gpt.vocab_size, seed)

    def user_model(self):
        """The ``UserModel`` of ``factory`` (None without one)."""
        if self.factory is None:
            return None
        from .user_model import UserModel
        return UserModel(self.factory, self.layer_list, self.synthetic_batches(), self.data_flags)

    def build(self, rank=0):
        """``(model, make_inputs)``: the user's (``factory``), else the reference GPT, or this rank's
        tensor-parallel slice of it when ``tp > 1``, with ``synthetic_batches()``.

        Raises ``ConfigError`` for a factory that breaks the ``--model`` contract (see ``user_model``).
        """
        if self.factory is not None:
            return self.user_model().build()
        if self.moe is not None:   # expert parallel is data parallel too: every rank trains on its own batches
            from .moe import build_moe_gpt, moe_config
            return (build_moe_gpt(moe_config(self.gpt, **self.moe), self.seed, ep=self.ep, rank=rank),
                    self.synthetic_batches(rank if self.ep > 1 else 0))
        if self.tp == 1:
            from .models import build_gpt
            return build_gpt(self.gpt, self.seed), self.synthetic_batches()
        from .tp import build_tp_gpt
        return build_tp_gpt(self.tp, rank, self.gpt, self.seed), self.synthetic_batches()

    def describe(self):
        """One line naming the model and data."""
        if self.factory is not None:
            return f"--model {self.factory}"
        g = self.gpt
        if self.moe is not None:
            from .moe import moe_config
            m = moe_config(g, **self.moe)
            return (f"reference MoE GPT: {g.num_layers} layers (MoE every {m.moe_layer_freq}), hidden "
                    f"{g.hidden_size}, {m.num_experts} experts, top-{m.top_k}, capacity factor "
                    f"{m.capacity_factor}, seq {g.seq_length}, batch {self.batch}"
                    + (f", ep {self.ep}" if self.ep > 1 else ""))
        return (f"reference GPT: {g.num_layers} layers, hidden {g.hidden_size}, heads {g.num_heads}, "
                f"seq {g.seq_length}, batch {self.batch}" + (f" per data-parallel rank, dp {self.dp}"
                                                             if self.dp > 1 else "")
                + (f", {self.pp} pipeline stages, {self.microbatches} microbatches in flight (GPipe)"
                   if self.pp > 1 else ""))


def add_model_arguments(parser, *, with_model=False, **defaults):
    """Add the reference GPT's flags (``--layers --hidden --heads --seq --vocab --dropout``, see
    ``GPT_FLAGS``) and its data's ``--batch --seed`` to an argparse ``parser``.

    Every flag defaults to None, so ``spec_from_args`` can tell the flags given
    from the defaults: ``TrainSpec``'s, overridden by ``defaults`` (flag names,
    e.g. ``layers=4``), which are kept on the parser. ``with_model``: the
    command also has ``--model``, with which the GPT's shape flags do not apply
    and ``--layer-list PATH`` (``add_layer_list_argument``) names the layer list.
    """
    base = _reference_values(defaults)
    suffix = " (reference GPT only)" if with_model else ""
    for flag, name in GPT_FLAGS:
        kind = {"layers": layer_count, "dropout": _probability}.get(flag, positive_int)
        parser.add_argument(f"--{flag}", type=kind, default=None, metavar=flag.upper(),
                            help=f"{name} (default {base[flag]}){suffix}")
    parser.add_argument("--batch", type=positive_int, default=None, help=f"batch size (default {base['batch']})")
    parser.add_argument("--seed", type=int, default=None, help=f"weights and data seed (default {base['seed']})")
    if with_model:
        add_layer_list_argument(parser)
    parser.set_defaults(model_defaults=dict(defaults))


def add_layer_list_argument(parser):
    """``--layer-list PATH``: where the layer list of a ``--model`` factory's model is (``layers=`` of ``apply_ac``)."""
    parser.add_argument("--layer-list", dest="layer_list", default=None, metavar="PATH",
                        help="with --model: attribute path of the model's layer list, e.g. model.stack "
                             "(default: found automatically under the usual names)")


def _reference_values(defaults):
    """Flag name -> value of the reference model and data: ``TrainSpec()``'s, then ``defaults``."""
    spec = TrainSpec()
    values = {flag: getattr(spec.gpt, name) for flag, name in GPT_FLAGS}
    values.update(batch=spec.batch, seed=spec.seed)
    values.update(defaults)
    return values


def spec_from_args(args, **fields):
    """The ``TrainSpec`` that ``add_model_arguments``' flags (and ``--model``, if the parser has it) give.

    ``fields`` sets other ``TrainSpec`` fields (``steps``, ``tp`` ...). Raises
    ``ConfigError`` naming the flag for ``--layers``/``--hidden``/``--heads``/``--dropout``
    with ``--model`` (the factory builds the model), for ``--layer-list``
    without ``--model`` (the reference GPT's layer list is known), and for a
    reference GPT shape that can't build (``check_gpt_shape``).
    """
    from .moe import moe_from_args
    factory = getattr(args, "model", None)
    flags = [flag for flag, _ in GPT_FLAGS] + ["batch", "seed"]
    given = {flag: getattr(args, flag) for flag in flags if getattr(args, flag) is not None}
    layer_list = getattr(args, "layer_list", None)
    if factory is not None:
        for flag in given:
            if flag not in DATA_FLAGS:
                hint = "; name its layer list with --layer-list PATH" if flag == "layers" else ""
                raise ConfigError(f"--{flag}", f"applies to the reference GPT only; with --model {factory} "
                                               f"the factory builds the model{hint}")
    elif layer_list is not None:
        raise ConfigError("--layer-list", "names the layer list of a --model factory's model; the reference GPT's "
                                          "is found by itself (its number of layers is --layers N)")
    values = {**_reference_values(args.model_defaults), **given}
    gpt = GPTConfig(**{name: values[flag] for flag, name in GPT_FLAGS})
    if factory is None:
        check_gpt_shape(gpt, fields.get("tp", 1))
    if hasattr(args, "moe"):   # a command with the MoE flags (moe.add_moe_arguments)
        if factory is not None and args.moe:
            raise ConfigError("--moe", f"builds the reference MoE GPT; with --model {factory} the factory builds "
                                       f"the model")
        fields.setdefault("moe", moe_from_args(args, gpt, fields.get("ep", 1)))
    return TrainSpec(gpt=gpt, batch=values["batch"], seed=values["seed"], factory=factory, layer_list=layer_list,
                     data_flags=tuple(f for f in DATA_FLAGS if f in given) if factory else (), **fields)


def check_gpt_shape(gpt, tp=1):
    """Raise ``ConfigError`` naming the flags for reference GPT dimensions that can't build or train.

    The attention splits ``--hidden`` into ``--heads`` heads of equal size;
    tensor parallel (``tp`` > 1) gives each rank ``--heads / --tp`` heads and,
    with sequence parallelism, ``--seq / --tp`` positions. Checked from the
    flags before any model is built, so no traceback comes from a reshape.
    """
    h, heads, seq = gpt.hidden_size, gpt.num_heads, gpt.seq_length
    if h % heads:
        fit = max(d for d in range(1, heads + 1) if h % d == 0)
        raise ConfigError("--hidden", f"{h} is not a multiple of --heads {heads}: the attention splits the hidden "
                                      f"size into --heads heads of equal size; use --hidden "
                                      f"{-(-h // heads) * heads} or --heads {fit}, for example")
    if tp > 1 and heads % tp:
        raise ConfigError("--tp", f"{tp} does not divide --heads {heads}: tensor parallel gives each rank "
                                  f"--heads / --tp attention heads")
    if tp > 1 and seq % tp:
        raise ConfigError("--tp", f"{tp} does not divide --seq {seq}: sequence parallel gives each rank "
                                  f"--seq / --tp positions")


def layer_count(text):
    """argparse type of ``--layers``: the reference GPT's number of layers; the error points a layer-list
    path to ``--layer-list``."""
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected the reference GPT's number of layers (a positive integer), "
                                         f"got {quote(text)}; a --model's layer-list path is --layer-list PATH") \
            from None


def ascii_int(text):
    """argparse type: an int of ASCII digits; its error quotes the text shortened (argparse would print all)."""
    try:
        if not text.isascii():   # int() would take Arabic-Indic or fullwidth digits
            raise ValueError(text)
        return int(text)   # ValueError past 4300 digits too
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (ASCII digits), got {quote(text)}") from None


def positive_int(text):
    """argparse type: an integer > 0 (of ASCII digits)."""
    if ascii_int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {quote(text)}")
    return int(text)


def _probability(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a dropout probability in [0, 1), got {text}")
    return value


def profile_spec(spec=None, prefetch=1, steps=12, warmup=2, check_loss=None):
    """The planner's ``profile_model`` on the model of ``spec`` (default: the reference GPT), with
    ``train``'s inputs (the same synthetic batches, step by step); ``check_loss`` as ``profile_model``'s."""
    from ..planner.profile import profile_model
    spec = spec if spec is not None else TrainSpec()
    return profile_model(spec.build, layers=spec.layer_list, prefetch=prefetch, steps=steps, warmup=warmup,
                         description=spec.describe(), check_loss=check_loss)
