"""Chunk keys exactly as LMCache 0.5.6 makes them, for both modes.

In-process (ChunkedTokenDatabase + CacheEngineKey):
    prefix = NONE_HASH; for each chunk: prefix = fold(H((prefix, tuple(chunk), ())))
    key = "{model}@{world_size}@{worker_id}@{prefix:x}@{dtype}[@{tag}%{value}…]"
  H is vLLM's hash function of that name (sha256 = pickle + SHA-256, sha256_cbor = canonical CBOR +
  SHA-256, xxhash[_cbor] = XXH3-128) or Python's hash() ("builtin", and any name when vLLM is not
  importable in the engine process); fold keeps the first 8 bytes of a digest as a big-endian int.
  NONE_HASH is 0 without vLLM; with vLLM it is fold(H(seed)), the seed being PYTHONHASHSEED, or when
  that is unset "vllm-none-hash" for the SHA-256 functions (random per process otherwise).

MP (TokenHasher + ObjectKey): blake3 over prefix bytes ‖ big-endian uint32 tokens, NONE_HASH =
H(0, (0,)); only complete chunks; one key per rank, kv_rank = ws<<24 | rank<<16 | lws<<8 | lrank.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, NamedTuple

from kvctl_plugins.wire import MP_HASH_BYTES

from kvctl.core.errors import KvctlError, UsageError

try:
    from kvctl.core.lmcache import _chunk_hash  # compiled at install (pyproject's ext-modules)
except ImportError:  # no C compiler where kvctl was installed: the same keys, computed more slowly
    _chunk_hash = None

INPROCESS_ALGORITHMS = ("builtin", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
MP_ALGORITHMS = ("blake3", "sha256_cbor")  # builtin exists but cannot give stable keys
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED
CRYPTO_ALGORITHMS = ("sha256", "sha256_cbor")
DTYPE_NAMES = {  # torch dtype name -> LMCache's key spelling (TORCH_DTYPE_TO_STR_DTYPE)
    "float16": "half", "half": "half", "bfloat16": "bfloat16", "float32": "float", "float": "float",
    "float64": "double", "double": "double", "int8": "int8", "uint8": "uint8", "int16": "int16",
    "int32": "int32", "int64": "int64", "bool": "bool", "float8_e4m3fn": "fp8_e4m3fn",
    "float8_e4m3fnuz": "fp8_e4m3fnuz", "float8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_e5m2fnuz",
}


class UnreproducibleKeys(KvctlError):
    """The serving process hashes with a seed that no other process can know."""


@dataclass(frozen=True)
class KeyRecipe:
    """Everything an in-process LMCache engine puts into a chunk key."""

    model_name: str
    chunk_size: int = 256
    hash_algorithm: str = "builtin"
    hash_seed: str | None = "0"  # PYTHONHASHSEED of the serving process; None when unset
    vllm_importable: bool = True  # vLLM present in the engine process (always so inside vLLM)
    save_unfull_chunk: bool = False
    world_size: int = 1
    worker_id: int = 0
    kv_dtype: str = "bfloat16"  # LMCache's spelling, see dtype_name()
    tags: tuple[tuple[str, str], ...] = field(default=())

    def for_worker(self, worker_id: int) -> KeyRecipe:
        return replace(self, worker_id=worker_id)


def dtype_name(dtype: str) -> str:
    """LMCache's key spelling of a dtype given as `torch.float16`, `float16`, `half`, …"""
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise KvctlError(f"unknown KV dtype {dtype!r}", hint="use one of " + ", ".join(sorted(DTYPE_NAMES)))
    return DTYPE_NAMES[name]


def stored_end(num_tokens: int, chunk_size: int, save_unfull_chunk: bool) -> int:
    """Where the chunks LMCache stores for a prompt of `num_tokens` tokens end (a partial one only if saved)."""
    return num_tokens if save_unfull_chunk else num_tokens - num_tokens % chunk_size


