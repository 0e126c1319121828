"""Which chunks of a prompt are cached, on which tier, how many tokens vLLM would get, and why not.

Stores answer presence questions for the exact names LMCache writes (file names, Redis keys); a
chunk is in a tier when every tensor-parallel rank's object is there. The overall hit count follows
LMCache's StorageManager.batched_contains: walk the tiers in LMCache's order (cpu, disk, remote),
take each tier's prefix of the chunks still missing, and continue with the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import singledispatch
from typing import Any, Protocol

from kvctl_plugins.wire import TIER_ORDER  # LMCache's tier order and hit rule, shared with the routes
from kvctl_plugins.wire import hit_tokens as wire_hit_tokens

from kvctl.core.errors import KvctlError, tier_error
from kvctl.core.lmcache.deployment import Store, Target
from kvctl.core.lmcache.keys import (
    INPROCESS_ALGORITHMS,
    KeyRecipe,
    MPKeyRecipe,
    UnreproducibleKeys,
    chunk_bounds,
    chunk_hashes,
    disk_file_name,
    key_string,
    mp_object_keys,
    parse_key,
    parse_object_key,
)

SCAN_LIMIT = 20000
ALTERNATIVE_CHUNK_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


class Source(Protocol):
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    def stored_names(self, limit: int) -> list[str]: ...


@dataclass
class Chunk:
    index: int
    start: int
    end: int
    key: str
    tiers: list[str] = field(default_factory=list)


@dataclass
class Diagnostic:
    cause: str
    message: str
    hint: str | None = None


@dataclass
class LookupResult:
    model: str
    mode: str
    chunk_size: int
    prompt_tokens: int
    chunks: list[Chunk]
    hit_tokens: dict[str, int]
    tiers_checked: list[str]
    errors: dict[str, str] = field(default_factory=dict)
    diagnostics: list[Diagnostic] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "mode": self.mode, "chunk_size": self.chunk_size, "prompt_tokens": self.prompt_tokens,
            "chunks": [{"index": c.index, "start": c.start, "end": c.end, "key": c.key, "tiers": c.tiers}
                       for c in self.chunks],
            "hit_tokens": self.hit_tokens, "tiers_checked": self.tiers_checked, "errors": self.errors,
            "diagnostics": [{"cause": d.cause, "message": d.message, "hint": d.hint} for d in self.diagnostics],
        }


# -- names per store ----------------------------------------------------------------------------


def names_for(store: Store, recipe: KeyRecipe | MPKeyRecipe, tokens: Sequence[int]) -> list[list[str]]:
    """Per chunk, the names this store holds for it (one per rank)."""
    if isinstance(recipe, MPKeyRecipe):
        keys = mp_object_keys(tokens, recipe)
        if store.layout == "mp-fs":
            return [[key.fs_file_name() for key in ranks] for ranks in keys]
        return [[key.native_key() for key in ranks] for ranks in keys]
    hashes = chunk_hashes(tokens, recipe)
    per_rank = [[key_string(recipe.for_worker(worker), h) for h in hashes] for worker in range(recipe.world_size)]
    chunk_keys = list(zip(*per_rank)) if per_rank else []
    if store.layout == "lmcache-disk":
        return [[disk_file_name(key) for key in ranks] for ranks in chunk_keys]
    return [[key + "metadata" for key in ranks] for ranks in chunk_keys]


def display_keys(target: Target, tokens: Sequence[int]) -> list[str]:
    """One key per chunk for people and scripts: rank 0's CacheEngineKey, or the MP chunk hash."""
    recipe = target.recipe
    if isinstance(recipe, MPKeyRecipe):
        return [ranks[0].native_key() for ranks in mp_object_keys(tokens, recipe)]
    return [key_string(recipe, h) for h in chunk_hashes(tokens, recipe)]


# -- the lookup ---------------------------------------------------------------------------------


def tier_hit_tokens(presence: dict[str, list[bool]], sizes: list[int]) -> dict[str, int | None]:
    """Tokens served per tier and in total (LMCache's hit rule, wire.py); a tier that was not checked
    (absent, unreachable, not visible without kvctl's routes) is None, never a 0 it did not say."""
    return {tier: hits if tier == "total" or tier in presence else None
            for tier, hits in wire_hit_tokens(presence, sizes).items()}



