"""Every LMCache-internal name kvctl's plugins rely on (LMCache 0.5.6), in one place, checked when the
plugins install: the day LMCache moves one, the engine stops at start with one line naming it and
LMCache's version, instead of a traceback inside vLLM at the first request that needs it.

A name is `module` plus a dotted attribute path inside it; what lives only on instances (a backend's
`_objects`, a registry's `_lock`) cannot be checked before an engine exists and is listed in
INSTANCE_ATTRIBUTES for the reader, beside the code that uses it.
"""

from __future__ import annotations

import importlib

IN_PROCESS = (
    ("lmcache", "torch_device_type"),  # cpu_connector: the CPU connector only where torch runs on CPU
    ("lmcache.utils", "CacheEngineKey.from_string"),  # chunk keys of requests and disk files
    ("lmcache.utils", "TORCH_DTYPE_TO_STR_DTYPE"),
    ("lmcache.utils", "EngineType.VLLM"),
    ("lmcache.utils", "_shared_observability_lock"),  # live counters read under LMCache's own lock
    ("lmcache.observability", "LMCStatsMonitor._clear"),  # totals kept across its interval resets
    ("lmcache.v1.protocol", "RemoteMetadata.deserialize"),  # the chunk header Redis and snapshots carry
    ("lmcache.v1.protocol", "init_remote_metadata_info"),
    ("lmcache.v1.protocol", "get_remote_metadata_bytes"),
    ("lmcache.v1.protocol", "REMOTE_METADATA_FMT"),
    ("lmcache.v1.memory_management", "MemoryFormat.KV_2LTD"),
    ("lmcache.v1.memory_management", "MemoryFormat.KV_MLA_FMT"),
    ("lmcache.v1.pin_monitor", "PinMonitor"),
    ("lmcache.v1.token_database", "NONE_HASH"),  # chunk statistics keep the hash seed of the engine
    ("lmcache.v1.token_database", "ChunkedTokenDatabase._get_init_hash"),  # engine_keys: the compiled chain,
    ("lmcache.v1.token_database", "ChunkedTokenDatabase._hash_tokens"),  # checked against the engine's own
    ("lmcache.v1.token_database", "ChunkedTokenDatabase._make_key_by_hash"),
    ("lmcache.v1.lookup_client.record_strategies.base", "RecordStrategy.__init__"),
    ("lmcache.v1.gpu_connector", "CreateGPUConnector"),
    ("lmcache.v1.gpu_connector.gpu_connectors", "GPUConnectorInterface"),
    ("lmcache.v1.storage_backend.local_disk_backend", "LocalDiskBackend._key_to_path"),
    ("lmcache.v1.internal_api_server.api_registry", "APIRegistry.register_all_apis"),
)
MP_SERVER = (
    ("lmcache.logging", "init_logger"),
    ("lmcache.utils", "get_size_bytes"),
    ("lmcache.v1.multiprocess.http_server", ""),  # the module whose app the routes mount on
    ("lmcache.v1.multiprocess.cache_control.key_resolver", "resolve_object_keys"),
    ("lmcache.v1.multiprocess.cache_control.key_resolver", "resolve_grouped_object_keys"),
    ("lmcache.v1.distributed.api", "ObjectKey"),
    ("lmcache.v1.distributed.storage_manager", "_L1_WRITE_TAG"),
)
INSTANCE_ATTRIBUTES = (
    "LocalCPUBackend hot_cache / get_keys (engine_ops)",
    "ChunkedTokenDatabase chunk_size, config.pre_caching_hash_algorithm / save_unfull_chunk (engine_keys)",
    "layout registry _lock / _registry, StorageManager _l1_managers_by_id, L1Manager _lock / _objects "
    "(mp_routes)",
)


class LMCacheMoved(SystemExit):
    """LMCache lacks a name the plugins use: the process stops with this one line (SystemExit prints
    it without a traceback)."""


def missing(names) -> str | None:
    """The first of `names` this LMCache lacks, as module:attribute; None when all are there."""
    for module_name, path in names:
        try:
            found = importlib.import_module(module_name)
            for part in filter(None, path.split(".")):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            return f"{module_name}:{path}" if path else module_name
    return None


def require(names) -> None:
    """Stop the process in one line when LMCache lacks one of `names`."""
    lacking = missing(names)
    if lacking is not None:
        raise LMCacheMoved(f"kvctl plugins: LMCache {_version()} has no {lacking}, which they rely on "
                           "(written for LMCache 0.5.6); hint: install lmcache==0.5.6, or a kvctl made for "
                           "this LMCache")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lmcache")
    except PackageNotFoundError:
        return "(not installed)"
