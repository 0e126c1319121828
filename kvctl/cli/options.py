"""Choices and option types shared by every command group, so flags mean the same everywhere."""

from __future__ import annotations

from enum import Enum


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
