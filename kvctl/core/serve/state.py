"""Where a `kvctl serve` records itself (its state file), and reading it back: every other command finds a
running instance there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvctl.core.common.paths import cache_dir
from kvctl.core.errors import KvctlError


def serve_dir(name: str) -> Path:
    return cache_dir() / "serve" / name


def default_state_file() -> Path:
    """Where the most recent `kvctl serve` records itself; every other command reads it by default."""
    return cache_dir() / "serve" / "state.json"


def named_state_file(name: str) -> Path:
    """Where `kvctl serve --name NAME` records itself, for `--instance NAME`."""
    return serve_dir(name) / "state.json"


def read_state(path: Path | None = None, instance: str | None = None) -> dict[str, Any]:
    """The state of a `kvctl serve`: by instance name, by state file, or the most recent one; a file of
    another shape (hand-made, torn, hostile) is one line, never a traceback later."""
    from kvctl.core.common.safe_files import read_text

    path = named_state_file(instance) if instance else (path or default_state_file())
    if not path.exists():
        if instance:
            raise KvctlError(f"no running instance named {instance!r}",
                             hint=f"start it with 'kvctl serve --name {instance}', or pass --instance URL")
        raise KvctlError(f"no kvctl serve state at {path}", hint="start one with 'kvctl serve', or pass --instance URL")
    not_state = KvctlError(f"{path} is not a kvctl state file", hint="pass --state with the file kvctl serve wrote")
    try:
        state = json.loads(read_text(path))
    except (ValueError, RecursionError):
        raise not_state from None
    if not isinstance(state, dict) or not isinstance(state.get("endpoints", {}), dict) or not all(
            _plain(value) for value in state.get("endpoints", {}).values()) or not all(
            isinstance(state.get(key), str | None) for key in ("name", "mode", "config_dir", "model")) or not all(
            isinstance(process, dict) for process in state.get("processes", [])):
        raise not_state
    return state


def _plain(value: Any) -> bool:
    """An endpoint as kvctl serve writes it: an address, a list of them, or none."""
    return value is None or isinstance(value, str) or (isinstance(value, list)
                                                      and all(isinstance(item, str) for item in value))