def lookup(tokens: Sequence[int], target: Target, open_source: Callable[[Store], Source],
           presence: dict[str, list[bool]] | None = None, errors: dict[str, str] | None = None) -> LookupResult:
    """`presence` and `errors` carry what a live server already answered (the MP server's L1)."""
    recipe = target.recipe
    save_unfull = getattr(recipe, "save_unfull_chunk", False)
    bounds = chunk_bounds(len(tokens), recipe.chunk_size, save_unfull)
    keys = display_keys(target, tokens)
    chunks = [Chunk(i, start, end, key) for i, ((start, end), key) in enumerate(zip(bounds, keys))]
    presence = dict(presence or {})
    errors = dict(errors or {})
    sources: dict[str, Source] = {}
    for store in target.stores:
        try:
            source = open_source(store)
            names = names_for(store, recipe, tokens)
            flat = source.exists([name for ranks in names for name in ranks])
        except KvctlError as error:
            errors[store.tier] = tier_error(error)
            continue
        sources[store.tier] = source
        found, offset = [], 0
        for ranks in names:
            found.append(all(flat[offset:offset + len(ranks)]))
            offset += len(ranks)
        presence[store.tier] = [a or b for a, b in zip(presence.get(store.tier, found), found)]
    for tier, flags in presence.items():
        for chunk, present in zip(chunks, flags):
            if present:
                chunk.tiers.append(tier)
    for chunk in chunks:
        chunk.tiers.sort(key=TIER_ORDER.index)
    sizes = [chunk.end - chunk.start for chunk in chunks]
    hit_tokens = tier_hit_tokens(presence, sizes)
    result = LookupResult(recipe.model_name, target.mode, recipe.chunk_size, len(tokens), chunks, hit_tokens,
                          [tier for tier in TIER_ORDER if tier in presence], errors)
    result.diagnostics = diagnose(tokens, target, result, sources)
    return result


def engine_lookup(workers: list, info: dict[str, Any], token_ids: list[int]) -> LookupResult:
    """Ask every worker's kvctl routes (the authoritative view of the CPU and disk tiers), and Redis
    itself for the redis tier: LMCache's remote backend answers "not contained" while its Redis is
    down, and some of its connectors answer "contained" for what they never wrote (0.5.6's sentinel
    connector), so an unreachable Redis is an error, not 0 hits, and a hit is a name Redis holds."""
    from kvctl.core.cache.listing import engine_redis_store

    answers = [worker.lookup(token_ids) for worker in workers]  # a client per worker, in rank order
    store = engine_redis_store(workers[0]) if any(entry["tier"] == "redis" for entry in info["tiers"]) else None
    return from_engine_answers(info, answers, redis_truth(store, answers) if store else {})


def redis_truth(store, answers: list[dict[str, Any]]) -> dict[str, str]:
    """Mark the redis tier of each answered chunk by what the Redis `store` holds (its metadata name, as
    LMCache checks); {"redis": why} when Redis cannot answer."""
    from kvctl.core.cache.listing import stored_redis_keys

    try:
        held = set(stored_redis_keys(store, [chunk["key"] for answer in answers for chunk in answer["chunks"]]))
    except KvctlError as error:
        return {"redis": error.message}
    for answer in answers:
        for chunk in answer["chunks"]:
            chunk["tiers"] = [tier for tier in chunk["tiers"] if tier != "redis"] + (["redis"] if chunk["key"] in held
                                                                                     else [])
    return {}


def from_engine_answers(info: dict[str, Any], answers: list[dict[str, Any]],
                        errors: dict[str, str] | None = None) -> LookupResult:
    """A LookupResult from the /kvctl/v1/lookup answers of every worker of one engine: a chunk is in
    a tier when every worker's copy is there (LMCache takes the minimum over ranks). Tiers in `errors`
    could not answer and are left out."""
    first = answers[0]
    errors = errors or {}
    tiers_checked = [tier for tier in TIER_ORDER if tier not in errors
                     and all(tier in answer["tiers_checked"] for answer in answers)]
    presence = {tier: [all(tier in answer["chunks"][i]["tiers"] for answer in answers)
                       for i in range(len(first["chunks"]))] for tier in tiers_checked}
    chunks = [Chunk(c["index"], c["start"], c["end"], c["key"],
                    [tier for tier in tiers_checked if presence[tier][c["index"]]]) for c in first["chunks"]]
    sizes = [chunk.end - chunk.start for chunk in chunks]
    hit_tokens = tier_hit_tokens(presence, sizes)
    return LookupResult(info["model"], "inprocess", info["chunk_size"], first["prompt_tokens"], chunks, hit_tokens,
                        tiers_checked, dict(errors))


