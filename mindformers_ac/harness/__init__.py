"""Everything around the library: the ``mindformers-ac`` command line, ``train`` and its report, the
reference GPT and its tensor-parallel version, the ``msrun`` launcher, the shipped default config.

Importing the package loads nothing: each command imports what it needs (``import mindformers_ac``
must not pull in matplotlib, and ``validate`` must not start MindSpore's runtime). The library never
imports this package (``tests/test_layout.py``).
"""
