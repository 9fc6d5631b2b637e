"""Read a trainer YAML file safely and within fixed bounds.

``load_yaml_file`` refuses, with a ``ConfigError``:

* files larger than ``MAX_CONFIG_BYTES`` (read no further than that);
* bytes that are not UTF-8 (naming the byte offset);
* documents of more than ``MAX_YAML_NODES`` nodes, aliases counted expanded
  (so billion laughs stop early), recursive aliases, nesting deeper than
  ``MAX_YAML_DEPTH``;
* number literals longer than ``MAX_NUMBER_CHARS``;
* a key given twice in one mapping (a typo'd second ``mode:`` would silently
  win otherwise), naming the key's field path and both lines;
* syntax errors and unsafe tags (only plain data is constructed).

Errors about one value carry its field path (``recompute.mode``); errors about
the file carry ``field=None`` and name the file and the position.
"""
import os

import yaml

from .errors import ConfigError, child_field, clip, quote
from .limits import MAX_CONFIG_BYTES, MAX_NUMBER_CHARS, MAX_YAML_DEPTH, MAX_YAML_NODES

_MERGE_TAG = "tag:yaml.org,2002:merge"
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _where(name, mark):
    return f"{name}, line {mark.line + 1}, column {mark.column + 1}" if mark else name


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` that counts, while composing, what the document would expand to.

    An alias adds the size of the whole tree it refers to (recorded when its
    anchor was composed), so the count is the size of the fully expanded
    document, found without expanding anything. All state is per instance.
    """

    def __init__(self, text, name):
        super().__init__(text)
        self.name = name
        self.paths = []           # field path of every node being composed, outermost first
        self.composed = 0         # nodes so far, aliases counted expanded
        self.anchor_sizes = {}    # anchor -> expanded size of its tree, once complete

    def refuse(self, field, message, mark):
        raise ConfigError(field, f"{message} ({_where(self.name, mark)})")

    def _child_path(self, parent, index):
        path = self.paths[-1] if self.paths else ""
        if parent is None or index is None:   # the document, or a mapping key
            return path
        if isinstance(index, int):
            return f"{path}[{index}]"
        key = index.value if isinstance(index, yaml.ScalarNode) else "<complex key>"
        return child_field(path, key)

    def compose_node(self, parent, index):
        path = self._child_path(parent, index)
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.anchors and event.anchor not in self.anchor_sizes:
                self.refuse(path or None, f"alias *{clip(event.anchor, 40)} refers to the node that "
                                          f"contains it (a recursive structure)", event.start_mark)
            self.composed += self.anchor_sizes.get(event.anchor, 0)
            if self.composed > MAX_YAML_NODES:
                self.refuse(path or None, f"YAML aliases expand the document to more than {MAX_YAML_NODES} "
                                          f"nodes (an alias bomb?); write the values out instead",
                            event.start_mark)
            return super().compose_node(parent, index)
        if len(self.paths) >= MAX_YAML_DEPTH:
            self.refuse(path or None, f"YAML nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark)
        before = self.composed
        self.paths.append(path)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.paths.pop()
        self.composed += 1
        if self.composed > MAX_YAML_NODES:
            self.refuse(path or None, f"YAML document has more than {MAX_YAML_NODES} nodes (a trainer YAML "
                                      f"has a few hundred); is it the right file?", event.start_mark)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self.anchor_sizes[anchor] = self.composed - before
        return node

    def compose_scalar_node(self, anchor):
        node = super().compose_scalar_node(anchor)
        if node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS:
            self.refuse(self.paths[-1] or None, f"number literal of {len(node.value)} characters, more than "
                                                f"the limit of {MAX_NUMBER_CHARS}: {quote(node.value)}",
                        node.start_mark)
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        first = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)   # so that 8 and 0x8, or yes and true, are one key
            try:
                seen = first.setdefault(key, key_node.start_mark)
            except TypeError:   # unhashable: the constructor reports it
                continue
            if seen is not key_node.start_mark:
                self.refuse(child_field(self.paths[-1], key),
                            f"duplicate key: also set at line {seen.line + 1}; a mapping may give each "
                            f"key once, remove one of them", key_node.start_mark)
        return node


def config_path(path):
    """``path`` as a str or bytes file system path, and how messages name it."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise ConfigError("path", f"expected the path of a YAML file (str or os.PathLike), got "
                                  f"{type(path).__name__} {quote(path)}") from None
    return path, clip(os.fsdecode(path))


def read_config_text(path):
    """The text of config file ``path``: at most ``MAX_CONFIG_BYTES``, UTF-8 (a BOM is allowed)."""
    path, name = config_path(path)
    try:
        with open(path, "rb") as stream:
            data = stream.read(MAX_CONFIG_BYTES + 1)   # never more, whatever the file is
            size = max(len(data), os.fstat(stream.fileno()).st_size)
    except FileNotFoundError:
        raise ConfigError(None, f"config file not found: {name}") from None
    except IsADirectoryError:
        raise ConfigError(None, f"config path is a directory, not a YAML file: {name}") from None
    except (OSError, ValueError) as exc:   # permissions, name too long, NUL in the name
        raise ConfigError(None, f"cannot read config file {name}: {clip(exc)}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(None, f"config file {name} is {size} bytes, more than the limit of "
                                f"{MAX_CONFIG_BYTES} bytes (a trainer YAML is a few KB); is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(None, f"config file {name} is not UTF-8 text: byte 0x{data[exc.start]:02x} at "
                                f"offset {exc.start} can't be decoded (UTF-16, Latin-1 or a binary "
                                f"file?); save it as UTF-8") from None


def load_yaml_text(text, name):
    """Parse ``text`` (called ``name`` in messages) into plain data, within the module's bounds."""
    loader = None
    try:
        loader = _BoundedLoader(text, name)   # its reader already rejects control characters
        return loader.get_single_data()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(None, f"YAML syntax error in {_where(name, mark)}: {clip(problem)}") from None
    except (ValueError, OverflowError, RecursionError) as exc:
        # PyYAML converts timestamps and numbers with Python calls that raise these
        raise ConfigError(None, f"YAML value that can't be read in {name}: {clip(exc)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml_file(path):
    """Read and parse config file ``path``; see the module docstring for what is refused."""
    text = read_config_text(path)
    return load_yaml_text(text, config_path(path)[1])
