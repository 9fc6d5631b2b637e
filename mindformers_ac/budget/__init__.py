"""A memory budget instead of a config: choose recompute / swap per layer from measured options.

``solver`` is the exact per-layer choice under a budget (``plan --budget`` and
``memory_budget`` share it), ``options`` the candidates tried on a layer and
the ``Profile`` built from measured steps, ``sizes`` the budget's spelling, and
``controller`` the ``memory_budget`` section at work: it profiles on the
user's own first training steps, then installs the chosen plan; under
MindSpore's communication, ``agreement`` makes the ranks that must run one
plan choose it together, from the worst rank's figures.

Importing the package loads nothing.
"""
