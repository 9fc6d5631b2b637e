"""Does MindSpore's DistributedDataParallel run on CPU (mccl)? Run under msrun with 2 ranks:

    python -m mindformers_ac.harness.launch --nproc 2 --log-dir /tmp/ddp scripts/probe_ddp.py [PythonReducer [nosync]]

Each rank prints ``DDP OK`` after two steps, or ``DDP FAILED`` with the error (docs/distributed.md records
what 2.10 prints: no CPU kernel for InplaceZero, a view copy, InnerCommAllReduce).
"""
import sys

import mindspore as ms
from mindspore import nn
from mindspore.communication import get_rank, init
from mindspore.parallel.distributed import DistributedDataParallel

from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.mindspore_compat import synchronous_pynative


def main(argv):
    synchronous_pynative("CPU")
    init()
    rank = get_rank()
    mode = argv[0] if argv else "CppReducer"
    gpt = build_gpt(num_layers=2, hidden_size=32, num_heads=2, seq_length=16, vocab_size=64, dropout=0.0, seed=3)
    try:
        ddp = DistributedDataParallel(gpt, reducer_mode=mode, init_sync="nosync" not in argv)
        opt = nn.SGD(ddp.trainable_params(), learning_rate=0.05)
        grad_fn = ms.value_and_grad(ddp, None, opt.parameters)
        for step in range(2):
            loss, grads = grad_fn(*synthetic_batch(2, 16, 64, seed=10 * rank + step))
            opt(grads)
            print(f"rank {rank} step {step} loss {float(loss.asnumpy()):.6f}", flush=True)
        print("DDP OK", flush=True)
    except RuntimeError as exc:
        print(f"DDP FAILED {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
