"""The disk tiers, read from the file system: LMCache's local disk directory (files named after
the chunk keys) and the MP server's fs L2 adapter directory.

kvctl stages the chunks it loads into a directory under hidden partial names (renamed once all are
written) while it holds a shared lock on the directory itself; a partial file found while nobody holds
that lock was left by a load that was killed, and is stale."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvctl.core.errors import KvctlError, UnreachableError


class DiskTier:
    def __init__(self, directories: Sequence[str | os.PathLike], suffix: str) -> None:
        self.directories = [Path(directory) for directory in directories]
        self.suffix = suffix
        self._names: set[str] | None = None

    def names(self) -> set[str]:
        """Names of the files (and links) in the tier's directories, never subdirectories (listed once; a
        missing directory holds nothing yet)."""
        if self._names is None:
            names: set[str] = set()
            for directory in self.directories:
                try:
                    with os.scandir(directory) as entries:
                        names.update(entry.name for entry in entries if entry.name.endswith(self.suffix)
                                     and (entry.is_symlink() or entry.is_file(follow_symlinks=False)))
                except FileNotFoundError:
                    continue
                except PermissionError:
                    raise KvctlError(f"cannot read the disk tier directory {directory}: permission denied",
                                     hint="run kvctl as a user that can read it") from None
                except OSError as error:
                    raise UnreachableError(f"cannot read the disk tier directory {directory}: {error.strerror}",
                                           hint="check the mount") from None
            self._names = names
        return self._names

    def exists(self, file_names: Sequence[str]) -> list[bool]:
        present = self.names()
        return [name in present for name in file_names]

    def stored_names(self, limit: int) -> list[str]:
        """Stored names without the suffix, for diagnosis and listing."""
        return [name[: -len(self.suffix)] for name in sorted(self.names())[:limit]]

    def usage(self) -> int:
        """Bytes the tier's files hold, what LMCache counts against its budget (links count as links)."""
        total = 0
        for directory in self.directories:
            for name in self.names():
                with contextlib.suppress(FileNotFoundError):
                    total += (directory / name).lstat().st_size
        return total


PARTIAL_SUFFIX = ".kvctl-partial"


def partial_name(file_name: str) -> str:
    """A fresh hidden name to stage `file_name` under (LMCache lists only names with its suffix)."""
    return f".{file_name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}"


def is_partial(name: str) -> bool:
    return name.startswith(".") and name.endswith(PARTIAL_SUFFIX)


@contextlib.contextmanager
def staging(directory: str | os.PathLike) -> Iterator[None]:
    """Held while partial files are written into `directory` and renamed: a shared lock on the
    directory, so a cleaner (stale_partials) leaves them alone. A file system without locks stages
    unlocked, and there the cleaner finds nothing stale either."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def stale_partials(directory: str | os.PathLike) -> Iterator[list[Path] | None]:
    """The partial files in `directory` no kvctl load is writing (sorted), with the directory locked
    against a new load while held; None when a load is writing there now, or the directory cannot be
    locked (then none is known to be stale). A missing directory holds none."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError as error:
        raise KvctlError(f"cannot read the disk tier directory {directory}: {error.strerror}",
                         hint="run kvctl as a user that can read it") from None
    if fd is None:
        yield []
        return
    try:
        locked = _locked(fd)
        if locked:
            with os.scandir(directory) as entries:
                found = sorted(Path(entry.path) for entry in entries
                               if is_partial(entry.name) and entry.is_file(follow_symlinks=False))
        yield found if locked else None
    finally:
        os.close(fd)


def _locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a load (or no locks on this file system)
        return False
    return True
