"""Is training with AC bitwise the same as without? Loss, every gradient and every parameter, step by step.

``train`` records digests of one run (``record_initial_state`` before the
first step, ``record_step`` after each): the loss, each gradient and each
parameter of ``model.parameters_and_names()`` after the update, trainable or
not (BatchNorm moving statistics, counters a forward writes with
``ops.assign_add``). ``first_difference`` compares two records in the order
things happen: the parameters as built, then per step the loss, the
gradients, the parameters.

A model may not be reproducible by itself: MindSpore's CPU ``Dropout`` kernel
draws different masks in two processes from its 6th call on, and a factory
may seed nothing. So ``judge`` tells the cases apart with a second run
without AC, made only when the run with AC differs:

* ``equal``: every digest equal;
* ``ac``: the runs without AC agree up to (and past) the point where the run
  with AC first differs, so AC caused the difference;
* ``model``: the runs without AC already differ there or earlier: the
  model's own nondeterminism, AC is not blamed;
* ``unchecked``: the run with AC differs and no second run without AC could
  be made (tensor parallel under msrun, where every rank must take the same
  path).

This is harness code: the library never imports it.
"""
import hashlib

# The order in which the parts of a run are produced: a difference earlier in this order (in the same
# step) can have caused a later one, not the other way round.
KINDS = ("parameter set", "initial parameters", "loss", "gradient", "parameter")


def tensor_digest(tensor):
    """Digest of a tensor's dtype, shape and bytes (equal digests: bitwise equal tensors)."""
    array = tensor.asnumpy()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{array.dtype}{array.shape}".encode())
    h.update(array.tobytes())
    return h.hexdigest()


def record_initial_state(record, model, grad_names):
    """Start ``record`` (a dict) with the model's parameter names and digests as built."""
    params = list(model.parameters_and_names())
    record["param_names"] = [name for name, _ in params]
    record["grad_names"] = list(grad_names)
    record["initial_param_digests"] = [tensor_digest(p) for _, p in params]
    record.setdefault("loss_digests", [])
    record.setdefault("grad_digests", [])
    record.setdefault("param_digests", [])


def record_step(record, model, loss, grads):
    """Append one step's loss, gradient and (updated) parameter digests to ``record``."""
    record["loss_digests"].append(tensor_digest(loss))
    record["grad_digests"].append([tensor_digest(g) for g in grads])
    record["param_digests"].append([tensor_digest(p) for _, p in model.parameters_and_names()])


def _difference(step, kind, name=None):
    return {"step": step, "what": kind, "name": name}


def _first_index(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def first_difference(a, b):
    """Where records ``a`` and ``b`` first differ: ``{"step", "what", "name"}``, or None when equal.

    ``step`` counts from 1 (0: before the first step); ``what`` is one of
    ``KINDS``; ``name`` the parameter (or gradient's parameter), else None.
    Runs of different length are compared over the shorter one, then the
    extra steps count as a difference in the first step one run lacks.
    """
    if a["param_names"] != b["param_names"]:
        only = sorted(set(a["param_names"]) ^ set(b["param_names"]))
        return _difference(0, "parameter set", only[0] if only else None)
    i = _first_index(a["initial_param_digests"], b["initial_param_digests"])
    if i is not None:
        return _difference(0, "initial parameters", a["param_names"][i])
    steps = zip(a["loss_digests"], b["loss_digests"], a["grad_digests"], b["grad_digests"],
                a["param_digests"], b["param_digests"])
    for step, (loss_a, loss_b, grads_a, grads_b, params_a, params_b) in enumerate(steps, start=1):
        if loss_a != loss_b:
            return _difference(step, "loss")
        i = _first_index(grads_a, grads_b)
        if i is not None or len(grads_a) != len(grads_b):
            names = a["grad_names"]
            return _difference(step, "gradient", names[i] if i is not None and i < len(names) else None)
        i = _first_index(params_a, params_b)
        if i is not None:
            return _difference(step, "parameter", a["param_names"][i])
    if len(a["loss_digests"]) != len(b["loss_digests"]):
        return _difference(min(len(a["loss_digests"]), len(b["loss_digests"])) + 1, "loss")
    return None


def _position(difference):
    return difference["step"], KINDS.index(difference["what"])


def judge(baseline, ac, rerun_baseline=None):
    """Compare the run with AC to the run without; returns ``(summary, second_baseline)``.

    ``rerun_baseline()`` makes a second run without AC; it is called only when
    the two runs differ (None: no second run is possible). ``summary`` holds
    ``verdict`` (``equal``/``ac``/``model``/``unchecked``, see the module
    docstring), ``first_difference`` (with AC against without),
    ``model_difference`` (the two runs without AC; None when they agree or
    were not compared), and the per-part flags ``losses_match_bitwise``,
    ``grads_match_bitwise``, ``params_match_bitwise``.
    ``second_baseline`` is the second run's record, or None.
    """
    summary = {
        "losses_match_bitwise": baseline["loss_digests"] == ac["loss_digests"],
        "grads_match_bitwise": baseline["grad_digests"] == ac["grad_digests"],
        "params_match_bitwise": (baseline["param_names"] == ac["param_names"]
                                 and baseline["initial_param_digests"] == ac["initial_param_digests"]
                                 and baseline["param_digests"] == ac["param_digests"]),
        "first_difference": first_difference(baseline, ac),
        "model_difference": None,
        "baseline_rerun": False,
    }
    if summary["first_difference"] is None:
        return {**summary, "verdict": "equal"}, None
    if rerun_baseline is None:
        return {**summary, "verdict": "unchecked"}, None
    again = rerun_baseline()
    model_difference = first_difference(baseline, again)
    summary.update(model_difference=model_difference, baseline_rerun=True)
    if model_difference is None or _position(summary["first_difference"]) < _position(model_difference):
        return {**summary, "verdict": "ac"}, again
    return {**summary, "verdict": "model"}, again


def describe_difference(difference):
    """A difference as words: ``the gradient of 'w' in step 3``."""
    step, what, name = difference["step"], difference["what"], difference["name"]
    if what == "parameter set":
        return f"the set of parameters ({name!r} is in one run only)"
    if what == "initial parameters":
        return f"parameter {name!r} as built, before step 1"
    if what == "loss":
        return f"the loss of step {step}"
    if what == "gradient":
        return f"the gradient of {name!r} in step {step}" if name else f"the gradients of step {step}"
    return f"parameter {name!r} after step {step}"


def verdict_line(summary):
    """The one line ``train`` prints about exactness (``summary`` from ``judge``)."""
    head = "losses, gradients and all parameters bitwise equal in every step: "
    verdict = summary["verdict"]
    if verdict == "equal":
        return head + "yes"
    ac_where = describe_difference(summary["first_difference"])
    if verdict == "ac":
        return head + (f"NO: with AC the run first differs in {ac_where}, where two runs without AC "
                       f"agree, so AC caused it")
    if verdict == "unchecked":
        return head + (f"NO: with AC the run first differs in {ac_where} (no second run without AC was made "
                       f"to rule out the model's own nondeterminism)")
    model_where = describe_difference(summary["model_difference"])
    hint = (" (the factory builds different weights in each process: seed it, e.g. ms.set_seed and "
            "np.random.seed at its start)" if summary["model_difference"]["what"] == "initial parameters" else "")
    return head + (f"undecided: the model is not reproducible by itself: two runs without AC already differ in "
                   f"{model_where}{hint}; with AC the run matched the run without AC up to there, so AC is not "
                   f"the cause")