def read_tiers(token_ids: list[int], target, mp_url: str | None = None):
    """Look tokens up in the stores of a target, reading them directly (clients closed afterwards),
    joined by the L1 answer of the MP server at `mp_url` (an MP instance gives it)."""
    from kvctl.clients.stores import open_store

    presence, errors = mp_l1_presence(mp_url, token_ids, target) if mp_url else ({}, {})
    with ExitStack() as stack:
        def open_source(store):
            source = open_store(store)
            if hasattr(source, "close"):
                stack.callback(source.close)
            return source

        return lookup(token_ids, target, open_source, presence, errors)


def mp_l1_presence(url: str, token_ids: list[int], target) -> tuple[dict[str, list[bool]], dict[str, str]]:
    """({"cpu": per-chunk flags}, {}) from the MP server's kvctl lookup route, or ({}, {"cpu": why not})."""
    from kvctl.clients.mp_server import MPServerClient

    recipe = target.recipe
    try:
        with MPServerClient(url) as server:
            answer = server.lookup(token_ids, recipe.model_name, recipe.world_size, recipe.cache_salt)
        return {"cpu": l1_presence(answer, token_ids, recipe)}, {}
    except KvctlError as error:
        return {}, {"cpu": tier_error(error)}


def l1_presence(answer: dict[str, Any], tokens: Sequence[int], recipe: MPKeyRecipe) -> list[bool]:
    """Per chunk, whether the MP server's L1 holds it, from its /kvctl/v1/lookup answer; refused when
    the server's keys are not the ones this recipe makes (another chunk size or hash algorithm)."""
    expected = mp_object_keys(tokens, recipe)
    answered = answer["chunks"]
    if len(answered) != len(expected) or any(key.encoded() not in chunk["keys"]
                                             for ranks, chunk in zip(expected, answered) for key in ranks):
        raise KvctlError(f"the MP server makes other chunk keys than the configuration (server: chunk size "
                         f"{answer['chunk_size']}, {answer['hash_algorithm']}; configuration: chunk size "
                         f"{recipe.chunk_size}, {recipe.hash_algorithm})",
                         hint="pass --config with the configuration the server runs with")
    return ["cpu" in chunk["tiers"] for chunk in answered]


# -- diagnosis ----------------------------------------------------------------------------------


def diagnose(tokens: Sequence[int], target: Target, result: LookupResult,
             sources: dict[str, Source]) -> list[Diagnostic]:
    recipe = target.recipe
    found: list[Diagnostic] = []
    tail = len(tokens) % recipe.chunk_size
    if tail and not getattr(recipe, "save_unfull_chunk", False):
        found.append(Diagnostic("unfull_chunk_not_saved", f"the last {tail} tokens do not fill a chunk of "
                                f"{recipe.chunk_size} and are never stored (save_unfull_chunk is false)",
                                "this is normal; only a prompt whose length is a multiple of the chunk size is fully "
                                "cached"))
    if not result.chunks:
        found.append(Diagnostic("prompt_shorter_than_chunk", f"the prompt has {len(tokens)} tokens, fewer than one "
                                f"chunk of {recipe.chunk_size}: LMCache stores nothing for it",
                                "use a longer prompt or a smaller chunk size"))
        return found
    stored = result.hit_tokens["total"]
    covered = result.chunks[-1].end
    if stored >= covered or not sources:
        return found
    missing = next(chunk for chunk in result.chunks if chunk.start >= stored)
    if stored:
        found.append(Diagnostic("missing_chunk", f"chunk {missing.index} (tokens {missing.start}-{missing.end}) "
                                f"is in no tier checked, so the hit stops at {stored} tokens",
                                "it was evicted or never stored; prewarm the prompt to store it again"))
        return found
    found.extend(diagnose_first_miss(target.recipe, tokens, sources))
    return found


