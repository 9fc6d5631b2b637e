"""Step time and kept activation bytes of the recompute engine against baseline and Cell.recompute().

    PYTHONPATH=. python scripts/bench_recompute.py [--shape small|mid] [--dropout 0] [--nn-dropout] [--steps 10]
    PYTHONPATH=. python scripts/bench_recompute.py --shape small --profile full

Rows: baseline, "baseline + 1 forward" (the floor for full recompute), MindSpore's Cell.recompute()
on each layer and on each layer's mlp (fresh models: it can't be undone), and the engine's full,
select mlp, select core_attention and full + exclude matmul; engine rows are also compared to the
built-in row of the same cells ("ref"). Kept bytes come from the engine's RecomputeStats for engine
rows and from SavedTensorMeter for the others (the engine's own hooks hide an outer meter inside its
regions, so for engine rows the meter is run too and the bytes outside the regions are added).
"""
import mindspore as ms

from bench_common import Row, parse_args, print_table, profile, run_interleaved
from mindformers_ac import recompute as rc
from mindformers_ac.harness.models import build_gpt, synthetic_batch, use_nn_dropout
from mindformers_ac.meter import SavedTensorMeter
from mindformers_ac.mindspore_compat import synchronous_pynative
from mindformers_ac.tensors import MiB


def case(a, name, setup, batch, ref=None, extra_forward=False):
    """A fresh model set up by ``setup(model) -> [RecomputeStats] | None``, as a Row."""
    model = build_gpt(a.gpt, seed=0)
    if a.nn_dropout:
        use_nn_dropout(model)
    stats = setup(model) or []
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, params)

    def step():
        if extra_forward:
            model(*batch)
        _, grads = grad_fn(*batch)
        grads[0].asnumpy()

    def kept_and_rerun():
        """Kept bytes of one step: meter outside the regions plus each region's own peak."""
        meter = SavedTensorMeter(params)
        for s in stats:
            s.reset()
        with meter.hooks():
            grad_fn(*batch)
        return {"kept MiB": f"{(meter.peak + sum(s.peak_kept_bytes for s in stats)) / MiB:.2f}",
                "ops re-run": str(sum(s.ops_rerun for s in stats))}

    row = Row(name, step, ref)
    row.stats, row.kept_and_rerun = stats, kept_and_rerun
    return row


def per_layer(policy=None, sub=None):
    def setup(model):
        stats = []
        for layer in model.decoder.layers:
            stats.append(rc.RecomputeStats())
            rc.checkpoint_wrapper(layer if sub is None else sub(layer), policy_fn=policy, stats=stats[-1])
        return stats
    return setup


def cell_recompute(sub=None):
    def setup(model):
        for layer in model.decoder.layers:
            (layer if sub is None else sub(layer)).recompute()
    return setup


def main():
    a = parse_args(__doc__)
    synchronous_pynative()
    batch = synthetic_batch(a.batch, a.gpt.seq_length, a.gpt.vocab_size, seed=0)
    mlp = lambda layer: layer.mlp  # noqa: E731
    full_rc, mlp_rc = "Cell.recompute() full", "Cell.recompute() mlp"
    rows = [
        case(a, "baseline", lambda m: None, batch),
        case(a, "baseline + 1 forward", lambda m: None, batch, extra_forward=True),
        case(a, full_rc, cell_recompute(), batch),
        case(a, "full", per_layer(), batch, ref=full_rc),
        case(a, "full + exclude matmul", per_layer(policy=rc.exclude_policy(["matmul"])), batch, ref=full_rc),
        case(a, mlp_rc, cell_recompute(mlp), batch),
        case(a, "select mlp", per_layer(sub=mlp), batch, ref=mlp_rc),
        case(a, "select core_attention", per_layer(sub=lambda layer: layer.self_attention.core_attention), batch),
    ]
    if a.profile:
        profile(rows, a.profile, a.warmup, a.steps)
        return
    run_interleaved(rows, a.warmup, a.steps)
    layer_in = a.batch * a.gpt.seq_length * a.gpt.hidden_size * 4
    g = a.gpt
    print(f"{g.num_layers} layers, hidden {g.hidden_size}, heads {g.num_heads}, seq {g.seq_length}, batch {a.batch}, "
          f"dropout {g.dropout} "
          f"({'nn.Dropout, masks kept' if a.nn_dropout else 'replayable SeededDropout, drawn again'}); median of "
          f"{a.steps} interleaved steps after {a.warmup} warm-up; cpu = process CPU time (all threads)")
    print_table(rows, "baseline", lambda r: r.kept_and_rerun())
    inputs = layer_in + a.gpt.seq_length ** 2 * 4   # hidden states and the additive attention mask
    full = next(r for r in rows if r.name == "full")
    print(f"full: kept per layer {[round(s.peak_kept_bytes / inputs, 3) for s in full.stats]} x the layer's inputs "
          f"({inputs / MiB:.4f} MiB: hidden states + attention mask; with --nn-dropout also the dropout masks "
          "at 1 bit per element)")


if __name__ == "__main__":
    main()
