"""``mindformers-ac``: train with AC side by side, check a config, show what it would do.

    mindformers-ac train [CONFIG] [--steps N] [--layers L --hidden H --seq S --batch B --dropout P] [--report DIR]
    mindformers-ac validate CONFIG [--num-layers N] [--pp P]
    mindformers-ac explain [CONFIG] [--model module:factory] [--layers PATH] [--pp P]
    mindformers-ac plan --budget SIZE [CONFIG] [--model module:factory | --layers L --hidden H ...] [--prefetch P] [--pp P] [--out plan.yaml]

A rejected config exits with status 2 and the ``ConfigError`` message (which
names the field) on stderr, without a traceback.
"""
import argparse
import importlib
import logging
import sys
from importlib import resources

from ..config import AcConfig
from ..errors import ConfigError, quote

DEFAULT_MODEL = "mindformers_ac.harness.models:reference_model"


def default_config_path():
    """The shipped default config (a mix of recompute and swap for the 8-layer reference model)."""
    return str(resources.files("mindformers_ac.harness") / "default_configs" / "default.yaml")


def load_factory(spec):
    """``package.module:function`` -> the model that function returns."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError("--model", f"expected 'module:factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("--model", f"cannot load {spec!r}: {exc}") from None
    return factory()


def _summary(config):
    rc, comm, swap = config.recompute, config.recompute_comm, config.swap
    lines = [f"recompute: mode={rc.mode}"]
    if rc.full_recompute_layer is not None:
        lines.append(f"  full_recompute_layer: {list(rc.full_recompute_layer)}")
    for pattern, specs in (rc.select_module or {}).items() if rc.mode == "select" else ():
        lines.append(f"  select {pattern!r}: {list(specs)}")
    if rc.exclude_op:
        lines.append(f"  exclude_op: {rc.exclude_op}")
    lines.append(f"recompute_comm: enable={comm.enable}")
    for pattern, specs in (comm.select_module or {}).items() if comm.enable else ():
        lines.append(f"  select {pattern!r}: {list(specs)}")
    lines.append(f"swap: enable={swap.enable} default_prefetch={swap.default_prefetch}")
    if swap.enable:
        lines += [f"  layer_swap: {list(e['layers'])}" for e in swap.layer_swap or ()]
        lines += [f"  op_swap {e['op_name']!r}: {list(e['layers'])}" for e in swap.op_swap or ()]
    return "\n".join(lines)


def _int_argument(text):
    """An int of ASCII digits for argparse; its error quotes the text shortened (argparse would print all)."""
    try:
        if not text.isascii():   # int() would take Arabic-Indic or fullwidth digits
            raise ValueError(text)
        return int(text)   # ValueError past 4300 digits too
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (ASCII digits), got {quote(text)}") from None


def cmd_validate(args):
    from ..plan import check_layer_ids
    config = AcConfig.from_yaml(args.config)
    check_layer_ids(config, args.num_layers, args.pp)   # without --num-layers: the pp rule only
    print(_summary(config))
    checked = f"layer ids checked against {args.num_layers} layers" if args.num_layers else \
        "structure checked; pass --num-layers N to check layer ids too"
    print(f"OK: {args.config} ({checked})")
    return 0


def cmd_explain(args):
    from ..plan import plan_ac
    config = AcConfig.from_yaml(args.config or default_config_path())
    model = load_factory(args.model)
    plan = plan_ac(model, config=config, pp=args.pp, layers=args.layers)
    print(plan.explain())
    return 0


def cmd_train(args):
    from .report import layer_table, summary_text, write_report
    from .train import TrainSpec, train_and_compare
    spec = TrainSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch,
                     vocab=args.vocab, dropout=args.dropout, steps=args.steps, seed=args.seed, tp=args.tp)
    config = args.config or default_config_path()
    AcConfig.from_yaml(config)   # structural errors first, before any model is built
    if spec.tp > 1:
        from .train import train_and_compare_tp
        rank, result = train_and_compare_tp(spec, config)
    else:
        rank, result = 0, train_and_compare(spec, config)
    if rank == 0:   # under msrun every rank compares its own slice; one prints
        print()
        print(layer_table(result))
        print()
        print(summary_text(result))
        if args.report:
            for path in write_report(result, args.report):
                print(f"wrote {path}")
    s = result["summary"]
    return 0 if s["losses_match_bitwise"] and s["grads_match_bitwise"] else 1


def cmd_plan(args):
    from .models import synthetic_batch
    from ..planner.solver import parse_budget, plan_budget
    from ..planner.profile import profile_model, profile_reference
    prefetch = args.prefetch
    if prefetch is None:   # CONFIG only lends its swap.default_prefetch; its other sections are replaced
        prefetch = AcConfig.from_yaml(args.config).swap.default_prefetch if args.config else 1
    parse_budget(args.budget, 1)   # a malformed --budget fails before minutes of profiling
    if args.model:
        batches = [synthetic_batch(args.batch, args.seq, args.vocab, seed=args.seed + k) for k in range(4)]
        profile = profile_model(lambda: load_factory(args.model), batches, prefetch=prefetch,
                                steps=args.profile_steps, description=args.model)
    else:
        profile = profile_reference(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                                    batch=args.batch, vocab=args.vocab, dropout=args.dropout, seed=args.seed,
                                    prefetch=prefetch, steps=args.profile_steps)
    plan = plan_budget(profile, parse_budget(args.budget, profile.baseline_peak), pp=args.pp)
    print(f"profiled {profile.description}")
    print(plan.report())
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(plan.to_yaml())
        print(f"wrote {args.out}")
    else:
        print(plan.to_yaml())
    return 0


def build_parser():
    from .train import add_model_arguments, positive_int
    parser = argparse.ArgumentParser(prog="mindformers-ac", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the reference GPT without and with a config, compare")
    train.add_argument("config", nargs="?", default=None,
                       help="YAML config (default: the shipped default config, a mix of recompute and swap)")
    train.add_argument("--steps", type=positive_int, default=20)
    add_model_arguments(train)
    train.add_argument("--tp", type=positive_int, default=1,
                       help="tensor-parallel size; > 1 must run under msrun with that many workers "
                            "(see docs/distributed.md and `python -m mindformers_ac.harness.launch`)")
    train.add_argument("--report", default=None, metavar="DIR", help="write report.json and memory.png here")
    train.set_defaults(func=cmd_train)
    validate = sub.add_parser("validate", help="check a YAML config")
    validate.add_argument("config")
    validate.add_argument("--num-layers", type=_int_argument, default=None)
    validate.add_argument("--pp", type=_int_argument, default=1)
    validate.set_defaults(func=cmd_validate)
    explain = sub.add_parser("explain", help="print the plan a config gives on a model")
    explain.add_argument("config", nargs="?", default=None,
                         help="YAML config (default: the shipped default config)")
    explain.add_argument("--model", default=DEFAULT_MODEL,
                         help=f"model factory as module:function (default {DEFAULT_MODEL})")
    explain.add_argument("--layers", default=None, help="path of the layer list, if not found automatically")
    explain.add_argument("--pp", type=int, default=1)
    explain.set_defaults(func=cmd_explain)
    plan = sub.add_parser("plan", help="profile the reference GPT, choose recompute/swap per layer for a "
                                       "memory budget, write the YAML")
    plan.add_argument("config", nargs="?", default=None,
                      help="YAML config whose swap.default_prefetch to plan with (its other sections are ignored)")
    plan.add_argument("--budget", required=True,
                      help="peak activation memory: 3GiB, 512MiB, bytes, or a fraction of the baseline (0.4x)")
    plan.add_argument("--model", default=None,
                      help="model factory as module:function returning a fresh model (same weights each call) "
                           "called as model(tokens, labels) -> loss; default: the reference GPT built from "
                           "--layers/--hidden/--heads/--dropout")
    add_model_arguments(plan)
    plan.add_argument("--prefetch", type=int, default=None, help="swap.default_prefetch (default: CONFIG's, else 1)")
    plan.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size; > 1 rules out swap")
    plan.add_argument("--profile-steps", type=positive_int, default=12, help="timed steps per option")
    plan.add_argument("--out", default=None, help="write the YAML here (default: print it)")
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
