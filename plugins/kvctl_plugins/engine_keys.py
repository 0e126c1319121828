"""A prompt's chunk keys as the engine makes them, in one C loop when that is provably the same.

LMCache's ChunkedTokenDatabase.process_tokens hashes chunk by chunk in Python (for sha256_cbor, cbor2 and
hashlib per chunk: ~7 ms of a 128K-token lookup). kvctl's compiled chain (kvctl/core/lmcache/_chunk_hash.c,
held equal to the Python loops by tests/property/test_chunk_hash.py) computes the same chain from the
engine's own seed. It is used only where the engine's own hash function, asked about the first and the
last chunk, gives the very hashes the chain gave; anything else (another token database, an algorithm
the chain does not know, no compiled module) goes through process_tokens as before.
"""

from __future__ import annotations

from typing import Any


def chunk_keys(engine, tokens: list[int]) -> list[tuple[int, int, Any]]:
    """(start, end, CacheEngineKey) per chunk of `tokens` (checked already), as process_tokens yields them."""
    from kvctl.core.lmcache.keys import chunk_bounds

    database = engine.token_database
    bounds = chunk_bounds(len(tokens), database.chunk_size, database.config.save_unfull_chunk)
    hashes = _compiled_hashes(database, tokens, bounds[-1][1] if bounds else 0)
    if hashes is None:
        return list(database.process_tokens(tokens=tokens))
    make_key = database._make_key_by_hash
    return [(start, end, make_key(chunk_hash)) for (start, end), chunk_hash in zip(bounds, hashes)]


def _compiled_hashes(database, tokens: list[int], stop: int) -> list[int] | None:
    """The chain's hashes of the chunks of `tokens` before `stop`, where the engine's own hash agrees."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    from kvctl.core.lmcache.keys import compiled_chain

    chain = compiled_chain(database.config.pre_caching_hash_algorithm)
    if chain is None or type(database) is not ChunkedTokenDatabase:
        return None
    first = database._get_init_hash()
    try:
        hashes = chain(first, tokens, database.chunk_size, stop)
    except (TypeError, OverflowError):
        return None
    if hashes and not _same_as_engine(database, tokens, hashes, first):
        return None
    return hashes


def _same_as_engine(database, tokens: list[int], hashes: list[int], first: int) -> bool:
    """The engine's own hash of the first and the last chunk equals the chain's."""
    size, last = database.chunk_size, len(hashes) - 1
    prefix = hashes[last - 1] if last else first
    return (database._hash_tokens(tokens[:size], first) == hashes[0]
            and database._hash_tokens(tokens[last * size:last * size + size], prefix) == hashes[last])
