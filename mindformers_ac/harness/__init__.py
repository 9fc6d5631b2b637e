"""Everything around the library: the ``mindformers-ac`` command line, ``train`` and its report, the
models it trains, the ``msrun`` launcher, the shipped default config (``default_configs/default.yaml``).

* ``cli``: the command line; ``launch``: the ``msrun`` launcher, bounded in time;
* the models: the reference GPT (``models``), its tensor-parallel version (``tp``), the DeepSeek-style
  MoE GPT and its expert-parallel version (``moe``), and the user's own (``user_model``: ``--model
  MODULE:FUNCTION``); ``spec`` says which one a run trains;
* ``train``: a model trained twice, without and with AC; ``variant`` one run of it, with its status line
  (``progress``) and its process peak (``process_memory``);
* ``parallel`` (``--tp`` / ``--ep``), ``pipeline`` (``--pp 2``) and ``data_parallel`` (``--dp``): the
  side-by-side runs on each rank under ``msrun``;
* ``exactness``: the bitwise verdict; ``report``: the per-layer table, JSON and plot.

Importing the package loads nothing: each command imports what it needs (``import mindformers_ac``
must not pull in matplotlib, and ``validate`` must not start MindSpore's runtime). The library never
imports this package (``tests/test_layout.py``).
"""
