"""Everything around the library: the ``mindformers-ac`` command line, ``train`` and its report, the
models it trains, the ``msrun`` launcher, the shipped default config (``default_configs/default.yaml``).

The models: the reference GPT (``models``), its tensor-parallel version (``tp``), the DeepSeek-style
MoE GPT and its expert-parallel version (``moe``), and the user's own (``user_model``: ``--model
MODULE:FUNCTION``); ``spec`` says which one a run trains.

Importing the package loads nothing: each command imports what it needs (``import mindformers_ac``
must not pull in matplotlib, and ``validate`` must not start MindSpore's runtime). The library never
imports this package (``tests/test_layout.py``).
"""
