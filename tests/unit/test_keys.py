
import pytest

from kvctl.core.lmcache.keys import (
    KeyRecipe,
    ObjectKey,
    UnreproducibleKeys,
    chunk_bounds,
    chunk_hashes,
    dtype_name,
    inprocess_keys,
    key_string,
    kv_rank,
    parse_key,
    parse_object_key,
)


def test_chunk_bounds_drop_or_keep_the_tail():
    assert chunk_bounds(600, 256, False) == [(0, 256), (256, 512)]
    assert chunk_bounds(600, 256, True) == [(0, 256), (256, 512), (512, 600)]
    assert chunk_bounds(100, 256, False) == []


def test_reference_vector_without_vllm():
    """lmcache.md §8: tokens 0..599, chunk 256, no vLLM -> NONE_HASH 0 and hash()."""
    recipe = KeyRecipe("test/model", 256, "builtin", "0", vllm_importable=False, kv_dtype="half")
    assert inprocess_keys(list(range(600)), recipe) == ["test/model@1@0@2b763dd00afa89c8@half",
                                                       "test/model@1@0@79e62c807b48385b@half"]


def test_key_strings_round_trip_with_tags_and_slashes():
    recipe = KeyRecipe("org/model@v2", tags=(("user", "alice"), ("tier", "gold")))
    key = key_string(recipe, -0x1A6E)
    assert key == "org/model@v2@1@0@-1a6e@bfloat16@user%alice@tier%gold"
    parsed = parse_key(key)
    assert (parsed.model_name, parsed.chunk_hash, parsed.kv_dtype, parsed.tags) == (
        "org/model@v2", "-1a6e", "bfloat16", ("user%alice", "tier%gold"))
    assert parse_key("not-a-key") is None and parse_key("m@x@0@ab@half") is None


def test_unreproducible_seeds_are_refused():
    with pytest.raises(UnreproducibleKeys):
        chunk_hashes(list(range(512)), KeyRecipe("m", hash_algorithm="builtin", hash_seed=None))
    with pytest.raises(UnreproducibleKeys):
        chunk_hashes(list(range(512)), KeyRecipe("m", hash_algorithm="xxhash", hash_seed=None))
    assert chunk_hashes(list(range(512)), KeyRecipe("m", hash_algorithm="sha256", hash_seed=None))


def test_mp_names():
    assert kv_rank(2, 1) == 0x2010201 and kv_rank(1, 0) == 0x1000100
    key = ObjectKey(bytes.fromhex("ab" * 4), "/models/tiny", kv_rank(1, 0))
    assert key.fs_file_name() == "-SEP-models-SEP-tiny@0x01000100@0@abababab.data"
    assert key.native_key() == "/models/tiny@01000100@0@abababab"
    assert ObjectKey(b"\x01", "m", 1, cache_salt="s").native_key() == "m@00000001@0@01@s"



def test_mp_keys_parse_back_from_either_name_and_nothing_else_does():
    for key in (ObjectKey(bytes.fromhex("ab" * 32), "/models/tiny", kv_rank(2, 1), 3, "tenant"),
                ObjectKey(bytes(range(8)), "m", kv_rank(1, 0)),
                ObjectKey(bytes(range(16)), "m", kv_rank(1, 0))):  # xxhash's 16-byte digests
        assert parse_object_key(key.native_key()) == key == parse_object_key(key.fs_file_name())
        assert ObjectKey.from_encoded(key.encoded()) == key
    h8 = "00" * 8
    for foreign in ("README.data", "notes@a@b@c.data", "session:42", "m@00000001@0@zz", "m@1@0@ab", "@00000001@0@ab",
                    "m@00000001@0@ab@s@x", f"m@00000001@0@{h8.upper()}ff", f"m@0000000A@0@{h8}",
                    f"m@00000001@00@{h8}", f"m@00000001@0@{h8}aa", f"m@00000001@0@{h8} ", f"m@00000001@0@{h8}@a/b",
                    f"m@01000100@0@{h8}.data"):  # an fs name carries 0x before the rank
        assert parse_object_key(foreign) is None, foreign


@pytest.mark.parametrize("name", [
    "llama@1@0@session-token@bfloat16",  # the hash field is not hex
    "llama@2024@12@report@half",
    "llama@1@0@00ab@half",  # LMCache's {:x} writes no leading zero
    "llama@1@0@AB12@half",  # nor upper case
    "llama@1@0@1234567890abcdef0@half",  # nor more than 64 bits
    "llama@01@0@ab@half", "llama@0@0@ab@half", "llama@1@-0@ab@half", "llama@1@0@ab@halfish", "@1@0@ab@half",
    "llama@1@0@+ab@half", "llama@1@0@-@half",
])
def test_only_canonical_chunk_keys_parse(name):
    assert parse_key(name) is None


def test_canonical_chunk_keys_parse():
    for name, model in (("llama@1@0@-1a6e12a9bdb7fd70@half", "llama"), ("llama@v2@8@7@0@fp8_e4m3fn", "llama@v2"),
                        ("m@1@0@ffffffffffffffff@bfloat16@user%alice", "m")):
        assert parse_key(name).model_name == model


def test_dtype_names():
    assert dtype_name("torch.float16") == dtype_name("half") == "half"
    assert dtype_name("float32") == "float"
