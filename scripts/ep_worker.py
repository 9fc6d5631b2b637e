"""Expert-parallel MoE worker, one process per rank under msrun: several AC configs in one job.

    python -m mindformers_ac.harness.launch --nproc 2 scripts/ep_worker.py --out DIR \\
        --config full=full.yaml --config comm=comm.yaml [--equivalence] [--layers 3 --moe-layer-freq 2 ...]

What ``mindformers-ac train CONFIG --moe --ep N`` does for one config, for each
``--config NAME=YAML`` in turn, with one run without AC shared by all of them
(msrun and communication init cost more than the runs on 2 cores): every rank
trains its expert-parallel slice without and with the config, compares loss,
gradients and all parameters bitwise (``train.compare``) and writes
``DIR/NAME_rank{r}.json``: the summary (verdict, collectives of the last step
with re-runs per op), the plan and the per-layer recompute counters.

``--equivalence`` (dropout 0, no AC): for ``--steps`` SGD steps, the mean of the
ranks' losses against the single-process model's mean loss over the same
per-rank batches, and every rank's synced gradients (local experts included)
against the single-process gradient of the mean loss; rank r writes
``DIR/equivalence_rank{r}.json`` (largest relative differences).
"""
import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", action="append", default=[], metavar="NAME=YAML")
    p.add_argument("--equivalence", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num-experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--moe-layer-freq", type=int, default=2)
    p.add_argument("--router-jitter", type=float, default=0.05)
    return p.parse_args(argv)


def make_spec(args, world, dropout=None, jitter=None):
    from mindformers_ac.harness.models import GPTConfig
    from mindformers_ac.harness.spec import TrainSpec
    gpt = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads, seq_length=args.seq,
                    vocab_size=args.vocab, dropout=args.dropout if dropout is None else dropout)
    moe = dict(num_experts=args.num_experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
               moe_layer_freq=args.moe_layer_freq,
               router_jitter=args.router_jitter if jitter is None else jitter)
    return TrainSpec(gpt=gpt, batch=args.batch, steps=args.steps, ep=world, moe=moe)


def run_configs(args, spec, rank):
    from mindformers_ac.harness.train import compare
    from mindformers_ac.harness.variant import run_variant
    baseline = None
    for item in args.config:
        name, path = item.split("=", 1)
        if baseline is None:
            baseline = run_variant(spec, None, "baseline", rank, show_progress=False)
        ac = run_variant(spec, path, name, rank, show_progress=False)
        result = compare(spec, path, baseline, ac)
        summary = result["summary"]
        summary["collectives_per_step"] = {"baseline": baseline["collectives"][-1], "ac": ac["collectives"][-1]}
        out = {"summary": summary, "plan": ac["plan"], "layers": result["layers"]}
        with open(os.path.join(args.out, f"{name}_rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        print(f"[rank {rank}] {name}: {summary['verdict']}, collectives {summary['collectives_per_step']['ac']}",
              flush=True)


def equivalence(args, spec, rank, world):
    """EP run against the single-process model on the same per-rank batches (see the module docstring)."""
    import mindspore as ms
    from mindspore import nn, ops

    from mindformers_ac.harness.moe import build_moe_gpt, expert_owner, moe_config, sync_expert_parallel_grads
    config = moe_config(spec.gpt, **spec.moe)
    full = build_moe_gpt(config, spec.seed)
    model = build_moe_gpt(config, spec.seed, ep=world, rank=rank, full_model=full)
    params, ref_params = model.trainable_params(), full.trainable_params()
    ep_fn = ms.value_and_grad(model, None, params)
    ref_fn = ms.value_and_grad(full, None, ref_params)
    ep_opt, ref_opt = nn.SGD(params, learning_rate=spec.lr), nn.SGD(ref_params, learning_rate=spec.lr)
    local = config.num_experts // world
    steps = []
    for step in range(args.steps):
        loss, grads = ep_fn(*spec.synthetic_batches(rank)(step))
        grads = sync_expert_parallel_grads(model, params, grads)
        mean_loss = float((ops.AllReduce()(loss) / world).asnumpy())
        ref_loss, ref_grads = 0.0, None
        for r in range(world):   # the gradient of the mean of the ranks' losses
            l, g = ref_fn(*spec.synthetic_batches(r)(step))
            ref_loss += float(l.asnumpy()) / world
            ref_grads = [x / world for x in g] if ref_grads is None else [a + x / world for a, x in zip(ref_grads, g)]
        ref_by_name = {p.name: g.asnumpy() for p, g in zip(ref_params, ref_grads)}
        worst, worst_expert, worst_name = 0.0, 0.0, ""
        for p, g in zip(params, grads):
            ref = ref_by_name[expert_owner(p.name, local, rank)]
            diff = float(np.max(np.abs(g.asnumpy() - ref)) / (np.max(np.abs(ref)) + 1e-12))
            if ".local_experts." in p.name:
                worst_expert = max(worst_expert, diff)
            if diff > worst:
                worst, worst_name = diff, p.name
        steps.append({"loss": mean_loss, "ref_loss": ref_loss, "grad_max_rel_diff": worst,
                      "expert_grad_max_rel_diff": worst_expert, "worst_param": worst_name})
        ep_opt(grads)
        ref_opt(tuple(ref_grads))
        print(f"[rank {rank}] equivalence step {step}: {steps[-1]}", flush=True)
    with open(os.path.join(args.out, f"equivalence_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"steps": steps, "spec": dataclasses.asdict(spec)}, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    from mindformers_ac.harness.tp import init_tp
    from mindformers_ac.mindspore_compat import synchronous_pynative
    synchronous_pynative("CPU")
    rank, world = init_tp()
    os.makedirs(args.out, exist_ok=True)
    if args.config:
        run_configs(args, make_spec(args, world), rank)
    if args.equivalence:
        equivalence(args, make_spec(args, world, dropout=0.0, jitter=0.0), rank, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
