"""Where kvctl keeps its own files (models it builds, state of what it serves)."""

from __future__ import annotations

import glob
import os
from pathlib import Path


def cache_dir() -> Path:
    """$KVCTL_CACHE_DIR, else $XDG_CACHE_HOME/kvctl, else ~/.cache/kvctl."""
    if os.environ.get("KVCTL_CACHE_DIR"):
        return Path(os.environ["KVCTL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvctl"


def config_home() -> Path:
    """$XDG_CONFIG_HOME/kvctl, else ~/.config/kvctl (where a user-wide kvctl.yaml inventory lives)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvctl"


def models_dir() -> Path:
    return cache_dir() / "models"


def model_dir_candidates(prefix: str) -> list[str]:
    """Model directories for completion: kvctl's own models, then directories matching `prefix`."""
    own = [str(path.parent) for path in sorted(models_dir().glob("*/config.json"))]
    found = [directory for directory in own if directory.startswith(prefix)]
    found += [path + os.sep for path in sorted(glob.glob(os.path.expanduser(prefix) + "*"))
              if os.path.isdir(path) and path not in own]
    return found
