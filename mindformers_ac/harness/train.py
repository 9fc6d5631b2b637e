"""``mindformers-ac train``: a model trained twice, without and with AC, side by side.

The model is the reference GPT on synthetic tokens, or the user's
(``--model MODULE:FUNCTION``, see ``user_model``). Each run happens in a fresh
subprocess (same weights, same inputs), so the process peak RSS (VmHWM) of
each is a clean sanity figure beside the saved-tensor accounting. The parent
checks the config against the model before starting anything, then compares
the two runs: per step the loss, every gradient and every parameter bitwise
(``exactness``; a third run without AC when they differ tells AC from the
model's own nondeterminism), activation memory per layer
(``accounting.StepMeter``) and median step time.
"""
import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError, quote
from .models import GPTConfig, SyntheticBatches

from ..tensors import MiB


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
                f"seq {g.seq_length}, batch {self.batch}")


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
    with ``--model`` (the factory builds the model), and for ``--layer-list``
    without ``--model`` (the reference GPT's layer list is known).
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
    if hasattr(args, "moe"):   # a command with the MoE flags (moe.add_moe_arguments)
        if factory is not None and args.moe:
            raise ConfigError("--moe", f"builds the reference MoE GPT; with --model {factory} the factory builds "
                                       f"the model")
        fields.setdefault("moe", moe_from_args(args, gpt, fields.get("ep", 1)))
    return TrainSpec(gpt=gpt, batch=values["batch"], seed=values["seed"], factory=factory, layer_list=layer_list,
                     data_flags=tuple(f for f in DATA_FLAGS if f in given) if factory else (), **fields)


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


class Progress:
    """One status line per run on stderr: rewritten in place on a terminal, every few steps otherwise."""

    def __init__(self, label, total, stream=sys.stderr):
        self.label, self.total, self.stream = label, total, stream
        self.tty = stream.isatty()

    def update(self, step, loss, seconds, act_bytes):
        done = step + 1
        width = 20
        bar = "#" * (width * done // self.total) + "-" * (width - width * done // self.total)
        line = (f"[{self.label:>8}] {done:>3}/{self.total} [{bar}] loss {loss:.4f}  "
                f"{seconds * 1000:6.1f} ms/step  act {act_bytes / MiB:7.2f} MiB")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done == self.total else ""))
        elif done == self.total or done == 1 or done % max(1, self.total // 4) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()


def _collectives(model, state):
    """Collectives run this step: forward / backward calls per primitive, and re-runs in backward
    counted by the recompute engine (an op it re-runs really communicates again)."""
    from .tp import collective_counts
    counts = collective_counts(model)
    rerun = {}
    for stats in state.recompute_stats.values() if state is not None else ():
        for name, n in stats.rerun_by_op.items():
            if any(c in name.lower() for c in ("allgather", "all_gather", "allreduce", "all_reduce",
                                                "reduce_scatter", "reducescatter", "alltoall")):
                rerun[name] = rerun.get(name, 0) + n
    return {"forward": counts["per_collective"].get("forward", {}),
            "backward": counts["per_collective"].get("backward", {}),
            "rerun_in_backward": rerun}


class TrainingRun:
    """One model stepped with plain SGD and measured: what ``train`` and the planner's profile share.

    ``config`` (an ``AcConfig``, dict or YAML path) is applied with ``apply_ac``
    when given; ``plan`` is what it executed, else None. ``layers`` names the
    model's layer list when it is not found automatically (``find_layer_stack``).
    """

    def __init__(self, model, config=None, lr=0.05, layers=None):
        import mindspore as ms
        from mindspore import nn
        from ..accounting import StepMeter
        from ..apply import apply_ac
        self.model = model
        self.plan = apply_ac(model, config=config, layers=layers) if config else None
        self.optimizer = nn.SGD(model.trainable_params(), learning_rate=lr)
        self.grad_fn = ms.value_and_grad(model, None, self.optimizer.parameters)
        self.meter = StepMeter(model, layers)

    def step(self, inputs, sync_grads=None):
        """One training step on ``model(*inputs)``; returns ``(loss, grads, StepMemory, seconds)``.

        ``sync_grads(params, grads) -> grads`` runs before the update (tensor
        parallel: the partial gradients of replicated parameters); it is timed.
        """
        start = time.perf_counter()
        with self.meter.step() as memory:
            loss, grads = self.grad_fn(*inputs)
        if sync_grads is not None:
            grads = sync_grads(self.optimizer.parameters, grads)
        self.optimizer(grads)
        return loss, grads, memory, time.perf_counter() - start


class RunFailed(RuntimeError):
    """A training run (a worker process) failed after the config and model were checked."""


def run_variant(spec, config_path, label, rank=0, show_progress=True):
    """Train ``spec`` (with ``config_path`` applied, unless None) and return every figure as a dict.

    Besides the figures, the record holds the digests ``exactness.judge``
    compares: loss, every gradient and every parameter (trainable or not) after
    each step, and the parameters as built.
    """
    from ..apply import ac_state
    from .exactness import record_initial_state, record_step
    from .process_memory import reset_hwm, vm_hwm

    model, make_inputs = spec.build(rank)
    run = TrainingRun(model, config_path, spec.lr, layers=spec.layer_list)
    progress = Progress(label, spec.steps) if show_progress else None
    record = {"losses": [], "step_times": [], "memory": [], "collectives": []}
    record_initial_state(record, model, [p.name for p in run.optimizer.parameters])
    sync_grads = None
    parallel = spec.tp > 1 or spec.ep > 1
    if parallel:
        from .moe import sync_expert_parallel_grads
        from .tp import reset_comm_counters, sync_sequence_parallel_grads
        sync = sync_expert_parallel_grads if spec.ep > 1 else sync_sequence_parallel_grads
        sync_grads = functools.partial(sync, model)
    reset_hwm()
    for step in range(spec.steps):
        inputs = make_inputs(step)
        if parallel:
            reset_comm_counters(model)
        loss, grads, memory, seconds = run.step(inputs, sync_grads)
        if parallel:
            record["collectives"].append(_collectives(model, ac_state(model)))
        record["losses"].append(float(loss.asnumpy()))
        record_step(record, model, loss, grads)
        record["step_times"].append(seconds)
        record["memory"].append(memory.as_dict())
        if progress is not None:
            progress.update(step, record["losses"][-1], seconds, memory.kept_bytes)
    record["vm_hwm_bytes"] = vm_hwm()
    record["plan"] = {str(i): lp.describe() for i, lp in run.plan.layers.items()} if run.plan else {}
    return record


def _run_in_subprocess(spec, config_path, label, workdir):
    """``run_variant`` in a fresh process (progress on this stderr); raises ``RunFailed`` with its error.

    Whatever interrupts the wait (KeyboardInterrupt, the ``Interrupted`` that
    ``cli`` raises for SIGTERM) stops the worker before it propagates: no
    training process outlives ``train``.
    """
    out = os.path.join(workdir, f"{label.replace(' ', '_')}.json")
    cmd = [sys.executable, "-m", "mindformers_ac.harness.train", "--worker", json.dumps(dataclasses.asdict(spec)),
           config_path or "", label, out]
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=None) as proc:
        try:
            returncode = proc.wait()
        except BaseException:
            _stop(proc)
            raise
    if returncode != 0 or not os.path.exists(out):
        error = _read_text(out + ".error") or "see its output above"
        raise RunFailed(f"the {label} training run failed (exit {returncode}): {error}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def _stop(proc, grace_s=5.0):
    """Terminate ``proc`` (SIGTERM), then kill it if it is still there after ``grace_s``; wait for it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def _peak_step(record):
    return max(record["memory"], key=lambda m: m["kept_bytes"])


def compare(spec, config_path, baseline, ac, rerun_baseline=None):
    """Summary figures, the exactness verdict and a per-layer table (as dicts) of the two runs.

    ``rerun_baseline()`` makes a second run without AC; ``exactness.judge``
    calls it only when the run with AC differs, to tell AC from the model's own
    nondeterminism (its record is kept as ``baseline_again``).
    """
    from .exactness import judge
    base_mem, ac_mem = _peak_step(baseline), _peak_step(ac)
    warm = slice(min(2, spec.steps - 1), None)  # the first steps include kernel compilation
    base_time = statistics.median(baseline["step_times"][warm])
    ac_time = statistics.median(ac["step_times"][warm])
    layers = []
    for key, figures in ac_mem["layers"].items():
        layers.append({**figures, "layer": key, "applied": ac["plan"].get(key, []),
                       "baseline_kept_bytes": base_mem["layers"][key]["kept_bytes"]})
    exactness, again = judge(baseline, ac, rerun_baseline)
    result = {
        "spec": dataclasses.asdict(spec),
        "config": config_path,
        "summary": {
            "baseline_peak_activation_bytes": base_mem["kept_bytes"],
            "ac_peak_activation_bytes": ac_mem["kept_bytes"],
            "activation_saving_pct": 100.0 * (1 - ac_mem["kept_bytes"] / base_mem["kept_bytes"]),
            "offloaded_bytes": ac_mem["offloaded_bytes"],
            "recomputed_bytes": ac_mem["recomputed_bytes"],
            "baseline_step_time_s": base_time,
            "ac_step_time_s": ac_time,
            "step_time_ratio": ac_time / base_time,
            **exactness,
            "baseline_vm_hwm_bytes": baseline["vm_hwm_bytes"],
            "ac_vm_hwm_bytes": ac["vm_hwm_bytes"],
        },
        "layers": layers,
        "baseline": baseline,
        "ac": ac,
    }
    if again is not None:
        result["baseline_again"] = again
    return result


def exit_status(result):
    """``train``'s exit status: 0 bitwise equal, 1 AC changed the run (or not re-checked), 3 undecided
    because the model is not reproducible by itself."""
    return {"equal": 0, "model": 3}.get(result["summary"]["verdict"], 1)


def check_config(spec, config_path, rank=0):
    """Build the model ``spec`` describes and validate the config against it; returns the ``AcPlan``.

    For a ``--model`` factory the contract is checked too, one forward of
    ``make_inputs(0)`` included (its loss must be a scalar). Raises ``ConfigError``.
    """
    from ..plan import plan_ac
    model, make_inputs = spec.build(rank)
    if spec.factory is not None:
        spec.user_model().check_loss(model, make_inputs)
    return plan_ac(model, config=config_path, layers=spec.layer_list)


def train_and_compare(spec, config_path):
    """Both runs, each in a subprocess, and their comparison (a third run, without AC, if they differ)."""
    plan = check_config(spec, config_path)
    print(plan)
    with tempfile.TemporaryDirectory(prefix="mindformers-ac-") as workdir:
        baseline = _run_in_subprocess(spec, None, "baseline", workdir)
        ac = _run_in_subprocess(spec, config_path, "with AC", workdir)

        def rerun_baseline():
            print("the run with AC differs from the run without; running without AC again to tell AC from "
                  "the model's own nondeterminism", file=sys.stderr)
            return _run_in_subprocess(spec, None, "no AC #2", workdir)
        return compare(spec, config_path, baseline, ac, rerun_baseline)


def train_and_compare_tp(spec, config_path):
    """Under msrun: this rank trains its TP (or expert-parallel, ``spec.ep``) slice without and with AC,
    one run after the other.

    Both runs share the process (the communication group can be set up only
    once), so the per-run VmHWM figures are not independent; the saved-tensor
    accounting is. No second run without AC is made when they differ (each rank
    would decide alone, and collectives need every rank). Returns
    ``(rank, comparison)``; rank 0 prints.
    """
    from .tp import init_tp
    if spec.ep > 1:
        from .moe import check_ep_world
        check_ep_world(spec.ep, int(os.environ.get("MS_WORKER_NUM", "0")) or spec.ep)   # before init: exit 2
    rank, world = init_tp()
    if spec.ep > 1:
        check_ep_world(spec.ep, world)
    elif world != spec.tp:
        raise RuntimeError(f"--tp {spec.tp} but the job has {world} ranks: launch it with "
                           f"msrun --worker_num {spec.tp} --local_worker_num {spec.tp}")
    plan = check_config(spec, config_path, rank)
    if rank == 0:
        print(plan)
    baseline = run_variant(spec, None, "baseline", rank, show_progress=rank == 0)
    ac = run_variant(spec, config_path, "with AC", rank, show_progress=rank == 0)
    result = compare(spec, config_path, baseline, ac)
    result["summary"]["collectives_per_step"] = {"baseline": baseline["collectives"][-1],
                                                 "ac": ac["collectives"][-1]}
    return rank, result


def _worker(argv):
    """Run one variant and write its record to ``out``; on failure write the error, one line, to
    ``out.error`` (the parent shows it) and exit 1. A ``sys.exit`` in the user's code is such a failure
    (the parent would otherwise find no record); Ctrl-C, which reaches the worker too, ends it quietly
    with status 130 (the parent reports the interruption)."""
    from ..mindspore_compat import synchronous_pynative

    spec_json, config_path, label, out = argv
    synchronous_pynative()   # this process's entry point
    try:
        record = run_variant(TrainSpec.from_dict(json.loads(spec_json)), config_path or None, label)
    except (Exception, SystemExit) as exc:   # the parent reports it as an error, without a traceback
        from .user_model import describe_exception
        with open(out + ".error", "w", encoding="utf-8") as f:
            f.write(describe_exception(exc))
        sys.exit(1)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        try:
            _worker(sys.argv[2:])
        except KeyboardInterrupt:
            sys.exit(130)
    else:
        sys.exit("usage: python -m mindformers_ac.harness.train --worker SPEC_JSON CONFIG LABEL OUT "
                 "(internal; use `mindformers-ac train`)")