def _stored_inprocess_keys(sources: dict[str, Source]) -> dict[str, set[str]]:
    """Chunk keys per tier (disk file names un-mangled only up to the '/' replacement)."""
    stored = {}
    for tier, source in sources.items():
        names = source.stored_names(SCAN_LIMIT)
        stored[tier] = {name.removesuffix("metadata") for name in names}
    return stored


@singledispatch
def diagnose_first_miss(recipe, tokens: Sequence[int], sources: dict[str, Source]) -> list[Diagnostic]:
    """Why a prompt's first chunk is in no tier, by comparing the keys stored with the keys `recipe` makes
    (one implementation per kind of chunk key)."""
    raise NotImplementedError(type(recipe).__name__)


@diagnose_first_miss.register
def _diagnose_inprocess(recipe: KeyRecipe, tokens: Sequence[int], sources: dict[str, Source]) -> list[Diagnostic]:
    stored = _stored_inprocess_keys(sources)
    everything = set().union(*stored.values())
    if not everything:
        return [Diagnostic("nothing_stored", "the tiers checked hold no chunks at all",
                           "nothing was stored yet, or the serving process uses another disk path or Redis database")]
    parsed = [key for key in map(parse_key, everything) if key is not None]
    ours = recipe.model_name.replace("/", "-")  # disk file names carry the model with '/' replaced
    same_model = [key for key in parsed if key.model_name in (recipe.model_name, ours)]
    if not same_model:
        models = Counter(key.model_name for key in parsed).most_common(3)
        names = ", ".join(f"{name!r} ({count} chunks)" for name, count in models)
        return [Diagnostic("model_name_mismatch", f"no chunks under model name {recipe.model_name!r}; the tiers hold "
                           f"chunks of {names}", f"pass --model with the exact value vLLM was started with, e.g. "
                           f"--model {models[0][0]}")]
    layouts = Counter((key.world_size, key.kv_dtype, key.tags) for key in same_model)
    if not any(ws == recipe.world_size and dtype == recipe.kv_dtype and tags == _tag_strings(recipe)
               for ws, dtype, tags in layouts):
        world_size, dtype, tags = layouts.most_common(1)[0][0]
        if world_size != recipe.world_size:
            return [Diagnostic("world_size_mismatch", f"chunks of this model were stored by a deployment of world size "
                               f"{world_size}; this lookup assumes {recipe.world_size}",
                               f"pass --world-size {world_size}")]
        if dtype != recipe.kv_dtype:
            return [Diagnostic("dtype_mismatch", f"chunks of this model are stored with KV dtype {dtype}; this lookup "
                               f"assumes {recipe.kv_dtype}", f"pass --kv-dtype {dtype}, or check vLLM's --dtype")]
        return [Diagnostic("tags_mismatch", f"chunks of this model carry tags {list(tags) or 'none'}; this lookup "
                           f"uses {list(_tag_strings(recipe)) or 'none'}", "pass the request's lmcache.tag.* values")]
    stored_hashes = {key.chunk_hash for key in same_model}
    alternative = _find_alternative_recipe(tokens, recipe, stored_hashes)
    if alternative is not None:
        return [alternative]
    return [Diagnostic("hash_mismatch", f"{len(same_model)} chunks of this model are stored, but none of this "
                       "prompt's: its first chunk differs from every stored prefix, or the serving process hashes "
                       "with a seed or algorithm kvctl was not told",
                       "check that PYTHONHASHSEED and pre_caching_hash_algorithm match the serving process")]


def _tag_strings(recipe: KeyRecipe) -> tuple[str, ...]:
    return tuple(f"{tag}%{value}" for tag, value in recipe.tags)


