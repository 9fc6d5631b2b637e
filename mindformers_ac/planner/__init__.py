"""``mindformers-ac plan``: ``profile`` measures each per-layer option on a model, ``solver`` picks the
cheapest per-layer recompute/swap that fits a memory budget.

Importing the package loads nothing; the library never imports it (``tests/test_layout.py``).
"""
