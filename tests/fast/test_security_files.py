"""Files kvctl keeps that hold prompts' token ids: readable by their owner only, whatever the umask."""

from __future__ import annotations

import os
import stat

from kvctl.core.pins.ledger import Ledger


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_pin_ledgers_are_owner_only_whatever_the_umask(tmp_path, monkeypatch):
    """A ledger lists the token ids an MP pin set pinned: no other user may list, read or write them."""
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    old = os.umask(0o000)
    try:
        ledger = Ledger("http://127.0.0.1:9300", "nightly")
        with ledger.locked():
            ledger.record("pin-1", "prompt.json", "llama", [1, 2, 3])
            ledger.record("pin-2", "other.json", "llama", [4, 5, 6])
            ledger.forget("pin-1")
    finally:
        os.umask(old)
    ledgers = tmp_path / "cache" / "pin-ledgers"
    assert mode(ledgers) == mode(ledger.path.parent) == 0o700
    assert mode(ledger.path) == mode(ledger.lock_path) == 0o600
    assert sorted(path.name for path in ledger.path.parent.iterdir()) == ["nightly.json", "nightly.lock"]
