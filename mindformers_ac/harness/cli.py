"""``mindformers-ac``: train with AC side by side, check a config, show what it would do.

    mindformers-ac train [CONFIG] [--steps N] [--layers L --hidden H --seq S --batch B --dropout P] [--report DIR]
    mindformers-ac train CONFIG --model MODULE:FUNCTION [--layer-list PATH] [--steps N] [--report DIR]
    mindformers-ac train CONFIG --dp N [--tp 2 | --pp 2]   (under msrun: python -m mindformers_ac.harness.launch)
    mindformers-ac validate CONFIG [--num-layers N] [--pp P]
    mindformers-ac explain [CONFIG] [--model MODULE:FUNCTION] [--layer-list PATH] [--pp P] [--step]
    mindformers-ac plan --budget SIZE [CONFIG] [--model MODULE:FUNCTION [--layer-list PATH] | --layers L --hidden H ...] [--prefetch P] [--pp P] [--dp N] [--out plan.yaml]

``--model MODULE:FUNCTION`` is the user's model: ``FUNCTION()`` returns
``(model, make_inputs)`` and ``model(*make_inputs(step))`` is the step's loss
(``user_model`` has the whole contract). A rejected config, model or flag
exits with status 2 and the message (which names the field or flag) on
stderr, without a traceback. ``train`` exits 0 when the runs without and with
AC are bitwise equal, 1 when AC changed them, 3 when the model is not
reproducible by itself. SIGINT and SIGTERM stop every command cleanly (a
``train`` worker process is stopped, its temporary directory removed) with
the shell's status for the signal: 130 and 143.
"""
import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from importlib import resources

import yaml

from ..config import AcConfig
from ..errors import ConfigError, quote
from .variant import RunFailed

DEFAULT_MODEL = "mindformers_ac.harness.models:reference_model"
MODEL_HELP = ("your model: FUNCTION() returns (model, make_inputs), model(*make_inputs(step)) is the step's loss, "
              "same weights on every call (a model alone is fed the synthetic (tokens, labels)); MODULE is "
              "imported from the current directory")


def default_config_path():
    """The shipped default config (a mix of recompute and swap for the 8-layer reference model)."""
    return str(resources.files("mindformers_ac.harness") / "default_configs" / "default.yaml")


def _summary(config):
    """Every field the config sets, per section: settings on the section's line, then each list (generic over
    the sections' fields, so a field or an action added later shows without a change here)."""
    lines = []
    for name, section in config.to_dict().items():
        settings = {k: v for k, v in section.items() if not isinstance(v, (list, dict))}
        lines.append(f"{name}: " + " ".join(f"{k}={v}" for k, v in settings.items()))
        lines += [f"  {k}: {yaml.safe_dump(v, default_flow_style=True, sort_keys=False, width=10 ** 6).strip()}"
                  for k, v in section.items() if k not in settings]
    return "\n".join(lines)


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
    from .spec import TrainSpec
    if args.step and args.pp > 1:   # before the model is built
        raise ConfigError("--step", "runs the whole model in this process; drop --pp (a pipeline stage's plan "
                                    "is shown without a step)")
    config = AcConfig.from_yaml(args.config or default_config_path())
    user = TrainSpec(factory=args.model, layer_list=args.layer_list).user_model()
    model, make_inputs = user.build()
    if args.step:
        print(_plan_after_a_step(model, make_inputs, config, args.layer_list).explain())
    else:   # no step is run: explain only plans
        print(plan_ac(model, config=config, pp=args.pp, layers=args.layer_list).explain())
    return 0


def _plan_after_a_step(model, make_inputs, config, layer_list):
    """The plan ``apply_ac`` installed, after one training step: what only a step tells (an op target that
    saved nothing is taken off, and the plan notes it) is in its notes. The model is left as it was."""
    from ..apply import remove_ac
    from ..training import TrainingRun
    run = TrainingRun(model, config=config, layers=layer_list)
    try:
        run.step(make_inputs(0))
        return run.plan
    finally:
        remove_ac(model)


