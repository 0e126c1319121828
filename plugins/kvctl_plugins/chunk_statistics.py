"""Keeps LMCache's chunk statistics from changing the cache's keys.

With `enable_chunk_statistics`, LMCache 0.5.6 wraps the scheduler's lookup client in a recorder whose
strategy builds a `ChunkedTokenDatabase` without the engine's configuration. That constructor
re-initialises the process-wide NONE_HASH, LMCache's and vLLM's, from the builtin hash. The
scheduler then hashes prompts from another first hash than the worker that stored their chunks,
and every lookup misses while the statistics count reuse. The recorder's constructor is wrapped
so that both values, and vLLM's record of their seed, are what they were before it ran. The
recorder's own hashes are only statistics, so they may differ from the cache keys.
"""

from __future__ import annotations

import functools

HASH_STATE = (("lmcache.v1.token_database", "NONE_HASH"),
              ("vllm.v1.core.kv_cache_utils", "NONE_HASH"),
              ("vllm.v1.core.kv_cache_utils", "_NONE_HASH_SEED"))
MISSING = object()  # an attribute not set before the constructor ran


def install() -> None:
    from lmcache.v1.lookup_client.record_strategies.base import RecordStrategy

    if getattr(RecordStrategy.__init__, "keeps_none_hash", False):
        return
    RecordStrategy.__init__ = keeping_none_hash(RecordStrategy.__init__)


def keeping_none_hash(constructor):
    """`constructor`, leaving the process-wide first hashes as it found them (an attribute that was not
    set yet is removed again; a module that cannot be imported, vLLM in a standalone engine, is skipped)."""

    @functools.wraps(constructor)
    def wrapped(*args, **kwargs):
        saved = [(module, attribute, getattr(module, attribute, MISSING))
                 for module, attribute in _hash_state()]
        try:
            return constructor(*args, **kwargs)
        finally:
            for module, attribute, value in saved:
                if value is MISSING:
                    if hasattr(module, attribute):
                        delattr(module, attribute)
                else:
                    setattr(module, attribute, value)

    wrapped.keeps_none_hash = True
    return wrapped


def _hash_state() -> list[tuple[object, str]]:
    import importlib

    state = []
    for name, attribute in HASH_STATE:
        try:
            state.append((importlib.import_module(name), attribute))
        except ImportError:
            continue
    return state
