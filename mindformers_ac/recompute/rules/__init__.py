"""The exactness rules of the op-intercepting region, one object per rule (docs/exactness.md names them): ``kept_ops``,
``must_swap``, ``writes``, ``randomness``, ``alignment``, ``nesting`` and ``safety_net``, sharing ``base``. Each holds
its state for one region and says in ``reasons`` what the light path can't reproduce."""
