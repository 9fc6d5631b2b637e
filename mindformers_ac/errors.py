"""The package's two exception types, and how config messages quote values.

``ConfigError`` rejects a configuration before anything is installed;
``RecomputeError`` reports a recompute that could not rebuild what its forward
dropped, raised in backward (see ``recompute.messages``).

Values in messages come from untrusted configs: a multi-megabyte string, a
billion-laughs structure or a self-referencing list. ``quote`` is the one way
to put such a value in a message: its cost and length are bounded whatever the
value is. ``ConfigError`` clips whole messages as a last line of defence.
"""
import dataclasses

from .limits import MAX_MESSAGE_CHARS, QUOTE_CHARS

_QUOTE_DEPTH = 4
# Python refuses to turn ints with more than 4300 digits into text (and it is
# quadratic below that); past this many bits a message says how big the int is.
_QUOTE_INT_BITS = 2000


def clip(text, limit=QUOTE_CHARS):
    """``text`` cut to ``limit`` characters, with ``...`` and the full length when cut."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def _repr_chunks(value, depth):
    """Pieces of a repr of ``value``; the caller stops pulling once it has enough.

    Every container item visited yields at least two characters, so the work
    done is proportional to the text produced, however large (or shared, or
    cyclic) the value is.
    """
    if isinstance(value, str):
        text = repr(value[:QUOTE_CHARS + 1])
        yield text if len(value) <= QUOTE_CHARS else text + f"... ({len(value)} characters)"
    elif isinstance(value, (bytes, bytearray)):
        yield repr(bytes(value[:QUOTE_CHARS + 1]))
    elif isinstance(value, bool) or value is None or isinstance(value, float):
        yield repr(value)
    elif isinstance(value, int):
        bits = value.bit_length()
        yield repr(int(value)) if bits <= _QUOTE_INT_BITS else f"<int of {bits} bits>"
    elif isinstance(value, (dict, list, tuple, set, frozenset)) or \
            (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        if depth >= _QUOTE_DEPTH:
            yield "..."
        elif isinstance(value, dict):
            yield "{"
            for k, (key, item) in enumerate(value.items()):
                yield ", " if k else ""
                yield from _repr_chunks(key, depth + 1)
                yield ": "
                yield from _repr_chunks(item, depth + 1)
            yield "}"
        elif dataclasses.is_dataclass(value):
            yield f"{type(value).__name__}("
            for k, f in enumerate(dataclasses.fields(value)):
                yield f"{', ' if k else ''}{f.name}="
                yield from _repr_chunks(getattr(value, f.name, None), depth + 1)
            yield ")"
        else:
            opening, closing = {list: "[]", tuple: "()"}.get(type(value), "{}")
            yield opening
            for k, item in enumerate(value):
                yield ", " if k else ""
                yield from _repr_chunks(item, depth + 1)
            yield closing
    else:
        try:
            yield repr(value)
        except Exception:   # a broken __repr__ must not hide the config error
            yield f"<{type(value).__name__} object>"


def type_name(value):
    """The YAML-ish name of a value's type for messages: ``null`` for None, else the Python type's name."""
    return "null" if value is None else type(value).__name__


def quote(value, limit=QUOTE_CHARS):
    """``repr(value)`` in at most about ``limit`` characters, at bounded cost.

    Works on any value: huge strings and ints, deep, shared or self-referencing
    containers, dataclasses holding any of those. The result ends in ``...``
    where it was cut.
    """
    if isinstance(value, str) and len(value) > limit:   # say how long it was
        return f"{repr(value[:limit])[:limit]}... ({len(value)} characters)"
    parts, size = [], 0
    for chunk in _repr_chunks(value, 0):
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            return "".join(parts)[:limit] + "..."
    return "".join(parts)


def child_field(parent, key):
    """The field path of ``parent``'s entry ``key``: ``swap.enable``, or ``select_module['.*mlp']``.

    Keys that are plain names are joined with a dot, any other key (a regex, a
    number, a huge string) is quoted in brackets.
    """
    if isinstance(key, str) and key.isidentifier() and key.isascii() and len(key) <= 64:
        return f"{parent}.{key}" if parent else key
    return item_field(parent, key)


def item_field(parent, key):
    """``parent[key]`` with ``key`` quoted (``recompute.select_module['.*mlp']``)."""
    return f"{parent}[{quote(key)}]"


class ConfigError(ValueError):
    """A config (YAML, dict or dataclass) or a config/model combination was rejected.

    ``field`` is the path of the offending value (``swap.op_swap[1].layers[0]``),
    ``None`` when the error concerns the file or the model as a whole. The message
    always starts with that path, then says what was expected and what was found;
    it is at most ``MAX_MESSAGE_CHARS`` long. Nothing has been changed on the model
    when this is raised.
    """

    def __init__(self, field, message):
        self.field = clip(field, MAX_MESSAGE_CHARS // 4) if field else field
        self.reason = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(clip(f"{self.field}: {self.reason}" if field else self.reason, MAX_MESSAGE_CHARS))


class RecomputeError(RuntimeError):
    """The recompute engine could not give backward what the forward dropped; raised during backward.

    Raised when a recomputed region's re-run took another code path than its
    forward (other ops, fewer ops, other nested regions or ``nn.Dropout``
    calls), saved other tensors (count, shape or dtype), when a saved tensor is
    asked for a second time in one backward (the graph was backpropagated
    twice), or when the engine's own state was misused (a region exited out of
    order). A higher-order gradient through a recomputed region is not refused:
    each backward re-runs it (docs/exactness.md, rule R1). The message starts with
    ``mindformers_ac:``, names the op and its cell path where known, and says
    what to change. A ``RuntimeError`` subclass, so code that caught
    ``RuntimeError`` before keeps working. As after any exception inside
    ``value_and_grad``, MindSpore's executor may need
    ``_pynative_executor.clear_res()`` before the next step.
    """
