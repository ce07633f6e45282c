"""YAML that users hand llmd (specs, sweeps, simulator parameters, GPU and model profiles), read in one place with
bounds: regular files only, at most MAX_BYTES, SafeLoader constructors, nesting at most MAX_DEPTH deep, and aliases
that add at most MAX_ALIAS_NODES nodes, so an alias bomb or /dev/zero is refused in a moment instead of hanging.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml

from llmd.errors import UserError

# The largest YAML llmd ships is 5 KiB; PyYAML's pure-Python parser reads ~100 KiB/s on a busy login node, so this
# bounds a read to seconds.
MAX_BYTES = 256 * 1024
MAX_DEPTH = 64
MAX_ALIAS_NODES = 10_000

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


class InputFileError(UserError):
    """A YAML file that cannot be read at all; `problem` is the message without the path, for callers that add it."""

    def __init__(self, path: str, problem: str, *, missing: bool = False) -> None:
        self.path = path
        self.problem = problem
        self.missing = missing
        super().__init__(f"{path}: {problem}")


class YAMLLimitError(yaml.YAMLError):
    """Valid YAML beyond what llmd reads: nested too deep, or aliases that would expand too far."""


def _size(count: int) -> str:
    return f"{count / 1024:.0f} KiB" if count >= 1024 else f"{count} bytes"


def read_text(path: str | os.PathLike[str], what: str = "YAML file") -> str:
    """The UTF-8 text of a regular file of at most MAX_BYTES; InputFileError says which of those it is not."""
    source = os.fspath(path)
    try:
        info = os.stat(source)  # before open: opening a FIFO would block
    except FileNotFoundError:
        raise InputFileError(source, "no such file", missing=True) from None
    except OSError as exc:
        raise InputFileError(source, f"cannot read it: {exc.strerror or exc}") from None
    kind = next((name for test, name in _KINDS if test(info.st_mode)), None)
    if kind is not None or not stat.S_ISREG(info.st_mode):
        raise InputFileError(source, f"is {kind or 'not a regular file'}, not a {what}; give the path of a YAML file")
    limit = f"llmd reads YAML files of at most {_size(MAX_BYTES)} (a spec is a few KiB): is it the right file?"
    if info.st_size > MAX_BYTES:
        raise InputFileError(source, f"is {_size(info.st_size)}; {limit}")
    try:
        with open(source, "rb") as handle:
            data = handle.read(MAX_BYTES + 1)  # the size may have changed since stat
    except IsADirectoryError:
        raise InputFileError(source, f"is a directory, not a {what}") from None
    except PermissionError:
        raise InputFileError(source, "cannot read it: permission denied") from None
    except OSError as exc:
        raise InputFileError(source, f"cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise InputFileError(source, f"is larger than {_size(MAX_BYTES)}; {limit}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(source, f"is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_graph(root: yaml.Node) -> None:
    """Refuse a composed document whose aliases, expanded, would add more than MAX_ALIAS_NODES nodes, that nests
    deeper than MAX_DEPTH, or that holds an alias of its own ancestor (a cycle no spec means)."""
    sizes: dict[int, int] = {}  # node id -> nodes in its subtree, aliases expanded
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # iterative: a deep document must not hit Python's recursion limit here
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            kids = _children(node)
            sizes[key] = 1 + sum(sizes[id(k)] for k in kids)
            depths[key] = 1 + max((depths[id(k)] for k in kids), default=0)
            if depths[key] > MAX_DEPTH:
                raise YAMLLimitError(
                    f"nests more than {MAX_DEPTH} levels deep (from line {node.start_mark.line + 1}); llmd's files "
                    "are a few levels deep: is it the right file?"
                )
            if sizes[key] - len(sizes) > MAX_ALIAS_NODES:
                raise YAMLLimitError(
                    f"its aliases (*name) would expand to more than {MAX_ALIAS_NODES} nodes (at line "
                    f"{node.start_mark.line + 1}); write the values out, or use fewer nested aliases"
                )
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise YAMLLimitError(
                f"the value anchored at line {node.start_mark.line + 1} holds an alias (*name) of itself; a value "
                "cannot contain itself: remove that alias"
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node) if id(kid) not in sizes)


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose documents pass check_graph before anything walks or constructs them."""

    def get_single_node(self) -> yaml.Node | None:
        try:
            node = super().get_single_node()
        except RecursionError:  # PyYAML composes recursively: brackets nested hundreds deep reach Python's limit
            raise YAMLLimitError(f"nests more than {MAX_DEPTH} levels deep; is it the right file?") from None
        if node is not None:
            check_graph(node)
        return node


def unreadable_value(exc: ValueError) -> str:
    """Words for a constructor's ValueError: a 5,000-digit integer, a date like 2024-13-45."""
    detail = str(exc).split("; use sys.set_int_max_str_digits")[0]
    return f"holds a value that cannot be read ({detail}); write it as a plain, shorter value or quote it"


def load(text: str, loader: type[BoundedLoader] = BoundedLoader) -> Any:
    """YAML text through a bounded loader; raises yaml.YAMLError (YAMLLimitError for the bounds)."""
    try:
        return yaml.load(text, Loader=loader)
    except ValueError as exc:
        raise YAMLLimitError(unreadable_value(exc)) from None


def load_file(
    path: str | os.PathLike[str], what: str = "YAML file", loader: type[BoundedLoader] = BoundedLoader
) -> Any:
    """A user's YAML file, bounded; every problem is a UserError that names the file."""
    source = os.fspath(path)
    text = read_text(source, what)
    try:
        return load(text, loader)
    except YAMLLimitError as exc:
        raise UserError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{source} is not valid YAML: {exc}\nFix the file at the place named.") from None
