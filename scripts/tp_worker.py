"""Tensor-parallel training worker, one process per rank under msrun.

    msrun --worker_num 2 --local_worker_num 2 --master_port P --join True \\
        scripts/tp_worker.py --tp 2 --layers 2 --hidden 32 --seq 16 --batch 2 --steps 3 --out DIR

(or ``python -m mindformers_ac.harness.launch scripts/tp_worker.py ...``). Builds
``tp.build_tp_gpt`` (weights sliced from ``models.build_gpt`` with the same
seed), optionally applies ``--config YAML`` with ``apply_ac``, trains
``--steps`` steps of plain SGD on ``synthetic_batch(seed=seed+step)`` and, on
every rank, trains the single-process model on the same data for comparison.
Rank 0 writes ``DIR/tp_result.json``: per-step TP loss and reference loss, the
largest relative difference between the gathered TP gradients and the
reference gradients, SHA1 of every local gradient (``DIR/grads_rank{r}.json``
for every rank), and per-step counts of collectives (forward / backward).

``--fail-rank R`` makes rank R raise after communication init (tests the
launcher's failure handling); ``--fail-before-init`` raises before it.
"""
import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="plain Megatron TP (replicated activations, no all_gather in layers)")
    p.add_argument("--no-reference", action="store_true", help="skip the single-process comparison")
    p.add_argument("--config", default=None, help="AC YAML applied with apply_ac before training")
    p.add_argument("--out", required=True)
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank raises after init (tests)")
    p.add_argument("--fail-before-init", action="store_true", help="--fail-rank raises before init")
    return p.parse_args(argv)


def maybe_apply_ac(model, config_path):
    """``apply_ac(model, config=AcConfig.from_yaml(path))`` if the package provides it."""
    if not config_path:
        return None
    try:
        from mindformers_ac import apply_ac
        from mindformers_ac.config import AcConfig
    except ImportError as exc:
        print(f"[tp_worker] --config given but apply_ac is unavailable ({exc}); training without AC",
              flush=True)
        return None
    return apply_ac(model, config=AcConfig.from_yaml(config_path))


def sha1(array):
    return hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest()


def sgd_step(params, grads, lr):
    for p, g in zip(params, grads):
        p.set_data(p - lr * g)


def gather_full_grads(model, params, grads, world):
    """Every parameter's full gradient, rebuilt from all ranks' shards (forward AllGather only)."""
    from mindspore import ops

    from mindformers_ac.harness.tp import unshard_param
    gather = ops.AllGather()
    full = {}
    for p, g in zip(params, grads):
        if world == 1:
            shards = [g.asnumpy()]
        else:
            stacked = gather(g.reshape(1, -1)).asnumpy()
            shards = [row.reshape(g.shape) for row in stacked]
        full[p.name] = unshard_param(model, p.name, shards)
    return full


def main(argv=None):
    args = parse_args(argv)
    rank_env = int(os.environ.get("RANK_ID", "0"))
    if args.fail_before_init and args.fail_rank == rank_env:
        raise RuntimeError(f"--fail-rank {args.fail_rank}: failing before communication init")

    import mindspore as ms

    from mindformers_ac.mindspore_compat import synchronous_pynative
    synchronous_pynative("CPU")
    from mindformers_ac.harness import tp as T
    from mindformers_ac.harness.models import build_gpt, synthetic_batch

    rank, world = T.init_tp() if args.tp > 1 else (0, 1)
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp} but the job has {world} ranks")
    if args.fail_rank == rank:
        raise RuntimeError(f"--fail-rank {rank}: failing on purpose after communication init")
    os.makedirs(args.out, exist_ok=True)

    dims = dict(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads, seq_length=args.seq,
                vocab_size=args.vocab, dropout=args.dropout, seed=args.seed)
    full = build_gpt(**dims)
    model = T.build_tp_gpt(args.tp, rank, **dims, sequence_parallel=not args.no_sequence_parallel,
                           full_model=full)
    maybe_apply_ac(model, args.config)
    params = model.trainable_params()
    ref_params = full.trainable_params()
    step_fn = ms.value_and_grad(model, None, params)
    ref_fn = ms.value_and_grad(full, None, ref_params)

    result = {"args": vars(args), "world_size": world, "steps": []}
    grad_shas = []
    for step in range(args.steps):
        tokens, labels = synthetic_batch(args.batch, args.seq, args.vocab, seed=args.seed + step)
        T.reset_comm_counters(model)
        t0 = time.perf_counter()
        loss, grads = step_fn(tokens, labels)
        grads = T.sync_sequence_parallel_grads(model, params, grads)
        elapsed = time.perf_counter() - t0
        counts = T.collective_counts(model)
        record = {"step": step, "loss": float(loss.asnumpy()), "seconds": round(elapsed, 4), **counts}
        grad_shas.append({p.name: sha1(g.asnumpy()) for p, g in zip(params, grads)})
        if not args.no_reference:
            full_grads = gather_full_grads(model, params, grads, world)
            ref_loss, ref_grads = ref_fn(tokens, labels)
            worst, worst_name = 0.0, ""
            for p, g in zip(ref_params, ref_grads):
                g = g.asnumpy()
                diff = float(np.max(np.abs(full_grads[p.name] - g)) / (np.max(np.abs(g)) + 1e-12))
                if diff > worst:
                    worst, worst_name = diff, p.name
            record.update(ref_loss=float(ref_loss.asnumpy()), grad_max_rel_diff=worst,
                          grad_worst_param=worst_name)
            sgd_step(ref_params, ref_grads, args.lr)
        sgd_step(params, grads, args.lr)
        result["steps"].append(record)
        print(f"[rank {rank}] step {step} loss {record['loss']:.6f}"
              + (f" ref {record['ref_loss']:.6f} grad_rel {record['grad_max_rel_diff']:.2e}"
                 if "ref_loss" in record else ""), flush=True)

    result["expected_collectives"] = T.expected_collectives(args.layers, not args.no_sequence_parallel)
    with open(os.path.join(args.out, f"grads_rank{rank}.json"), "w") as f:
        json.dump(grad_shas, f, indent=1)
    if rank == 0:
        result["grad_sha1"] = grad_shas
        with open(os.path.join(args.out, "tp_result.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
