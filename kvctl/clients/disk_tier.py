"""The disk tiers, read from the file system: LMCache's local disk directory (files named after
the chunk keys) and the MP server's fs L2 adapter directory."""

from __future__ import annotations

import os
from collections.abc import Sequence
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

    def path_of(self, file_name: str) -> Path | None:
        for directory in self.directories:
            if (directory / file_name).exists():
                return directory / file_name
        return None
