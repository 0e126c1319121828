"""Open the client that reads one store of a target (see kvctl.core.lmcache.deployment.Store)."""

from __future__ import annotations

from kvctl.clients.disk_tier import DiskTier
from kvctl.clients.redis_tier import RedisTier
from kvctl.core.lmcache.deployment import DISK_SUFFIXES, REDIS_PATTERNS, Store


def open_store(store: Store) -> DiskTier | RedisTier:
    if store.layout in DISK_SUFFIXES:
        return DiskTier(store.directories, DISK_SUFFIXES[store.layout])
    return RedisTier(store.redis, REDIS_PATTERNS[store.layout])
