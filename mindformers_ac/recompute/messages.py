"""The texts of what the recompute engine finds while it runs (in forward and backward), written once.

Both ways into a region report the same failure with the same words (a bad argument of ``checkpoint`` is not here:
``api`` raises it at the call). Each function returns the exception to raise; the upper-case constants are warnings
logged once. A message says what differed between the forward and its recompute, and what to change in the region;
tests and users match on these texts, so a change of wording is a change of interface.
"""
from ..errors import RecomputeError

# Why a recompute must repeat its forward; appended to every "diverged" message about the ops run.
SAME_PATH = ("A checkpointed region must run the same ops when run again (no branching on global state or "
             "step counters). Under is_in_recompute() it may skip one-shot side effects (a tracker update, a "
             "counter, a host copy) that leave nothing for backward, but never run other or extra ops.")
_SAME_SHAPES = ("The region must compute the same shapes and dtypes when run again (no dependence on state "
                "that changed since the forward; a tensor read from outside the region's arguments must be "
                "passed as an argument).")
_DIVERGED = "mindformers_ac: recompute diverged from forward"


def _diverged(region, what, why=SAME_PATH):
    """``mindformers_ac: recompute diverged from forward in the recomputed region 'x': {what} {why}``."""
    return RecomputeError(f"{_DIVERGED}{of_region(region)}: {what} {why}")


def in_path(path):
    """`` (in 'cell.path')``, or nothing at the region root."""
    return f" (in {path!r})" if path else ""


def of_region(region):
    """`` in the recomputed region 'layers.1'``: where it happened (the region's cell path, or its class)."""
    return f" in the recomputed region {region!r}" if region else ""


def describe_op(op_names, op_paths, idx):
    """``MatMulExt (in 'mlp')`` for op ``idx`` of a forward that ran ``op_names``; ``op_paths``: index -> path."""
    if idx >= len(op_names):
        return "<end of region>"
    return op_names[idx] + in_path(op_paths.get(idx, ""))


def describe_meta(meta):
    """``(2, 8, 32) Float32`` for a saved tensor's ``(shape, dtype)``; ``not saved`` for None."""
    return f"{tuple(meta[0])} {meta[1]}" if meta is not None else "not saved"


# Added to a "diverged" message when the two runs differ by an inserted Cast.
_CAST_HINT = (" The runs differ by a Cast: the region's forward and recompute ran under different mixed-precision "
              "types. The recompute uses the region cell's own type (set by to_float / amp O2/O3 on every cell); a "
              "type set on an enclosing cell only is not seen: call to_float on the region's cell as well.")


# -- a recompute that took another code path -----------------------------------------------------

def other_op(idx, forward_desc, forward_name, name, path, region):
    """The recompute's op ``idx`` is not the forward's."""
    return RecomputeError(f"{_DIVERGED} at op #{idx}: forward ran {forward_desc}, recompute runs {name}{in_path(path)}"
                          f"{of_region(region)}. {SAME_PATH}{_CAST_HINT if 'Cast' in (forward_name, name) else ''}")


def missing_ops(idx, n, first_missing, region):
    """The recompute skipped op ``idx`` of the forward's ``n``, which left something for backward."""
    return _diverged(region, f"it did not run op #{idx} {first_missing} of the forward's {n}, which saved tensors "
                     "for backward or kept its output (only ops that leave nothing for backward may be skipped).")


def written_after_forward(what, shape, dtype, region):
    """A tensor the region's re-run or backward reads was written in place after the region's forward."""
    return RecomputeError(
        f"mindformers_ac: {what} of the recomputed region {region} ({shape} {dtype}) was modified by an "
        "in-place operation after the region's forward; its recompute would read the new values. MindSpore "
        "refuses the same without AC when an op saved the tensor ('One of the Tensor needed for gradient "
        "computation has been modified by an inplace operation'). Write into a copy instead "
        "(x = x * 1 before the write), or leave this layer out of recompute.")


def parameter_replaced(region, name):
    """A region's forward replaced one of its Parameters by a new object."""
    return RecomputeError(
        f"mindformers_ac: the recomputed region {region!r} replaced its Parameter {name!r} by a new Parameter "
        "object in its forward (self.x = Parameter(...)); its re-run would read the new value, not the one the "
        "forward read, so this is refused before any gradient. Give the Parameter its new value in place "
        "instead (self.x.set_data(v), self.x.assign_value(v) or ops.assign(self.x, v): the engine then "
        "restores the old value for the re-run), or leave this cell out of recompute.")


