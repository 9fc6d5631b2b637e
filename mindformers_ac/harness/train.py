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
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

from .spec import TrainSpec
from .variant import RunFailed, check_config, run_variant


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


def _first_planned_step(record):
    """The first step of the plan the run ends with: 0, or with ``memory_budget`` the first after profiling."""
    budget = record.get("budget")
    return budget["first_step"] if budget and budget["first_step"] is not None else 0


def _peak_step(record, first=0):
    return max(record["memory"][first:], key=lambda m: m["kept_bytes"])


def compare(spec, config_path, baseline, ac, rerun_baseline=None):
    """Summary figures, the exactness verdict and a per-layer table (as dicts) of the two runs.

    ``rerun_baseline()`` makes a second run without AC; ``exactness.judge``
    calls it only when the run with AC differs, to tell AC from the model's own
    nondeterminism (its record is kept as ``baseline_again``).
    """
    from .exactness import judge
    # with memory_budget the figures are the chosen plan's, from its first step on (both runs alike)
    first = _first_planned_step(ac)
    base_mem, ac_mem = _peak_step(baseline, first), _peak_step(ac, first)
    warm = slice(max(first, min(2, spec.steps - 1)), None)  # the first steps include kernel compilation
    base_time = statistics.median(baseline["step_times"][warm])
    ac_time = statistics.median(ac["step_times"][warm])
    layers = []
    for key, figures in ac_mem["layers"].items():
        # which recompute path the layer's calls took, over the whole run (the first call per signature
        # intercepts; a layer that never goes light pays the slower path every step)
        calls = {name: sum(step["layers"][key][name] for step in ac["memory"])
                 for name in ("light_calls", "intercepted_calls")}
        calls["intercept_reasons"] = sorted({r for step in ac["memory"]
                                             for r in step["layers"][key].get("intercept_reasons", {})})
        layers.append({**figures, **calls, "layer": key, "applied": ac["plan"].get(key, []),
                       "baseline_kept_bytes": base_mem["layers"][key]["kept_bytes"],
                       "baseline_kept_by_module": base_mem["layers"][key]["kept_by_module"]})
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
    if "budget" in ac:
        result["summary"]["memory_budget"] = {k: v for k, v in ac["budget"].items() if k not in ("events",)}
    return result


def exit_status(result):
    """``train``'s exit status: 0 bitwise equal, 1 AC changed the run (or not re-checked), 3 undecided
    because the model is not reproducible by itself."""
    return {"equal": 0, "model": 3}.get(result["summary"]["verdict"], 1)


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
