"""``mindformers-ac plan``: ``profile`` measures each per-layer option on a model, ``budget.solver`` picks
the cheapest per-layer recompute/swap that fits a memory budget, and ``stages`` does it per pipeline
stage, each with the microbatches it holds in flight.

Importing the package loads nothing; the library never imports it (``tests/test_layout.py``).
"""
