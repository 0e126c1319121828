"""Choices and option types shared by every command group, so flags mean the same everywhere."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


class Mode(str, Enum):
    inprocess = "inprocess"
    mp = "mp"


class HashAlgorithm(str, Enum):
    builtin = "builtin"
    sha256 = "sha256"
    sha256_cbor = "sha256_cbor"
    xxhash = "xxhash"
    xxhash_cbor = "xxhash_cbor"
    blake3 = "blake3"


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


class PrefetchTier(str, Enum):
    disk = "disk"
    redis = "redis"


class Tier(str, Enum):
    cpu = "cpu"
    disk = "disk"
    redis = "redis"
    all = "all"


InstanceOption = Annotated[str | None, typer.Option(
    "--instance", help="A running instance: a 'kvctl serve --name' or inventory name, or a URL (worker 0's internal "
    "API, or the lmcache server's HTTP API).")]
FleetInstance = Annotated[str | None, typer.Option(
    "--instance", help="'all' (every instance of the inventory), an inventory or 'kvctl serve --name' name, or a URL "
    "(worker 0's internal API, or the lmcache server's HTTP API; default: the most recent kvctl serve).")]
StateOption = Annotated[Path | None, typer.Option("--state", help="The state file of a 'kvctl serve' (default: the "
                                                  "most recent one).")]
InventoryOption = Annotated[Path | None, typer.Option(
    "--inventory", help="A kvctl.yaml fleet inventory (default: $KVCTL_INVENTORY, ./kvctl.yaml, "
    "~/.config/kvctl/kvctl.yaml).")]
TimeoutOption = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds each instance gets.")]
