"""Open the client that reads one store of a target (see kvctl.core.target.Store)."""

from __future__ import annotations

from kvctl.clients.disk_tier import DiskTier
from kvctl.clients.redis_tier import RedisTier
from kvctl.core.target import Store

# What each layout's stored names look like when listed: file suffix, or Redis SCAN pattern.
DISK_SUFFIXES = {"lmcache-disk": ".pt", "mp-fs": ".data"}
REDIS_PATTERNS = {"lmcache-redis": "*metadata", "mp-resp": "*@*@*@*"}


def open_store(store: Store) -> DiskTier | RedisTier:
    if store.layout in DISK_SUFFIXES:
        return DiskTier(store.directories, DISK_SUFFIXES[store.layout])
    return RedisTier(store.redis, REDIS_PATTERNS[store.layout])
