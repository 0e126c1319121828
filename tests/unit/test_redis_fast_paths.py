"""The fast paths of kvctl's Redis helpers (issue #23) say exactly what their plain versions say: the
pipelined RESP encoder writes the bytes a one-command-at-a-time encoder writes, and the quick test for
LMCache's chunk names accepts only names parse_key takes for the model."""

import itertools

import pytest

from kvctl.clients.redis_tier import _command, _commands
from kvctl.core.cache.listing import _lmcache_name
from kvctl.core.lmcache.keys import KEY_DTYPES, parse_key


@pytest.mark.parametrize("suffixes", [("",), ("metadata",), ("kv_bytes", "metadata")])
def test_pipelined_commands_are_each_command_encoded_alone(suffixes):
    keys = ["m@1@0@1a@half", "m@1@0@-1234567890abcdef@bfloat16", "", "é@1@0@2@half", "名@2@1@ff@float",
            "x" * 300, "a\r\nb", "m@1@0@1a@half"]
    expected = b"".join(_command(b"UNLINK", *((key + suffix).encode() for suffix in suffixes)) for key in keys)
    assert _commands("UNLINK", keys, suffixes) == expected


def test_the_quick_chunk_name_test_never_accepts_what_parse_key_refuses():
    fields = {"world": ["0", "1", "8", "01", "-1", "12345678901", "x"], "worker": ["0", "3", "00", "-0", ""],
              "hash": ["0", "1a", "-1a", "01a", "1A", "-", "1234567890abcdef", "1234567890abcdef0", "g"],
              "dtype": [*sorted(KEY_DTYPES)[:3], "Half", "half%", ""]}
    for model in ("llama", "org/m", "llama@v2", "a.b*c", "m%"):
        written = _lmcache_name("lmcache-redis", model)
        accepted = 0
        for world, worker, chunk_hash, dtype in itertools.product(*fields.values()):
            for tail in ("", "@tag%1"):
                key = f"{model}@{world}@{worker}@{chunk_hash}@{dtype}{tail}"
                parsed = parse_key(key)
                if written(key + "metadata"):
                    accepted += 1
                    assert parsed is not None and parsed.model_name == model, key
        assert accepted  # the quick test does take LMCache's own names
    for model in (None, "", "@x"):
        assert not _lmcache_name("lmcache-redis", model)("@x@1@0@1a@halfmetadata")
    assert not _lmcache_name("mp-resp", "llama")("llama@1@0@1a@halfmetadata")
