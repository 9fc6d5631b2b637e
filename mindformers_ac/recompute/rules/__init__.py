"""The exactness rules of the op-intercepting region, one object per rule (docs/exactness.md names them).

Each rule holds its own state for one region, makes its forward decision, keeps what its re-run needs, and says in
``reasons`` what the light path can't reproduce (``Region.intercept`` collects them once). ``base`` is what every
rule shares; ``kept_ops`` (K1, K2, ``MUST_SAVE``/``exclude_op``), ``must_swap`` (``MUST_SWAP``, swapped inputs),
``writes`` (W1-W6), ``randomness`` (random ops, Dropout), ``alignment`` (re-run alignment, W7, early stop S1),
``nesting`` (nested regions, grad calls inside a forward: N1) and ``safety_net`` (the bitwise sample every re-run is
checked against).
"""