def skipped_op_needed(idx, desc, region):
    """Backward reached an op that the re-run skipped under the marker."""
    return _diverged(region, f"its re-run skipped op #{idx} {desc} under is_in_recompute(), but the backward needs "
                     "what that op saved: a skipped side effect must not feed the loss.", "Run the op in the re-run "
                     "too, or detach its result (ops.stop_gradient) before keeping it.")


def no_metadata(key):
    """A re-run asked for replay metadata its forward did not save."""
    return RecomputeError(
        f"mindformers_ac: get_recompute_metadata({key!r}) in a recompute found nothing: the region's forward "
        "saved no (more) value under this key with save_for_recompute. Use the same key and call order in "
        "the forward and the re-run.")


def save_count_at_op(idx, desc, fwd, rec, region):
    """Op ``idx`` saved another number of tensors than in forward (the intercepting path knows the op)."""
    return RecomputeError(
        f"{_DIVERGED} at op #{idx} {desc}{of_region(region)}: it saved {fwd} tensor(s) for backward in forward but "
        f"{rec} in the recompute, so its dropped tensors can't be matched. An op saves different tensors when autograd "
        "tracks different inputs: e.g. a tensor the region reads from outside its arguments (a closure or an "
        "attribute set by the caller) that requires grad in only one of the runs; pass it as an argument of "
        "the region.")


def save_count(rec, fwd, first_unmatched, region):
    """The recompute saved another number of tensors than the forward (the light path counts saves only)."""
    return _diverged(region, f"it saved {rec} tensor(s) for backward, the forward {fwd}; the first unmatched one is "
                     f"{first_unmatched}.", f"{SAME_PATH} It must read tensors only from its arguments.")


def check_saves(got, expected, where, region):
    """Raise at the first re-run save whose ``(shape, dtype)`` in ``got`` is not the forward's in ``expected`` (None
    there: not compared, a weight), or when the counts differ; ``where(i)`` names save ``i``. The one check of a
    re-run that is matched to its forward by position (the light path, an op's output recompute)."""
    i = next((j for j, (g, e) in enumerate(zip(got, expected)) if e is not None and g != e), None)
    if i is not None:
        raise other_tensor(where(i), expected[i], got[i], region)
    if len(got) != len(expected):
        raise save_count(len(got), len(expected), where(min(len(got), len(expected))), region)


def other_tensor(where, fwd_meta, rec_meta, region):
    """A saved tensor (or a Dropout input) ``where`` had another shape or dtype in the recompute."""
    return RecomputeError(
        f"{_DIVERGED} at {where}{of_region(region)}: it was {describe_meta(fwd_meta)} in forward but "
        f"{describe_meta(rec_meta)} in the recompute. {_SAME_SHAPES}")


def other_values(region, op):
    """The safety net's sampled elements of ``op``'s tensor differ bitwise between the forward and its re-run."""
    return RecomputeError(
        f"{_DIVERGED} in {region!r}: the recompute computed another output than the forward at {op} (sampled "
        "elements differ bitwise), so the gradients would be wrong; no gradient left the region. Something the "
        "region reads changed between its forward and its re-run: an op whose result depends on Python state "
        "(a counter, a flag, a global, a host-side random draw), a tensor read from outside its arguments, or "
        "a random op the engine does not know. Pass such values as arguments, hand the forward's value to "
        f"the re-run with save_for_recompute, or keep the op with exclude_op / a policy. {SAME_PATH}")


def dropout_calls(rec, fwd, region):
    """The recompute called ``nn.Dropout`` another number of times than the forward."""
    return _diverged(region, f"it called nn.Dropout {rec} time(s), the forward {fwd}.")


def kept_calls(rec, fwd, where, region):
    """The recompute reached the ops exclude_op keeps another number of times than the forward."""
    return _diverged(region, f"the forward made {fwd} call(s) of ops exclude_op keeps, its recompute {rec} "
                     f"(at {where}).")


def other_kept_call(i, fwd_where, fwd_meta, where, got, region):
    """Kept call ``i`` of the recompute is not the forward's (another site, or inputs of other shapes)."""
    fwd_args, args = (", ".join(map(describe_meta, metas)) or "no tensor" for metas in (fwd_meta, got))
    return RecomputeError(f"{_DIVERGED} at kept call #{i}: forward called {fwd_where} on {fwd_args}, recompute calls "
                          f"{where} on {args}{of_region(region)}. {_SAME_SHAPES}")


def nested_regions(fwd, region):
    """The recompute met more nested regions than the forward did."""
    return _diverged(region, f"it called more nested checkpoints in its recompute than in its forward ({fwd}).")


