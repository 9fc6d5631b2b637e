"""``mindformers-ac train``: the reference GPT trained twice, without and with AC, side by side.

Each run happens in a fresh subprocess (same seed, same synthetic tokens), so
the process peak RSS (VmHWM) of each is a clean sanity figure beside the
saved-tensor accounting. The parent checks the config against the model
before starting anything, then compares the two runs: per-step loss and every
gradient bitwise (SHA-1 of the bytes), activation memory per layer
(``accounting.StepMeter``) and median step time.
"""
import argparse
import dataclasses
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..tensors import MiB


@dataclass
class TrainSpec:
    """Model, data and schedule of one comparison; the same for both runs."""

    layers: int = 8
    hidden: int = 128
    heads: int = 4
    seq: int = 64
    batch: int = 4
    vocab: int = 256
    dropout: float = 0.1
    steps: int = 20
    seed: int = 0
    lr: float = 0.05
    tp: int = 1

    def build_model(self, rank=0):
        """The reference GPT, or this rank's tensor-parallel slice of it when ``tp > 1``."""
        dims = dict(num_layers=self.layers, hidden_size=self.hidden, num_heads=self.heads,
                    seq_length=self.seq, vocab_size=self.vocab, dropout=self.dropout, seed=self.seed)
        if self.tp == 1:
            from .models import build_gpt
            return build_gpt(**dims)
        from .tp import build_tp_gpt
        return build_tp_gpt(self.tp, rank, **dims)


def add_model_arguments(parser, **defaults):
    """Add ``--layers --hidden --heads --seq --batch --vocab --dropout --seed`` (the reference GPT
    and its synthetic data) to an argparse ``parser``; defaults are ``TrainSpec``'s unless given."""
    spec = dataclasses.replace(TrainSpec(), **defaults)
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
        parser.add_argument(f"--{name}", type=positive_int, default=getattr(spec, name))
    parser.add_argument("--dropout", type=_probability, default=spec.dropout)
    parser.add_argument("--seed", type=int, default=spec.seed)


def positive_int(text):
    """argparse type: an integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _probability(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a dropout probability in [0, 1), got {text}")
    return value


def _digest(tensors):
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.asnumpy().tobytes())
    return h.hexdigest()


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
    when given; ``plan`` is what it executed, else None.
    """

    def __init__(self, model, config=None, lr=0.05):
        import mindspore as ms
        from mindspore import nn
        from ..accounting import StepMeter
        from ..apply import apply_ac
        self.model = model
        self.plan = apply_ac(model, config=config) if config else None
        self.optimizer = nn.SGD(model.trainable_params(), learning_rate=lr)
        self.grad_fn = ms.value_and_grad(model, None, self.optimizer.parameters)
        self.meter = StepMeter(model)

    def step(self, tokens, labels, sync_grads=None):
        """One training step; returns ``(loss, grads, StepMemory, seconds)``.

        ``sync_grads(params, grads) -> grads`` runs before the update (tensor
        parallel: the partial gradients of replicated parameters); it is timed.
        """
        start = time.perf_counter()
        with self.meter.step() as memory:
            loss, grads = self.grad_fn(tokens, labels)
        if sync_grads is not None:
            grads = sync_grads(self.optimizer.parameters, grads)
        self.optimizer(grads)
        return loss, grads, memory, time.perf_counter() - start


