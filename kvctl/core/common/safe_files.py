"""Reading the files users hand kvctl without letting one hang it or eat its memory: only regular files
of at most 1 MiB (a FIFO is never opened for reading, a device never read), and YAML whose aliases
cannot expand into a "billion laughs".
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from kvctl.core.common.display import PATH_CHARS, shown
from kvctl.core.errors import KvctlError

MAX_FILE_BYTES = 1 << 20  # configuration files and inventories are a few KB
MAX_YAML_NODES = 10_000  # values once aliases are expanded; kvctl's own files have tens
MAX_YAML_DEPTH = 64  # nesting, aliases expanded; deeper structures overflow Python's recursion later
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def require_regular(path: Path, info: os.stat_result | None = None,
                    hint: str = "give the configuration file itself (kvctl reads only regular files)") -> None:
    """Refuse what is not a regular file (a FIFO would hang a reader, a device never ends)."""
    info = os.stat(path) if info is None else info
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise KvctlError(f"{shown(str(path), PATH_CHARS)} is {kind}, not a regular file", hint=hint)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` whole and readable by its owner only: into a temporary file beside it
    (created 0600 by mkstemp, never through a link), then renamed over it; gone again if that fails.
    An OSError is the caller's to word."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _check_regular(path: Path, info: os.stat_result) -> None:
    require_regular(path, info)
    if info.st_size > MAX_FILE_BYTES:
        raise _too_large(path, f"is {info.st_size} bytes,")


def _too_large(path: Path, size: str) -> KvctlError:
    return KvctlError(f"{shown(str(path), PATH_CHARS)} {size} more than the {MAX_FILE_BYTES >> 20} MiB kvctl reads "
                      "from a configuration file", hint="configuration files are a few KB: check that this is the "
                      "right file")


def read_bytes(path: Path) -> bytes:
    """The contents of a regular file of at most MAX_FILE_BYTES, else one clear KvctlError."""
    try:
        _check_regular(path, os.stat(path))  # before opening: opening a FIFO for reading waits for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            _check_regular(path, os.fstat(handle.fileno()))  # replaced between the stat and the open
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise KvctlError(f"cannot read {shown(str(path), PATH_CHARS)}: {error.strerror}",
                         hint="check the path and its permissions") from None
    if len(data) > MAX_FILE_BYTES:  # it grew after the check
        raise _too_large(path, "grew to")
    return data


def read_text(path: Path) -> str:
    """A configuration file as text: bounded as `read_bytes`, and refused when binary or not UTF-8."""
    data = read_bytes(path)
    if b"\0" in data:
        raise KvctlError(f"{shown(str(path), PATH_CHARS)} is a binary file, not a configuration",
                         hint="give the YAML/JSON text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise KvctlError(f"{shown(str(path), PATH_CHARS)} is not UTF-8 text", hint="save the file as UTF-8") from None


class _OverBudget(Exception):
    """YAML that would expand beyond the node or depth budget (an alias bomb, a recursive alias)."""


_TOO_LARGE = f"expands to more than {MAX_YAML_NODES} YAML values or {MAX_YAML_DEPTH} levels of nesting"


@cache
def _loader_class():
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        """SafeLoader that stops composing past the node and depth budgets, before any value is built."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.composed = 0
            self.depth = 0

        def compose_node(self, parent, index):
            self.composed += 1
            self.depth += 1
            if self.composed > MAX_YAML_NODES or self.depth > MAX_YAML_DEPTH:
                raise _OverBudget(_TOO_LARGE)
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return BoundedLoader


def _children(node) -> list:
    if isinstance(node.value, list):  # a sequence of nodes, or a mapping's (key, value) pairs
        return [part for item in node.value for part in (item if isinstance(item, tuple) else (item,))]
    return []


def _check_expansion(root) -> None:
    """Walk the node graph once (shared by aliases), counting each node as often as aliases repeat it."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes, depth) once expanded
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            sizes = [measured[id(child)] for child in _children(node)]
            nodes, depth = 1 + sum(size for size, _ in sizes), 1 + max((depth for _, depth in sizes), default=0)
            if nodes > MAX_YAML_NODES or depth > MAX_YAML_DEPTH:
                raise _OverBudget(_TOO_LARGE)
            measured[id(node)] = (nodes, depth)
            on_path.discard(id(node))
        elif id(node) not in measured:
            if id(node) in on_path:
                raise _OverBudget("has a recursive YAML alias")
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))


def load_yaml(text: str, source: str) -> Any:
    """yaml.safe_load with budgets: more than MAX_YAML_NODES values or MAX_YAML_DEPTH levels once aliases
    are expanded, or a recursive alias, is one KvctlError naming `source`; syntax errors stay yaml.YAMLError."""
    loader = _loader_class()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except ValueError as error:  # a value Python refuses to build (an integer of 5000 digits, a 13th month)
        import yaml

        raise yaml.constructor.ConstructorError(problem=str(error)) from None
    except _OverBudget as error:
        raise KvctlError(f"{shown(source, PATH_CHARS)} {error}",
                         hint="write the values out: kvctl refuses YAML that aliases blow up (alias bombs)") from None
    finally:
        loader.dispose()


def load_yaml_file(path: Path) -> Any:
    """A YAML file read with every bound above (for kvctl.yaml inventories and configuration files)."""
    return load_yaml(read_text(path), str(path))