def read_before_kept_write(idx, name, path, writer_idx, writer_desc, region):
    """A re-run op reads a tensor that a later op writes, and that writer's output was kept (no copy)."""
    return RecomputeError(
        f"mindformers_ac: op #{idx} {name}{in_path(path)}{of_region(region)} reads a tensor that op "
        f"#{writer_idx} {writer_desc} writes later in the region; that op's output is kept instead of a copy of "
        "what it writes (too large to copy), so the recompute can't see the value the forward read. Keep "
        f"{name}'s output too (exclude_op) or move the write out of the recomputed region.")


def group_not_chained(layer_ids, index, reason):
    """A layer group's member ``index`` did not receive the previous member's output first."""
    ids = ", ".join(map(str, layer_ids))
    return RecomputeError(
        f"mindformers_ac: recompute.group_layers: layer {layer_ids[index]} of the group of layers {ids} {reason}; "
        f"a group rebuilds each member's first argument from the previous member's output, so its layers must "
        f"be called in order, each on the previous one's output (x = layer(x, ...)). Use group_layers: 1 for "
        f"this model.")


# -- the engine used the wrong way ---------------------------------------------------------------

def already_used(what, region):
    """A recomputed tensor (``what``: which one) was asked for a second time."""
    return RecomputeError(
        f"mindformers_ac: {what}{of_region(region) or ' of a checkpointed region'} was already used: its recompute "
        "regenerated it once and an earlier backward took it. Was the graph backpropagated twice? Run backward once "
        "per forward.")


def recompute_reentered(region):
    return RecomputeError(f"mindformers_ac: the recompute{of_region(region)} asked for its own saved tensors")


def stack_corrupted():
    return RecomputeError("mindformers_ac: region stack corrupted (a region exited out of order)")


def bad_policy(policy, op_path):
    return TypeError(f"policy_fn must return a CheckpointPolicy, got {policy!r} for op {op_path}")


# -- warnings (logged once per key) ---------------------------------------------------------------

SWAP_INPUTS_WITHOUT_EXECUTOR = ("checkpoint(swap_inputs=True) without a swap_executor: the region's inputs "
                                "stay on the device (pass swap_executor= to offload them)")
MUST_SWAP_WITHOUT_EXECUTOR = ("policy_fn returned MUST_SWAP but checkpoint() got no swap_executor: saving "
                              "those ops instead (pass swap_executor= to offload)")
KEEP_SIDE_EFFECT = ("%s writes parameters larger than its other inputs: its output is kept instead of copying "
                    "them for the recompute")
DROPOUT_NOT_REBUILT = ("Dropout output can't be rebuilt bitwise from its mask for %s; keeping Dropout outputs "
                       "instead (more memory, still exact)")
KEPT_OVER = ("recompute of %s keeps %d bytes more than the model keeps without AC: ops its policy keeps "
             "(MUST_SAVE, exclude_op) whose outputs no backward reads are kept as asked, not re-run "
             "(RecomputeStats.kept_over_bytes); a policy that returns PREFER_SAVE lets the engine re-run them "
             "instead")
LIGHT_REWRITE = ("a recomputed region wrote one of its non-trainable Parameters in a re-run, which its first "
                 "(checked) call did not do (a write only some inputs trigger); the write was undone, so it "
                 "lands once per step, and the region's calls with this signature are checked again")
OUTPUT_NOTHING_DROPPED = ("output recompute of %s saves nothing: it saves nothing for backward but its inputs, and "
                          "no op in its layer saved its output tensor (a consumer that saves a view or a copy, e.g. "
                          "of a non-contiguous output, keeps it), so it runs as without recompute: return a "
                          "contiguous tensor from the op or recompute its enclosing module instead")
OUTPUT_KEPT_ELSEWHERE = ("output recompute of %s saves nothing: what it and its consumers saved for backward is kept "
                         "anyway by other ops of its layer (saved as it is, or as a view); it runs as without "
                         "recompute. Recompute its enclosing module instead")
OUTPUT_INPUTS_COST = ("output recompute of %s saves nothing: running it again needs its inputs (%d bytes that no "
                      "other op of its layer keeps), and dropping what it and its consumers saved frees only %d "
                      "bytes; it runs as without recompute. Recompute its enclosing module instead")
OUTPUT_RANDOM_OPS = ("output recompute of %s skipped: it runs random op(s) %s, whose output can't be reproduced; "
                     "its output is kept")
OUTPUT_SIDE_EFFECT_OPS = ("output recompute of %s skipped: it runs op(s) %s that write parameters (e.g. BatchNorm's "
                          "moving statistics), which running it again would update twice; its output is kept "
                          "(recompute its enclosing module instead, which re-runs it on copies)")
OUTPUT_RANDOM_OP = "output recompute of %s skipped: %s is random; its output is kept"