def _find_alternative_recipe(tokens: Sequence[int], recipe: KeyRecipe, stored_hashes: set[str]) -> Diagnostic | None:
    """Recompute the first chunk's hash with other chunk sizes, algorithms and seeds; name the one that matches."""
    seeds = list(dict.fromkeys([recipe.hash_seed, "0", None]))
    for chunk_size in (recipe.chunk_size, *[size for size in ALTERNATIVE_CHUNK_SIZES if size != recipe.chunk_size]):
        if chunk_size > len(tokens):
            continue
        for algorithm in dict.fromkeys([recipe.hash_algorithm, *INPROCESS_ALGORITHMS]):
            for seed in seeds:
                for vllm_importable in (True, False):
                    candidate = replace(recipe, chunk_size=chunk_size, hash_algorithm=algorithm, hash_seed=seed,
                                        vllm_importable=vllm_importable, save_unfull_chunk=False)
                    if candidate == replace(recipe, save_unfull_chunk=False):
                        continue
                    try:
                        first = chunk_hashes(tokens[:chunk_size], candidate)[0]
                    except (UnreproducibleKeys, ImportError):
                        continue
                    if f"{first:x}" in stored_hashes:
                        return _explain(recipe, candidate)
    return None


def _explain(recipe: KeyRecipe, found: KeyRecipe) -> Diagnostic:
    if found.chunk_size != recipe.chunk_size:
        return Diagnostic("chunk_size_mismatch", f"this prompt is stored with chunk size {found.chunk_size}, but the "
                          f"configuration says {recipe.chunk_size}", f"use the configuration the serving process "
                          f"runs with (chunk_size: {found.chunk_size})")
    if found.hash_algorithm != recipe.hash_algorithm:
        return Diagnostic("hash_algorithm_mismatch", f"this prompt is stored with hash algorithm "
                          f"{found.hash_algorithm!r}, but the configuration says {recipe.hash_algorithm!r}",
                          f"use the serving process's pre_caching_hash_algorithm ({found.hash_algorithm})")
    if not found.vllm_importable:
        return Diagnostic("hash_seed_mismatch", "this prompt is stored by an engine without vLLM (NONE_HASH = 0)",
                          "that engine's keys never match vLLM's; run it where vLLM is importable")
    seed = "unset" if found.hash_seed is None else found.hash_seed
    return Diagnostic("hash_seed_mismatch", f"this prompt is stored by a process with PYTHONHASHSEED={seed}, but "
                      f"this lookup assumes {recipe.hash_seed or 'unset'}",
                      "start every process with the same PYTHONHASHSEED (kvctl config init writes it to env.sh)")


@diagnose_first_miss.register
def _diagnose_mp(recipe: MPKeyRecipe, tokens: Sequence[int], sources: dict[str, Source]) -> list[Diagnostic]:
    names = [name for source in sources.values() for name in source.stored_names(SCAN_LIMIT)]
    if not names:
        return [Diagnostic("nothing_stored", "the L2 tiers checked hold no chunks at all",
                           "nothing was stored yet, or the server uses another directory or Redis")]
    # fs file names come without their ".data" here; a model name or salt may hold '@'
    parsed = [key for key in (parse_object_key(name) or parse_object_key(name + ".data") for name in names) if key]
    models = Counter(key.model_name for key in parsed)
    if recipe.model_name not in models:
        top = ", ".join(f"{model!r}" for model, _ in models.most_common(3))
        return [Diagnostic("model_name_mismatch", f"no chunks under model name {recipe.model_name!r}; the tiers hold "
                           f"chunks of {top}", "pass --model with the value of vLLM's --model (MP keys use it as is)")]
    stored_hashes = {key.chunk_hash.hex() for key in parsed if key.model_name == recipe.model_name}
    for chunk_size in ALTERNATIVE_CHUNK_SIZES:
        if chunk_size == recipe.chunk_size or chunk_size > len(tokens):
            continue
        first = mp_object_keys(tokens[:chunk_size], replace(recipe, chunk_size=chunk_size))[0][0]
        if first.chunk_hash.hex() in stored_hashes:
            return [Diagnostic("chunk_size_mismatch", f"this prompt is stored with chunk size {chunk_size}, but the "
                               f"configuration says {recipe.chunk_size}", "use the server's --chunk-size")]
    return [Diagnostic("hash_mismatch", "chunks of this model are stored, but none of this prompt's",
                       "check the server's --hash-algorithm and that the prompt is tokenized as vLLM does")]
