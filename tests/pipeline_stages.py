"""The reference GPT cut into two pipeline stages in one process (``harness.pipeline.split_gpt``), and a
GPipe schedule over them, recorded for bitwise comparison.

``gpipe_steps`` runs M microbatches' forwards
(``ms.vjp`` per stage) before any backward, then the backwards in reverse order (the only order with several
graphs in flight that MindSpore 2.10 runs), sums each stage's gradients over the microbatches and takes one
optimizer step per stage.
"""
import mindspore as ms
from mindspore import nn

from mindformers_ac.harness.models import build_gpt, synthetic_batch
from mindformers_ac.harness.pipeline import split_gpt, summed

GPT = dict(num_layers=8, hidden_size=16, num_heads=2, seq_length=8, vocab_size=64, dropout=0.1, seed=3)


def build_stages(cut=4, **dims):
    return split_gpt(build_gpt(**{**GPT, **dims}), cut)


def microbatch(index):
    return synthetic_batch(2, 8, 64, seed=index)


def gpipe_steps(stages, steps=2, microbatches=4, on_step=None):
    """Per step: the microbatches' losses, each stage's summed gradients and its parameters, as bytes."""
    first, last = stages
    opts = [nn.SGD(s.trainable_params(), learning_rate=0.05) for s in stages]
    history = []
    for step in range(steps):
        in_flight = []
        for k in range(microbatches):
            tokens, labels = microbatch(step * microbatches + k)
            hidden, back_first = ms.vjp(lambda t: first(t), tokens, weights=opts[0].parameters)
            received = hidden.copy()   # what the next stage receives: a tensor without the sender's graph
            loss, back_last = ms.vjp(lambda x, labels=labels: last(x, labels), received,
                                     weights=opts[1].parameters)
            in_flight.append((loss, back_first, back_last))
        grads = [None, None]
        for loss, back_first, back_last in reversed(in_flight):
            (sent,), g_last = back_last(ms.Tensor(1.0, ms.float32))
            _, g_first = back_first(sent)
            grads = [summed(grads[0], g_first), summed(grads[1], g_last)]
        for opt, g in zip(opts, grads):
            opt(g)
        history.append(([loss.asnumpy().tobytes() for loss, _, _ in in_flight],
                        [[t.asnumpy().tobytes() for t in g] for g in grads],
                        [[p.asnumpy().tobytes() for p in s.get_parameters()] for s in stages]))
        del in_flight
        if on_step is not None:
            on_step(step)
    return history


def first_difference(base, other):
    for step, ((lb, gb, pb), (lo, go, po)) in enumerate(zip(base, other)):
        if lb != lo:
            return f"step {step}: microbatch losses differ"
        for stage in (0, 1):
            bad = [k for k, (a, b) in enumerate(zip(gb[stage], go[stage])) if a != b]
            if bad:
                return f"step {step}: stage {stage} gradients {bad[:5]} differ"
            if pb[stage] != po[stage]:
                return f"step {step}: stage {stage} parameters differ"
    return None if len(base) == len(other) else "different number of steps"