def cmd_train(args):
    from .spec import spec_from_args
    if args.model is not None and args.tp > 1:
        raise ConfigError("--tp", "tensor parallel trains the reference GPT only; it can't be combined with --model")
    if args.tp > 1 and (args.moe or args.ep > 1):
        raise ConfigError("--tp", "tensor parallel trains the dense reference GPT; use --ep for the MoE model")
    if args.model is not None and args.config is None and args.budget is None:
        raise ConfigError("CONFIG", "train --model needs the YAML config to apply (or --budget): the shipped "
                                    "default config targets the reference GPT's 8 layers")
    check_pipeline_flags(args)
    check_data_parallel_flags(args)
    spec = spec_from_args(args, steps=args.steps, tp=args.tp, ep=args.ep, pp=args.pp, microbatches=args.microbatches,
                          dp=args.dp)
    require_launcher(args)   # after every flag's own check: a wrong flag is said first
    config = args.config or (None if args.budget is not None else default_config_path())
    loaded = AcConfig.from_yaml(config) if config else AcConfig()   # structural errors first, before any model
    with contextlib.ExitStack() as stack:
        if args.budget is not None:
            config = stack.enter_context(budget_config(args, loaded))
        if args.report:
            prepare_report_dir(args.report)   # before minutes of training, not after
        return _train(args, spec, config)


