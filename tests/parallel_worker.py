"""Under msrun: ``train --tp 2`` or ``train --pp 2 --microbatches 4``'s comparison for each config given, in one
job (one communication set-up for all: each msrun start costs 10-20 s on 2 cores).

    parallel_worker.py {tp|pp} OUT_DIR CONFIG...   -> OUT_DIR/rank{r}.json: {config: {"summary", "layers"}}

``tp`` also trains the model of ``test_mindformers_comm_ops.py`` (MindFormers' ``_comm_ops`` registry in its
own form) on the job's real all-reduce and all-gather: its results under ``"mindformers_registry"``.
"""
import json
import os
import sys

from mindformers_ac.harness.models import GPTConfig
from mindformers_ac.harness.parallel import train_and_compare_tp
from mindformers_ac.harness.pipeline import train_and_compare_pp
from mindformers_ac.harness.spec import TrainSpec
from mindformers_ac.harness.tp import init_tp
from mindformers_ac.mindspore_compat import synchronous_pynative

SPECS = {   # the dimensions the CLI tests give
    "tp": TrainSpec(gpt=GPTConfig(num_layers=2, hidden_size=32, num_heads=2, seq_length=16, dropout=0.1), batch=2,
                    steps=3, tp=2),
    "pp": TrainSpec(gpt=GPTConfig(num_layers=8, hidden_size=16, num_heads=2, seq_length=8, vocab_size=64,
                                  dropout=0.1), batch=2, steps=2, pp=2, microbatches=4),
}
COMPARE = {"tp": train_and_compare_tp, "pp": train_and_compare_pp}


def main(kind, out_dir, configs):
    synchronous_pynative("CPU")
    comm = init_tp()
    results = {}
    for config in configs:
        _, result = COMPARE[kind](SPECS[kind], config, comm)
        results[config] = {"summary": result["summary"], "layers": result["layers"]}
    if kind == "tp":
        import test_mindformers_comm_ops as registry
        results["mindformers_registry"] = registry.registry_results(registry.on_two_ranks())
    with open(os.path.join(out_dir, f"rank{comm[0]}.json"), "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
