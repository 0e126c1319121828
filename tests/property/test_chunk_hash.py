"""The compiled chunk-hash chain (kvctl/core/lmcache/_chunk_hash.c) gives the keys the Python loops give,
which test_keys_match_lmcache holds against LMCache's own ChunkedTokenDatabase: for every CBOR width of
an integer, partial chunks, integers past 64 bits and tokens that are not ints (those take cbor2's path)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.core.lmcache import keys

# the boundaries of CBOR's integer heads (1, 2, 3, 5 and 9 bytes), both signs, and beyond 64 bits
EDGES = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
         -1, -24, -25, -256, -257, -(2**63), -(2**64)]
TOKEN = st.one_of(st.sampled_from(EDGES), st.integers(0, 300_000), st.integers(-(2**70), 2**70))
ALGORITHMS = ("builtin", "sha256_cbor", "xxhash_cbor")


def test_the_setup_built_the_compiled_chain():
    assert keys._chunk_hash is not None, "scripts/setup (pip install -e .) did not compile _chunk_hash.c"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(tokens=st.lists(TOKEN, max_size=300), size=st.sampled_from([1, 3, 23, 24, 256, 257]),
       save_unfull_chunk=st.booleans(), as_tuple=st.booleans())
def test_compiled_and_python_chains_agree(monkeypatch, algorithm, tokens, size, save_unfull_chunk, as_tuple):
    recipe = keys.KeyRecipe("m", size, algorithm, "0", save_unfull_chunk=save_unfull_chunk)
    sequence = tuple(tokens) if as_tuple else tokens
    compiled = keys.chunk_hashes(sequence, recipe)
    with monkeypatch.context() as patch:
        patch.setattr(keys, "_chunk_hash", None)
        assert keys.chunk_hashes(sequence, recipe) == compiled


@pytest.mark.parametrize("odd", [[True, 1], [1.0], ["7"], [2**64], [-(2**64) - 1]])
def test_what_the_compiled_chain_does_not_take_is_hashed_as_lmcache_would(monkeypatch, odd):
    recipe = keys.KeyRecipe("m", 1, "sha256_cbor", "0")
    compiled = keys.chunk_hashes(odd, recipe)
    monkeypatch.setattr(keys, "_chunk_hash", None)
    assert compiled == keys.chunk_hashes(odd, recipe)