@contextlib.contextmanager
def budget_config(args, config):
    """``--budget``: ``config`` with ``memory_budget.activations`` set, as a temporary YAML (the runs read a path).

    Checked before anything runs: the size's spelling and enough ``--steps`` to profile, install the choice
    and measure it. Under msrun the ranks choose together (``budget.agreement``).
    """
    import dataclasses
    import tempfile

    from ..budget.sizes import parse_budget
    parse_budget(args.budget, 1, "--budget")
    settings = dataclasses.replace(config.memory_budget, activations=args.budget)   # CONFIG's profile_steps too
    if args.steps < settings.profile_steps + 2:
        raise ConfigError("--steps", f"with --budget, expected at least {settings.profile_steps + 2}: "
                                     f"memory_budget.profile_steps={settings.profile_steps} steps measure the "
                                     f"options, then one step measures the chosen plan and one runs it")
    with tempfile.TemporaryDirectory(prefix="mindformers-ac-budget-") as workdir:
        path = os.path.join(workdir, "budget.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(dataclasses.replace(config, memory_budget=settings).to_yaml())
        yield path


def _train(args, spec, config):
    from .report import budget_lines, layer_table, module_table, summary_text, write_report
    from .train import exit_status, train_and_compare
    if spec.dp > 1:
        from .data_parallel import train_and_compare_dp
        rank, result = train_and_compare_dp(spec, config)
    elif spec.pp > 1:
        from .pipeline import train_and_compare_pp
        rank, result = train_and_compare_pp(spec, config)
    elif spec.tp > 1 or spec.ep > 1:
        from .parallel import train_and_compare_tp
        rank, result = train_and_compare_tp(spec, config)
    else:
        rank, result = 0, train_and_compare(spec, config)
    # under msrun every rank compares its own slice; one prints, or each stage (each data-parallel rank) its own
    if rank == 0 or spec.pp > 1 or spec.dp > 1:
        if spec.dp > 1:
            print(f"\n{result['summary']['data_parallel']['layout']}:")
        elif spec.pp > 1:
            print(f"\npipeline stage {rank} (rank {rank} of {spec.pp}):")
        print()
        print(layer_table(result))
        print()
        print(module_table(result))
        print()
        print(summary_text(result))
        if args.report:
            directory = args.report if spec.pp == 1 and spec.dp == 1 else \
                os.path.join(args.report, f"rank{rank}" if spec.dp > 1 else f"stage{rank}")
            for path in write_report(result, directory):
                print(f"wrote {path}")
    elif result["summary"].get("memory_budget"):   # the plan the ranks chose together, said on every rank
        print(f"\nrank {rank} of {max(spec.tp, spec.ep)}:")
        print("\n".join(budget_lines(result["summary"]["memory_budget"])))
    return exit_status(result)


def ranks_needed(args):
    """How many ranks ``train``'s parallel flags run on: data-parallel replicas of a TP group, a pipeline or an
    expert-parallel group (1: one process)."""
    return args.dp * max(args.tp, args.pp, args.ep)


def parallel_flags(args):
    """The parallel flags given, as typed (``--dp 2 --tp 2``)."""
    return " ".join(f"--{flag} {getattr(args, flag)}" for flag in ("dp", "tp", "pp", "ep") if getattr(args, flag) > 1)


def require_launcher(args):
    """Raise ``ConfigError`` naming the parallel flags unless this process is a rank started by msrun: without
    it MindSpore's ``init()`` fails with a traceback and a C++ stack (msrun sets ``MS_WORKER_NUM`` in every
    worker's environment)."""
    ranks = ranks_needed(args)
    if ranks == 1 or os.environ.get("MS_WORKER_NUM"):
        return
    raise ConfigError(parallel_flags(args), f"runs {ranks} ranks under msrun; launch it with: python -m "
                                            f"mindformers_ac.harness.launch --nproc {ranks} "
                                            f"$(which mindformers-ac) {' '.join(args.command_line)}")


def check_pipeline_flags(args):
    """``--pp`` / ``--microbatches``: two stages of the reference GPT, one per rank, nothing else combined."""
    from .pipeline import MAX_MICROBATCHES
    if args.microbatches > MAX_MICROBATCHES:
        raise ConfigError("--microbatches", f"expected at most {MAX_MICROBATCHES}, got {args.microbatches}")
    if args.pp == 1:
        if args.microbatches > 1:
            raise ConfigError("--microbatches", "needs --pp 2: microbatches in flight are a pipeline schedule")
        return
    if args.pp != 2:
        raise ConfigError("--pp", f"expected 1 or 2 (two stages of the reference GPT, one per rank), got {args.pp}")
    for flag, given in (("--model", args.model is not None), ("--tp", args.tp > 1), ("--ep", args.ep > 1),
                        ("--moe", bool(getattr(args, "moe", False)))):
        if given:
            raise ConfigError(flag, "can't be combined with --pp: the pipeline trains the reference GPT's two "
                                    "stages, one per rank")
    if args.layers is not None and args.layers < 2:
        raise ConfigError("--layers", f"--pp 2 cuts the reference GPT at half its layers: it needs at least 2, "
                                      f"got {args.layers}")


def check_data_parallel_flags(args):
    """``--dp N``: replicas of the reference GPT, alone, of a TP group (``--tp 2``) or of a pipeline (``--pp 2``)."""
    if args.dp == 1:
        return
    for flag, given in (("--model", args.model is not None), ("--ep", args.ep > 1),
                        ("--moe", bool(getattr(args, "moe", False)))):
        if given:
            raise ConfigError(flag, "can't be combined with --dp: data parallel trains replicas of the reference "
                                    "GPT (alone, with --tp or with --pp)")
    if args.tp > 1 and args.pp > 1:
        raise ConfigError("--dp", "combines with --tp or with --pp, not both")


def prepare_report_dir(path):
    """Create ``--report``'s directory (if missing) and check it can take report.json and memory.png.

    Raises ``ConfigError`` (field ``--report``) for a path that is an existing
    file, one that cannot be created, a directory that is not writable, or a
    report file name inside it taken by a directory.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("--report", f"{quote(path)} is an existing file; --report takes a directory, "
                                      f"where report.json and memory.png are written")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--report", f"cannot create the directory {quote(path)}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("--report", f"the directory {quote(path)} is not writable")
    for name in ("report.json", "memory.png"):
        check_output_file(os.path.join(path, name), "--report", "the report writes a file there")


def check_output_file(path, flag, purpose="it takes the path of a file to write"):
    """Raise ``ConfigError`` naming ``flag`` unless a file can be written at ``path``.

    Checked before the long part of a command (training, profiling), so that
    minutes of work are not lost to a typo: ``path`` must not be a directory,
    its directory must exist (nothing is created) and be writable, and an
    existing file there must be writable. ``purpose`` ends the message for a
    directory.
    """
    if os.path.isdir(path):
        raise ConfigError(flag, f"{quote(path)} is a directory; {purpose}")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConfigError(flag, f"the directory of {quote(path)}, {quote(parent)}, {what}; create it first or "
                                f"give another path")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(flag, f"the file {quote(path)} is not writable")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(flag, f"the directory {quote(parent)} is not writable")


def cmd_plan(args):
    from ..budget.sizes import parse_budget
    from ..budget.solver import plan_budget
    from .spec import profile_spec, spec_from_args
    from .user_model import describe_exception
    prefetch = args.prefetch
    if prefetch is None:   # CONFIG only lends its swap.default_prefetch; its other sections are replaced
        prefetch = AcConfig.from_yaml(args.config).swap.default_prefetch if args.config else 1
    parse_budget(args.budget, 1)   # a malformed --budget fails before minutes of profiling
    if args.microbatches > 1 and args.pp == 1:
        raise ConfigError("--microbatches", "needs --pp > 1: microbatches in flight are a pipeline schedule")
    if args.out:
        check_output_file(args.out, "--out", "--out takes the path of the YAML file to write")
    spec = spec_from_args(args)
    user = spec.user_model()
    try:   # a --model factory is checked when the profile builds it and on its very first step
        profile = profile_spec(spec, prefetch=prefetch, steps=args.profile_steps,
                               check_loss=user.check_loss_value if user else None)
    except ConfigError:
        raise
    except (Exception, SystemExit) as exc:   # the user's model failed in a step: one line, as train reports
        if user is None:
            raise
        raise RunFailed(f"profiling {spec.describe()} failed: {describe_exception(exc)}") from None
    if args.pp > 1:
        from ..planner.stages import plan_stages
        plan = plan_stages(profile, args.budget, args.pp, args.microbatches)
    else:
        plan = plan_budget(profile, parse_budget(args.budget, profile.baseline_peak))
    print(f"profiled {profile.description}")
    print(plan.report())
    if args.dp > 1:
        print(data_parallel_note(args.dp, spec))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(plan.to_yaml())
        print(f"wrote {args.out}")
    else:
        print(plan.to_yaml())
    return 0


def data_parallel_note(dp, spec):
    """``plan --dp N``: what the plan is per rank, and what data parallel divides."""
    batch = f"its own batch of {spec.batch} (a global batch of {dp} x {spec.batch})" if spec.factory is None \
        else f"its own batch (make_inputs), a 1/{dp} share of the global batch"
    return (f"data parallel {dp} (MindFormers' data_parallel): this plan is per rank, the same on all {dp} ranks. "
            f"Each rank keeps the activations of {batch}, so activations don't shrink with data parallel and "
            f"the budget is a budget per rank. What data parallel divides is the data (each rank computes 1/{dp} "
            f"of the global batch); the weights, gradients and optimizer states are replicated on every rank "
            f"(not part of this activation budget). To cut a rank's activations, shrink its batch (--batch) or "
            f"split the model: --tp (model_parallel) divides a layer's activations, --pp (pipeline_stage) its "
            f"layers.")


def add_pipeline_arguments(parser, pp_help, microbatches_help=None, pp_type=None):
    """``--pp`` (and, with ``microbatches_help``, ``--microbatches``): one declaration for every subcommand."""
    from .spec import positive_int
    parser.add_argument("--pp", type=pp_type or positive_int, default=1, metavar="P", help=pp_help)
    if microbatches_help is not None:
        parser.add_argument("--microbatches", type=positive_int, default=1, metavar="M", help=microbatches_help)


def build_parser():
    from .moe import add_moe_arguments
    from .spec import add_layer_list_argument, add_model_arguments, ascii_int, positive_int
    parser = argparse.ArgumentParser(prog="mindformers-ac", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (the reference GPT or --model) without and with a "
                                         "config, compare")
    train.add_argument("config", nargs="?", default=None,
                       help="YAML config (default: the shipped default config, a mix of recompute and swap; "
                            "required with --model)")
    train.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                       help=MODEL_HELP + "; default: the reference GPT built from --layers/--hidden/...")
    train.add_argument("--steps", type=positive_int, default=20, help="training steps of each run (default 20)")
    add_model_arguments(train, with_model=True)
    train.add_argument("--tp", type=positive_int, default=1,
                       help="tensor-parallel size (default 1); > 1 must run under msrun with that many workers "
                            "(see docs/distributed.md and `python -m mindformers_ac.harness.launch`)")
    add_pipeline_arguments(train, "pipeline stages (default 1); 2 cuts the reference GPT at half its layers, one "
                                  "stage per rank, under msrun with 2 workers",
                           "with --pp 2: microbatches per step, all forwarded before their backwards (GPipe "
                           "order; default 1)")
    train.add_argument("--dp", type=positive_int, default=1,
                       help="data-parallel replicas (default 1; MindFormers' data_parallel): each trains on its own "
                            "batches, gradients averaged with nn.DistributedGradReducer; alone or with --tp / --pp, "
                            "under msrun with dp x tp (or dp x pp) workers")
    train.add_argument("--ep", type=positive_int, default=1,
                       help="expert-parallel size (default 1; with --moe); > 1 must run under msrun with that "
                            "many workers")
    add_moe_arguments(train)
    train.add_argument("--budget", default=None, metavar="SIZE",
                       help="train with a memory budget instead of per-layer lists (memory_budget.activations): "
                            "the first steps measure the options, then the cheapest plan that fits runs; a "
                            "fraction of the peak without AC (0.5x) or a size (96MiB); CONFIG's settings and "
                            "memory_budget section apply (default: none, CONFIG's layer lists)")
    train.add_argument("--report", default=None, metavar="DIR",
                       help="write report.json and memory.png into this directory, created if missing "
                            "(default: no report files)")
    train.set_defaults(func=cmd_train, times_steps=True)
    validate = sub.add_parser("validate", help="check a YAML config")
    validate.add_argument("config", help="YAML config to check (required)")
    validate.add_argument("--num-layers", type=ascii_int, default=None, metavar="N",
                          help="check the layer ids against a model of N layers (default: not checked, only "
                               "the structure and the pp rule)")
    add_pipeline_arguments(validate, "pipeline-parallel size the config is checked for (default 1)", pp_type=ascii_int)
    validate.set_defaults(func=cmd_validate)
    explain = sub.add_parser("explain", help="print the plan a config gives on a model")
    explain.add_argument("config", nargs="?", default=None,
                         help="YAML config (default: the shipped default config)")
    explain.add_argument("--model", default=DEFAULT_MODEL, metavar="MODULE:FUNCTION",
                         help=f"{MODEL_HELP} (default {DEFAULT_MODEL})")
    add_layer_list_argument(explain)
    add_pipeline_arguments(explain, "pipeline-parallel size to plan for (default 1)")
    explain.add_argument("--step", action="store_true",
                         help="apply the plan and run one training step first: its notes then say what only a "
                              "step tells (an op target that saves nothing is taken off); default: plan only")
    explain.set_defaults(func=cmd_explain)
    plan = sub.add_parser("plan", help="profile a model (the reference GPT or --model), choose recompute/swap "
                                       "per layer for a memory budget, write the YAML")
    plan.add_argument("config", nargs="?", default=None,
                      help="YAML config whose swap.default_prefetch to plan with, its other sections ignored "
                           "(default: none, prefetch 1)")
    plan.add_argument("--budget", required=True, metavar="SIZE",
                      help="required: peak activation memory, as a fraction of the baseline's peak (0.4x) or a "
                           "size of at least 1 KiB (3GiB, 512MiB, bytes)")
    plan.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                      help=MODEL_HELP + "; default: the reference GPT built from --layers/--hidden/...")
    add_model_arguments(plan, with_model=True)
    add_moe_arguments(plan)
    plan.add_argument("--prefetch", type=int, default=None,
                      help="swap.default_prefetch (default: CONFIG's, else 1)")
    add_pipeline_arguments(plan, "pipeline stages (default 1); > 1 plans each stage of contiguous layers for the "
                                 "budget, with its microbatches in flight",
                           "with --pp > 1: microbatches per step; in GPipe order every stage holds all M at its "
                           "peak (default 1)")
    plan.add_argument("--dp", type=positive_int, default=1,
                      help="data-parallel ranks (MindFormers' data_parallel; default 1): the plan is per rank, each "
                           "rank holding the activations of its own batch (--batch)")
    plan.add_argument("--profile-steps", type=positive_int, default=12,
                      help="timed steps per option (default 12)")
    plan.add_argument("--out", default=None, metavar="PATH", help="write the YAML here (default: print it)")
    plan.set_defaults(func=cmd_plan, times_steps=True)
    return parser


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) raised in the main thread: unwinds like Ctrl-C, so that ``finally`` blocks and
    context managers (a worker process stopped, a temporary directory removed) run before the exit.
    A BaseException, as KeyboardInterrupt is: ``except Exception`` handlers must not swallow it."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_unwind():
    """SIGINT and SIGTERM raise ``Interrupted`` while the command runs; the previous handlers come back
    after (``main`` is also called in-process, by tests)."""
    if threading.current_thread() is not threading.main_thread():   # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv=None):
    args = build_parser().parse_args(argv)   # --help and usage errors exit here, before any MindSpore setting
    args.command_line = list(sys.argv[1:] if argv is None else argv)   # as typed: error messages repeat it
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        with _signals_unwind():
            # Process-wide settings belong to the entry point, not to the functions it calls. The commands
            # that time steps run synchronous PyNative: asynchronous step times on CPU are bimodal (useless
            # for train's and plan's figures). validate and explain leave MindSpore alone (and stderr quiet).
            if getattr(args, "times_steps", False):
                from ..mindspore_compat import synchronous_pynative
                synchronous_pynative()
            return args.func(args)
    except (ConfigError, RunFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"\ninterrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
