"""What a pin set pinned through the MP coordinator, which counts pins per key and gives them no ids.

The coordinator cannot say which of its pins a set made, so kvctl keeps a ledger per coordinator and
set, `{pin_id: {file, model, tokens}}`, in its cache directory (a 0600 file). Applying the set finds
its pins there (checked against the coordinator's pinned keys: one restarted without --metadata-path
has lost them) and releases those the file no longer lists by their prompts: one unpin undoes one pin,
so other pins of the same chunks stay. Several kvctl machines applying one set each keep their own.

Two kvctl processes applying one set on one machine take turns: each holds the ledger's lock (flock on
a file beside it) while it pins and releases, reads the ledger again once it holds it, and skips what
the other did meanwhile, so neither writes over the other's records nor pins a prompt twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from kvctl.core.errors import KvctlError


class Ledger:
    def __init__(self, scope: str, set_name: str) -> None:
        from kvctl.core.common.paths import cache_dir

        digest = hashlib.sha256(scope.encode()).hexdigest()[:16]
        self.path = cache_dir() / "pin-ledgers" / digest / f"{set_name}.json"
        self.lock_path = self.path.parent / f"{set_name}.lock"
        self.entries: dict[str, dict[str, Any]] = self._read()

    @contextlib.contextmanager
    def locked(self) -> Iterator[Ledger]:
        """Hold the ledger's lock (another kvctl applying the set waits), with the entries read again
        under it; record and forget are called inside."""
        self.path.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # pin-ledgers/ too, not umask's
        self.path.parent.mkdir(exist_ok=True, mode=0o700)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.entries = self._read()
            yield self
        finally:
            os.close(fd)  # releases the lock

    def _read(self) -> dict[str, dict[str, Any]]:
        from kvctl.core.common.safe_files import require_regular

        if not self.path.exists():
            return {}
        require_regular(self.path, hint=f"remove {self.path}: kvctl writes it")
        try:
            entries = json.loads(self.path.read_text())
            if not all(isinstance(record["tokens"], list) and isinstance(record["model"], str)
                       for record in entries.values()):
                raise ValueError
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise KvctlError(f"{self.path} is not a pin set ledger kvctl can read",
                             hint="remove it; the next apply pins the set again (the coordinator counts each "
                             "pin, so unpin the set's prompts by hand first if they are still pinned)") from None
        return entries

    def record(self, pin_id: str, file: str, model: str, tokens: list[int]) -> None:
        """The time makes a pin made again (the coordinator lost it) a record another apply can tell apart."""
        self.entries[pin_id] = {"file": file, "model": model, "tokens": tokens, "pinned_at": time.time()}
        self._save()

    def forget(self, pin_id: str) -> None:
        self.entries.pop(pin_id, None)
        self._save()

    def _save(self) -> None:
        """Written whole, readable by its owner only (it holds prompts' token ids)."""
        from kvctl.core.common.safe_files import write_private

        write_private(self.path, json.dumps(self.entries))