def chunk_bounds(num_tokens: int, chunk_size: int, save_unfull_chunk: bool) -> list[tuple[int, int]]:
    """(start, end) of each chunk LMCache stores for a prompt of `num_tokens` tokens."""
    end = stored_end(num_tokens, chunk_size, save_unfull_chunk)
    return [(start, min(start + chunk_size, num_tokens)) for start in range(0, end, chunk_size)]


# -- in-process hashing ------------------------------------------------------------------------


def _fold(value: int | bytes) -> int:
    return int.from_bytes(value[:8], "big") if isinstance(value, bytes) else value


def _hash_function(algorithm: str, vllm_importable: bool):
    """The function LMCache resolves for `algorithm`: bytes-returning vLLM functions, or hash()."""
    if not vllm_importable or algorithm == "builtin":
        return hash
    if algorithm not in INPROCESS_ALGORITHMS:
        return hash  # LMCache falls back to Python's hash for names vLLM does not know
    import hashlib
    import pickle

    if algorithm == "sha256":
        return lambda data: hashlib.sha256(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algorithm == "xxhash":
        import xxhash

        return lambda data: xxhash.xxh3_128_digest(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
    import cbor2

    digest = _cbor_digest(algorithm)
    return lambda data: digest(cbor2.dumps(data, canonical=True))


def _cbor_digest(algorithm: str):
    """What the CBOR algorithms apply to the encoded tuple (None for the others)."""
    if algorithm == "sha256_cbor":
        import hashlib

        sha256 = hashlib.sha256
        return lambda encoded: sha256(encoded).digest()
    if algorithm == "xxhash_cbor":
        import xxhash

        return xxhash.xxh3_128_digest
    return None


def compiled_chain(algorithm: str):
    """The compiled chain (_chunk_hash.c) for an in-process algorithm, f(first prefix, tokens, chunk size,
    stop) -> the chunk hashes (TypeError or OverflowError for tokens it cannot take); None when it was not
    built or does not know the algorithm. kvctl's plugins use it inside the engine too (engine_keys.py)."""
    if _chunk_hash is None:
        return None
    if algorithm == "builtin":
        return _chunk_hash.builtin_chain
    digest = _cbor_digest(algorithm)
    if digest is None:
        return None
    return lambda prefix, tokens, size, stop: _chunk_hash.cbor_chain(prefix, tokens, size, stop, digest)


@lru_cache(maxsize=32)
def builtin_str_hash(text: str, seed: str) -> int:
    """Python's hash() of a string in a process started with PYTHONHASHSEED=seed.

    Always a child interpreter: this process's own seed cannot be read back (the environment
    variable may have changed since it started).
    """
    done = subprocess.run([sys.executable, "-S", "-c", "import sys; print(hash(sys.argv[1]))", text],
                          capture_output=True, text=True, env={"PYTHONHASHSEED": seed}, check=True)
    return int(done.stdout)


def none_hash(recipe: KeyRecipe) -> int:
    """The first prefix of the chain, as the serving process computes it."""
    if not recipe.vllm_importable:
        return 0
    algorithm = recipe.hash_algorithm if recipe.hash_algorithm in INPROCESS_ALGORITHMS else "builtin"
    seed = recipe.hash_seed
    if seed is None:
        if algorithm in CRYPTO_ALGORITHMS:
            seed = VLLM_DEFAULT_SEED
        else:
            raise UnreproducibleKeys(
                f"the serving process runs without PYTHONHASHSEED and hashes with {algorithm}: its chunk keys "
                "use a random seed that no other process can know",
                hint="restart it with PYTHONHASHSEED=0 (kvctl config init writes it to env.sh), or use sha256_cbor")
    if algorithm == "builtin":
        if seed == "random":
            raise UnreproducibleKeys("PYTHONHASHSEED=random makes hash() keys unreproducible",
                                     hint="set PYTHONHASHSEED to a number, e.g. 0")
        return builtin_str_hash(seed, seed)
    return _fold(_hash_function(algorithm, True)(seed))


def chunk_hashes(tokens: Sequence[int], recipe: KeyRecipe) -> list[int]:
    """The prefix-chained hash of every stored chunk of `tokens`.

    The compiled chain (_chunk_hash.c) when it was built and can take the tokens; otherwise one loop per
    kind of hash, with no call of ours per chunk: a 128K-token prompt is 512 chunks."""
    hash_function = _hash_function(recipe.hash_algorithm, recipe.vllm_importable)
    size = recipe.chunk_size
    stop = stored_end(len(tokens), size, recipe.save_unfull_chunk)
    prefix = none_hash(recipe)
    if (chain := compiled_chain("builtin" if hash_function is hash else recipe.hash_algorithm)) is not None:
        try:
            return chain(prefix, tokens, size, stop)
        except (TypeError, OverflowError):
            pass  # not a list of ints, or an integer beyond 64 bits: cbor2 and the loops below know those
    hashes = []
    append = hashes.append
    if hash_function is hash:  # ints all along: nothing to fold
        for start in range(0, stop, size):
            prefix = hash((prefix, tuple(tokens[start:start + size]), ()))
            append(prefix)
        return hashes
    from_bytes = int.from_bytes
    for start in range(0, stop, size):
        prefix = from_bytes(hash_function((prefix, tuple(tokens[start:start + size]), ()))[:8], "big")
        append(prefix)
    return hashes


def _key_affixes(recipe: KeyRecipe) -> tuple[str, str]:
    """What CacheEngineKey.to_string() writes before and after the chunk hash."""
    tags = "".join(f"@{tag}%{value}" for tag, value in recipe.tags)
    return f"{recipe.model_name}@{recipe.world_size}@{recipe.worker_id}@", f"@{recipe.kv_dtype}{tags}"


def key_string(recipe: KeyRecipe, chunk_hash: int) -> str:
    """CacheEngineKey.to_string(): what the disk tier names its files after and Redis its keys."""
    head, tail = _key_affixes(recipe)
    return f"{head}{chunk_hash:x}{tail}"


def inprocess_keys(tokens: Sequence[int], recipe: KeyRecipe) -> list[str]:
    head, tail = _key_affixes(recipe)
    return [f"{head}{chunk_hash:x}{tail}" for chunk_hash in chunk_hashes(tokens, recipe)]


def disk_file_name(key: str) -> str:
    """LocalDiskBackend's file name for a key."""
    return key.replace("/", "-") + ".pt"


class ParsedKey(NamedTuple):  # a tuple, not a frozen dataclass: built once per stored name a tier lists
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: str
    kv_dtype: str
    tags: tuple[str, ...] = ()


KEY_DTYPES = frozenset(DTYPE_NAMES.values())  # parse_key runs once per stored name when a tier is listed
# How LMCache writes the fields: "{:d}" integers (no sign, no leading zero) and "{:x}" of a 64-bit hash
# (lowercase, no leading zero, a sign only for Python's builtin hash). Anything else is not its key.
CANONICAL_COUNT = re.compile(r"0|[1-9][0-9]{0,9}").fullmatch
CANONICAL_HASH = re.compile(r"-?(?:0|[1-9a-f][0-9a-f]{0,15})").fullmatch


def parse_key(text: str) -> ParsedKey | None:
    """Reverse of key_string; None unless every field is what LMCache writes, so that a foreign name
    that merely looks alike (`llama@2024@12@report@halfmetadata`) is never taken for a chunk."""
    parts = text.split("@")
    tags: list[str] = []
    while len(parts) > 5 and "%" in parts[-1]:
        tags.insert(0, parts.pop())
    if len(parts) < 5 or not parts[0]:
        return None
    world_size, worker_id, chunk_hash, dtype = parts[-4:]
    if not (dtype in KEY_DTYPES and CANONICAL_COUNT(world_size) and world_size != "0" and CANONICAL_COUNT(worker_id)
            and CANONICAL_HASH(chunk_hash)):
        return None
    return ParsedKey("@".join(parts[:-4]), int(world_size), int(worker_id), chunk_hash, dtype, tuple(tags))


def key_of_rank(key: str, rank: int) -> str:
    """The same chunk's key on another tensor-parallel rank (only the worker id differs)."""
    parsed = parse_key(key)
    return "@".join([parsed.model_name, str(parsed.world_size), str(rank), parsed.chunk_hash, parsed.kv_dtype,
                     *parsed.tags])


# -- MP mode -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MPKeyRecipe:
    model_name: str
    chunk_size: int = 256
    hash_algorithm: str = "blake3"
    hash_seed: str | None = "0"  # only for builtin/sha256_cbor, which take NONE_HASH from vLLM
    world_size: int = 1
    cache_salt: str = ""
    object_group_id: int = 0


def kv_rank(world_size: int, global_rank: int, local_world_size: int | None = None,
            local_rank: int | None = None) -> int:
    local_world_size = world_size if local_world_size is None else local_world_size
    local_rank = global_rank if local_rank is None else local_rank
    return (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank


def _mp_hash_function(algorithm: str):
    if algorithm == "blake3":
        import blake3

        def blake3_hash(args) -> bytes:
            prefix, tokens, _ = args
            hasher = blake3.blake3()
            hasher.update(prefix if isinstance(prefix, bytes) else prefix.to_bytes(8, "big", signed=True))
            hasher.update(struct.pack(f">{len(tokens)}I", *tokens))
            return hasher.digest()

        return blake3_hash
    return _hash_function(algorithm, True)


MP_BUILTIN_UNREPRODUCIBLE = (
    "the MP server's builtin hash covers hash(None), which Python 3.11 derives from a memory address: "
    "its keys change with every server process")


def mp_chunk_hashes(tokens: Sequence[int], recipe: MPKeyRecipe) -> list[bytes]:
    """TokenHasher.compute_chunk_hashes: complete chunks only, raw hash values as bytes."""
    if recipe.hash_algorithm == "builtin":
        raise UnreproducibleKeys(MP_BUILTIN_UNREPRODUCIBLE,
                                 hint="run the server with --hash-algorithm blake3 (the default)")
    hash_function = _mp_hash_function(recipe.hash_algorithm)
    if recipe.hash_algorithm == "blake3":
        prefix = hash_function((0, (0,), None))
    else:  # vLLM's NONE_HASH, not folded: H(seed)
        prefix = hash_function(recipe.hash_seed if recipe.hash_seed is not None else VLLM_DEFAULT_SEED)
    hashes = []
    for start, end in chunk_bounds(len(tokens), recipe.chunk_size, save_unfull_chunk=False):
        prefix = hash_function((prefix, tuple(tokens[start:end]), None))
        hashes.append(prefix if isinstance(prefix, bytes) else prefix.to_bytes(8, "big", signed=True))
    return hashes


@dataclass(frozen=True)
class ObjectKey:
    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""

    def fs_file_name(self) -> str:
        """The MP server's fs L2 adapter file name."""
        base = (f"{self.model_name.replace('/', '-SEP-')}@{self.kv_rank:#010x}@{self.object_group_id:x}"
                f"@{self.chunk_hash.hex()}")
        return f"{base}@{self.cache_salt}.data" if self.cache_salt else f"{base}.data"

    def native_key(self) -> str:
        """The key the resp / valkey L2 adapters store under."""
        base = f"{self.model_name}@{self.kv_rank:08x}@{self.object_group_id:x}@{self.chunk_hash.hex()}"
        return f"{base}@{self.cache_salt}" if self.cache_salt else base

    def encoded(self) -> dict:
        """EncodedObjectKey, as the MP server's HTTP API takes it."""
        return {"chunk_hash_hex": self.chunk_hash.hex(), "model_name": self.model_name, "kv_rank": self.kv_rank,
                "object_group_id": self.object_group_id, "cache_salt": self.cache_salt}

    @classmethod
    def from_encoded(cls, encoded: dict) -> ObjectKey:
        return cls(bytes.fromhex(encoded["chunk_hash_hex"]), encoded["model_name"], encoded["kv_rank"],
                   encoded.get("object_group_id", 0), encoded.get("cache_salt", ""))


def mp_object_keys(tokens: Sequence[int], recipe: MPKeyRecipe) -> list[list[ObjectKey]]:
    """Per chunk, one ObjectKey per rank (token-addressed APIs use local = global rank)."""
    ranks = [kv_rank(recipe.world_size, rank) for rank in range(recipe.world_size)]
    return [[ObjectKey(chunk_hash, recipe.model_name, rank, recipe.object_group_id, recipe.cache_salt)
             for rank in ranks]
            for chunk_hash in mp_chunk_hashes(tokens, recipe)]


MP_RANK = re.compile(r"[0-9a-f]{8}").fullmatch
MP_GROUP = re.compile(r"0|[1-9a-f][0-9a-f]{0,7}").fullmatch
MP_HASH = re.compile("|".join(f"[0-9a-f]{{{2 * size}}}" for size in MP_HASH_BYTES)).fullmatch
MP_SALT = re.compile(r"[^@/\\\x00]{1,128}").fullmatch


def parse_object_key(text: str) -> ObjectKey | None:
    """Reverse of native_key and fs_file_name (either form); None unless every field is what the MP
    server writes, so that stray files and foreign Redis keys that look alike are never taken for chunks."""
    fs_form = text.endswith(".data")
    parts = text.removesuffix(".data").split("@")
    for fields in (3, 4):  # read from the right: a model name may itself contain '@'
        if len(parts) <= fields:
            continue
        model, (rank, group, chunk_hash, *salted) = "@".join(parts[:-fields]), parts[-fields:]
        salt = salted[0] if salted else ""
        if fs_form:
            if not rank.startswith("0x"):
                continue
            model, rank = model.replace("-SEP-", "/"), rank[2:]
        if model and MP_RANK(rank) and MP_GROUP(group) and MP_HASH(chunk_hash) and (not salted or MP_SALT(salt)):
            return ObjectKey(bytes.fromhex(chunk_hash), model, int(rank, 16), int(group, 16), salt)
    return None


def prompt_chunk_keys(tokens: Sequence[int], recipe: KeyRecipe | MPKeyRecipe) -> list[dict[str, Any]]:
    """Per chunk of a prompt: its token range and the key of every rank (MP: every kv rank's object),
    as `kvctl keys` prints them."""
    bounds = chunk_bounds(len(tokens), recipe.chunk_size, getattr(recipe, "save_unfull_chunk", False))
    if isinstance(recipe, MPKeyRecipe):
        per_chunk = [[key.native_key() for key in ranks] for ranks in mp_object_keys(tokens, recipe)]
    else:
        per_chunk = [[key_string(recipe.for_worker(worker), chunk_hash) for worker in range(recipe.world_size)]
                     for chunk_hash in chunk_hashes(tokens, recipe)]
    return [{"index": i, "start": start, "end": end, "keys": ranks}
            for i, ((start, end), ranks) in enumerate(zip(bounds, per_chunk))]


def given_chunk_keys(keys: Sequence[str]) -> list[str]:
    """Chunk keys a user typed, each once; refused unless every one is canonical (a typo must not
    select nothing silently, nor something else)."""
    bad = [key for key in keys if parse_key(key) is None]
    if bad:
        raise UsageError(f"not an LMCache chunk key: {bad[0]!r}",
                         hint="keys read model@world_size@worker@hash@dtype; kvctl ls and kvctl keys print them")
    return list(dict.fromkeys(keys))


def given_object_keys(keys: Sequence[str]) -> list[ObjectKey]:
    """MP object keys a user typed, each once; refused unless every one is canonical."""
    parsed = [parse_object_key(key) for key in keys]
    bad = [key for key, found in zip(keys, parsed) if found is None]
    if bad:
        raise UsageError(f"not an MP chunk key: {bad[0]!r}",
                         hint="MP keys read model@kv_rank@group@hash[@salt]; kvctl ls and kvctl keys print them")
    return list(dict.fromkeys(parsed))