def run_variant(spec, config_path, label, rank=0, show_progress=True):
    """Train ``spec`` (with ``config_path`` applied, unless None) and return every figure as a dict."""
    import mindspore as ms

    from ..apply import ac_state
    from .process_memory import reset_hwm, vm_hwm
    from .models import synthetic_batch

    ms.set_context(mode=ms.PYNATIVE_MODE, pynative_synchronize=True)
    model = spec.build_model(rank)
    run = TrainingRun(model, config_path, spec.lr)
    progress = Progress(label, spec.steps) if show_progress else None
    record = {"losses": [], "loss_digests": [], "grad_digests": [], "step_times": [], "memory": [],
              "collectives": []}
    sync_grads = None
    if spec.tp > 1:
        from .tp import reset_comm_counters, sync_sequence_parallel_grads
        sync_grads = functools.partial(sync_sequence_parallel_grads, model)
    reset_hwm()
    for step in range(spec.steps):
        tokens, labels = synthetic_batch(spec.batch, spec.seq, spec.vocab, seed=spec.seed + step)
        if spec.tp > 1:
            reset_comm_counters(model)
        loss, grads, memory, seconds = run.step(tokens, labels, sync_grads)
        if spec.tp > 1:
            record["collectives"].append(_collectives(model, ac_state(model)))
        record["losses"].append(float(loss.asnumpy()))
        record["loss_digests"].append(_digest([loss]))
        record["grad_digests"].append(_digest(grads))
        record["step_times"].append(seconds)
        record["memory"].append(memory.as_dict())
        if progress is not None:
            progress.update(step, record["losses"][-1], seconds, memory.kept_bytes)
    record["vm_hwm_bytes"] = vm_hwm()
    record["plan"] = {str(i): lp.describe() for i, lp in run.plan.layers.items()} if run.plan else {}
    return record


def _run_in_subprocess(spec, config_path, label, workdir):
    out = os.path.join(workdir, f"{label}.json")
    cmd = [sys.executable, "-m", "mindformers_ac.harness.train", "--worker", json.dumps(dataclasses.asdict(spec)),
           config_path or "", label, out]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=None, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {label} training run failed (exit {proc.returncode}); see its output above")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def _peak_step(record):
    return max(record["memory"], key=lambda m: m["kept_bytes"])


def compare(spec, config_path, baseline, ac):
    """The comparison both runs feed: summary figures and a per-layer table (as dicts)."""
    base_mem, ac_mem = _peak_step(baseline), _peak_step(ac)
    warm = slice(min(2, spec.steps - 1), None)  # the first steps include kernel compilation
    base_time = statistics.median(baseline["step_times"][warm])
    ac_time = statistics.median(ac["step_times"][warm])
    layers = []
    for key, figures in ac_mem["layers"].items():
        layers.append({**figures, "layer": key, "applied": ac["plan"].get(key, []),
                       "baseline_kept_bytes": base_mem["layers"][key]["kept_bytes"]})
    return {
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
            "losses_match_bitwise": baseline["loss_digests"] == ac["loss_digests"],
            "grads_match_bitwise": baseline["grad_digests"] == ac["grad_digests"],
            "baseline_vm_hwm_bytes": baseline["vm_hwm_bytes"],
            "ac_vm_hwm_bytes": ac["vm_hwm_bytes"],
        },
        "layers": layers,
        "baseline": baseline,
        "ac": ac,
    }


def check_config(spec, config_path, rank=0):
    """Validate the config against the model ``spec`` builds (raises ``ConfigError``)."""
    import mindspore as ms
    from ..plan import plan_ac
    ms.set_context(mode=ms.PYNATIVE_MODE)
    return plan_ac(spec.build_model(rank), config=config_path)


def train_and_compare(spec, config_path):
    """Both runs, each in a subprocess, and their comparison."""
    plan = check_config(spec, config_path)
    print(plan)
    with tempfile.TemporaryDirectory(prefix="mindformers-ac-") as workdir:
        baseline = _run_in_subprocess(spec, None, "baseline", workdir)
        ac = _run_in_subprocess(spec, config_path, "with AC", workdir)
    return compare(spec, config_path, baseline, ac)


def train_and_compare_tp(spec, config_path):
    """Under msrun: this rank trains its TP slice without and with AC, one run after the other.

    Both runs share the process (the communication group can be set up only
    once), so the per-run VmHWM figures are not independent; the saved-tensor
    accounting is. Returns ``(rank, comparison)``; rank 0 prints.
    """
    from .tp import init_tp
    rank, world = init_tp()
    if world != spec.tp:
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
    spec_json, config_path, label, out = argv
    record = run_variant(TrainSpec(**json.loads(spec_json)), config_path or None, label)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
    else:
        sys.exit("usage: python -m mindformers_ac.harness.train --worker SPEC_JSON CONFIG LABEL OUT "
                 "(internal; use `mindformers-ac train`)")
