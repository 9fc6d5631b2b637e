"""Kept activation bytes and step time per AC mode on the reference MoE GPT, one process (ep=1).

    PYTHONPATH=scripts:. python scripts/bench_moe.py --shape small [--steps 15] [--num-experts 4 --top-k 2 ...]

Rows: baseline, the floor of full recompute (a baseline step plus one forward of the model; the full
rows' "x ref" is taken to it), and one ``apply_ac`` config per mode (full, full + exclude_op AllToAll,
select experts / router / shared_experts, recompute_comm of the all-to-alls, layer swap of every other
layer, a mixed config), each on a fresh model, stepped interleaved (``bench_common``). Kept bytes are the package's
accounting (``accounting.StepMeter``, as ``mindformers-ac train`` reports them): the whole step, and
layer 0 (a MoE layer) alone.
"""

from mindformers_ac.harness.models import synthetic_batch
from mindformers_ac.harness.moe import add_moe_arguments, build_moe_gpt, moe_config, moe_from_args
from mindformers_ac.mindspore_compat import synchronous_pynative
from mindformers_ac.tensors import MiB
from mindformers_ac.training import TrainingRun

from bench_common import Row, parse_args, print_table, profile, run_interleaved

FLOOR = "floor (baseline + 1 forward)"


def modes(num_layers):
    every = [f"0-{num_layers - 1}"]
    half = list(range(0, num_layers - 1, 2))   # the last layer can't be layer-swapped (prefetch 1)
    return {
        "baseline": None,
        FLOOR: None,
        "full": {"recompute": {"mode": "full", "full_recompute_layer": every}},
        "full + exclude AllToAll": {"recompute": {"mode": "full", "full_recompute_layer": every,
                                                  "exclude_op": ["AllToAll"]}},
        "select experts": {"recompute": {"mode": "select", "select_module": {r"mlp\.experts": every}}},
        "select router": {"recompute": {"mode": "select", "select_module": {".*router": every}}},
        "select shared_experts": {"recompute": {"mode": "select", "select_module": {".*shared_experts": every}}},
        "recompute_comm all_to_all": {"recompute_comm": {"enable": True, "select_module": {".*all_to_all": every}}},
        "layer swap (even layers)": {"swap": {"enable": True, "layer_swap": [{"layers": half}]}},
        "mixed": {"recompute": {"mode": "select", "full_recompute_layer": [0],
                                "select_module": {r"mlp\.experts": [f"2-{num_layers - 1}"]}},
                  "recompute_comm": {"enable": True, "select_module": {".*all_to_all": [f"2-{num_layers - 1}"]}},
                  "swap": {"enable": True, "layer_swap": [{"layers": [1]}]}},
    }


def case(name, config, moe, batch):
    run = TrainingRun(build_moe_gpt(moe, seed=0), config)
    last = {}
    extra_forward = name == FLOOR

    def step():
        if extra_forward:
            run.model(*batch)
        last["memory"] = run.step(batch)[2]

    row = Row(name, step, ref=FLOOR if name.startswith("full") else None)

    def kept():
        memory = last["memory"].as_dict()
        return {"kept MiB": f"{memory['kept_bytes'] / MiB:.3f}",
                "layer 0 kept MiB": f"{memory['layers']['0']['kept_bytes'] / MiB:.3f}",
                "offloaded MiB": f"{memory['offloaded_bytes'] / MiB:.3f}"}
    row.kept = kept
    return row


def main():
    a = parse_args(__doc__, add_moe_arguments)
    a.moe = True
    synchronous_pynative()
    moe = moe_config(a.gpt, **moe_from_args(a, a.gpt))
    batch = synthetic_batch(a.batch, a.gpt.seq_length, a.gpt.vocab_size, seed=0)
    rows = [case(name, config, moe, batch) for name, config in modes(moe.num_layers).items()]
    if a.profile:
        profile(rows, a.profile, a.warmup, a.steps)
        return
    run_interleaved(rows, a.warmup, a.steps)
    print(f"MoE GPT: {moe.num_layers} layers (MoE every {moe.moe_layer_freq}), hidden {moe.hidden_size}, seq "
          f"{moe.seq_length}, batch {a.batch}, {moe.num_experts} experts top-{moe.top_k}, capacity factor "
          f"{moe.capacity_factor}, dropout {moe.dropout}; median of {a.steps} interleaved steps after {a.warmup} "
          f"warm-up; cpu = process CPU time (all threads)")
    print_table(rows, "baseline", lambda r: r.kept())


if __name__ == "__main__":
    main()
