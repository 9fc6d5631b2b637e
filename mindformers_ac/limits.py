"""Bounds on untrusted config input: every value here is documented in docs/config.md (Limits).

A config comes from people and from generated files, so reading, checking and
planning it must cost bounded time, memory and message size whatever it
contains. Each limit is far above what a real trainer YAML needs and far below
what would hurt; exceeding one is a ``ConfigError`` that names the field (or the
file and position) and the limit.
"""

# A MindFormers trainer YAML is a few KB. Reading stops after this many bytes.
MAX_CONFIG_BYTES = 1 << 20

# Nodes (scalars, sequences, mappings) in a document with every alias counted
# expanded (``*a`` counts the whole tree anchored as ``&a``): the alias budget.
# Billion-laughs files stop here instead of growing exponentially in whatever
# walks the loaded data, and PyYAML's pure-Python parser (tens of microseconds
# a node) stays near a second. A trainer YAML has a few hundred nodes.
MAX_YAML_NODES = 10_000

# Nesting of mappings and sequences. The sections nest 4 deep.
MAX_YAML_DEPTH = 64

# Characters of a YAML int or float literal: longer ones cost quadratic time to
# convert (sexagesimal ``1:2:3:...``) or exceed Python's int-string limit.
MAX_NUMBER_CHARS = 100

# Layer ids are below this, and no model may claim more layers: spec ranges and
# ``--num-layers`` are checked against it before anything is expanded.
MAX_LAYERS = 10_000

# Byte counts in a config (swap.min_bytes, swap.max_host_bytes): a PiB is more than any host has.
MAX_CONFIG_BYTE_COUNT = 1 << 50

# select_module / exclude_op / op_name patterns. ``regex`` expands counted
# repetitions at compile time, so nested ``{m,n}`` multiply compile memory
# (``(?:(?:a{200}){200}){200}`` takes 2.5 GB). The product of every ``{m,n}``
# bound in a pattern is capped, whether nested or not: a cheap, parser-free
# upper bound on the expansion.
MAX_PATTERN_CHARS = 500
MAX_REPEAT_PRODUCT = 1000

# Total time spent matching patterns in one plan_ac call (not per match): a
# catastrophic pattern fails after this, however many paths it is tried on.
MATCH_BUDGET_S = 2.0

# A value quoted in a message is cut to about this many characters; a whole
# message (field path included) to MAX_MESSAGE_CHARS, about one screen.
QUOTE_CHARS = 200
MAX_MESSAGE_CHARS = 2000
