"""`kvctl lookup` over stores in memory: hit tokens per tier as LMCache counts them, and why a prompt misses."""

from dataclasses import replace

import pytest

from kvctl.core.cache.lookup import from_engine_answers, lookup
from kvctl.core.errors import UnreachableError
from kvctl.core.lmcache.deployment import Store, Target
from kvctl.core.lmcache.keys import KeyRecipe, MPKeyRecipe, inprocess_keys, mp_object_keys
from tests.fast.memory import MemorySource, stored_names

RECIPE = KeyRecipe("org/tiny", chunk_size=16, hash_algorithm="sha256_cbor", hash_seed="0")
PROMPT = list(range(1000, 1064))  # 4 chunks of 16
DISK = Store("disk", "lmcache-disk", ("/nowhere",))
REDIS = Store("redis", "lmcache-redis")
TARGET = Target("inprocess", RECIPE, [DISK, REDIS])


def deployment(target: Target, held: dict[str, list[str]]):
    """open_source for a deployment whose tiers hold these chunk keys (or ObjectKeys)."""
    sources = {store.tier: MemorySource(store.layout, stored_names(store.layout, held.get(store.tier, [])))
               for store in target.stores}
    return lambda store: sources[store.tier]


def chunks_of(tokens, recipe=RECIPE, indices=None) -> list[str]:
    keys = inprocess_keys(tokens, recipe)
    return keys if indices is None else [keys[i] for i in indices]


def causes(result) -> list[str]:
    return [diagnostic.cause for diagnostic in result.diagnostics]


def test_a_fully_stored_prompt_hits_every_token():
    result = lookup(PROMPT, TARGET, deployment(TARGET, {"disk": chunks_of(PROMPT)}))
    assert result.hit_tokens == {"cpu": None, "disk": 64, "redis": 0, "total": 64}  # no CPU tier to check
    assert result.tiers_checked == ["disk", "redis"] and result.errors == {}
    assert [(chunk.start, chunk.end, chunk.tiers) for chunk in result.chunks] == [
        (0, 16, ["disk"]), (16, 32, ["disk"]), (32, 48, ["disk"]), (48, 64, ["disk"])]
    assert [chunk.key for chunk in result.chunks] == chunks_of(PROMPT)
    assert result.diagnostics == []


@pytest.mark.parametrize(("cpu", "disk", "redis", "hits"), [
    # a later tier continues where the earlier one stopped
    ([0], [1, 2], [3], {"cpu": 16, "disk": 0, "redis": 0, "total": 64}),
    ([], [0, 1], [0, 1, 2, 3], {"cpu": 0, "disk": 32, "redis": 64, "total": 64}),
    # each tier is asked once, in order: disk's chunk 2 comes too late once redis served chunk 1
    ([0], [2], [1], {"cpu": 16, "disk": 0, "redis": 0, "total": 32}),
    ([1, 2, 3], [], [], {"cpu": 0, "disk": 0, "redis": 0, "total": 0}),
])
def test_tiers_are_walked_in_lmcache_order(cpu, disk, redis, hits):
    presence = {"cpu": [index in cpu for index in range(4)]}  # what a live server answered for its CPU tier
    held = {"disk": chunks_of(PROMPT, indices=disk), "redis": chunks_of(PROMPT, indices=redis)}
    result = lookup(PROMPT, TARGET, deployment(TARGET, held), presence)
    assert result.hit_tokens == hits
    assert result.tiers_checked == ["cpu", "disk", "redis"]
    assert [chunk.tiers for chunk in result.chunks] == [
        [tier for tier, indices in (("cpu", cpu), ("disk", disk), ("redis", redis)) if index in indices]
        for index in range(4)]


def test_a_gap_in_the_middle_stops_the_hit_and_is_named():
    result = lookup(PROMPT, TARGET, deployment(TARGET, {"redis": chunks_of(PROMPT, indices=[0, 1, 3])}))
    assert result.hit_tokens["total"] == 32 and result.hit_tokens["redis"] == 32
    assert result.chunks[3].tiers == ["redis"]  # held, but LMCache cannot use it
    (diagnostic,) = result.diagnostics
    assert diagnostic.cause == "missing_chunk"
    assert "chunk 2 (tokens 32-48)" in diagnostic.message and "stops at 32 tokens" in diagnostic.message


def test_the_unfull_last_chunk_is_never_stored():
    prompt = PROMPT + [7, 8, 9, 10, 11, 12]
    result = lookup(prompt, TARGET, deployment(TARGET, {"disk": chunks_of(prompt)}))
    assert result.prompt_tokens == 70 and len(result.chunks) == 4
    assert result.hit_tokens["total"] == 64
    assert causes(result) == ["unfull_chunk_not_saved"]
    assert "the last 6 tokens do not fill a chunk of 16" in result.diagnostics[0].message


def test_with_save_unfull_chunk_the_tail_is_a_chunk_of_its_own():
    recipe = replace(RECIPE, save_unfull_chunk=True)
    target = replace(TARGET, recipe=recipe)
    prompt = PROMPT + [7, 8, 9, 10, 11, 12]
    result = lookup(prompt, target, deployment(target, {"disk": chunks_of(prompt, recipe)}))
    assert [(chunk.start, chunk.end) for chunk in result.chunks][-1] == (64, 70)
    assert result.hit_tokens["total"] == 70 and result.diagnostics == []


def test_a_prompt_shorter_than_a_chunk_has_nothing_to_find():
    result = lookup(PROMPT[:10], TARGET, deployment(TARGET, {"disk": chunks_of(PROMPT)}))
    assert result.chunks == [] and result.hit_tokens["total"] == 0
    assert causes(result) == ["unfull_chunk_not_saved", "prompt_shorter_than_chunk"]
    assert "the prompt has 10 tokens, fewer than one chunk of 16" in result.diagnostics[1].message


def test_empty_tiers_say_so():
    result = lookup(PROMPT, TARGET, deployment(TARGET, {}))
    assert causes(result) == ["nothing_stored"]


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_chunks_of_another_model_name_the_model_they_are_of(tier):
    other = replace(RECIPE, model_name="tiny")
    result = lookup(PROMPT, TARGET, deployment(TARGET, {tier: chunks_of(PROMPT, other)}))
    (diagnostic,) = result.diagnostics
    assert diagnostic.cause == "model_name_mismatch"
    assert "no chunks under model name 'org/tiny'" in diagnostic.message and "'tiny' (4 chunks)" in diagnostic.message
    assert diagnostic.hint.endswith("--model tiny")


SEED_7 = replace(RECIPE, hash_seed="7")


@pytest.mark.parametrize(("looked_up", "stored", "cause", "says"), [
    (RECIPE, replace(RECIPE, chunk_size=32), "chunk_size_mismatch",
     "stored with chunk size 32, but the configuration says 16"),
    (SEED_7, RECIPE, "hash_seed_mismatch", "PYTHONHASHSEED=0, but this lookup assumes 7"),
    (SEED_7, replace(RECIPE, hash_seed=None), "hash_seed_mismatch", "PYTHONHASHSEED=unset, but this lookup assumes 7"),
    (RECIPE, replace(RECIPE, vllm_importable=False), "hash_seed_mismatch", "stored by an engine without vLLM"),
    (RECIPE, replace(RECIPE, hash_algorithm="sha256"), "hash_algorithm_mismatch",
     "stored with hash algorithm 'sha256'"),
    (RECIPE, replace(RECIPE, world_size=2), "world_size_mismatch", "world size 2; this lookup assumes 1"),
    (RECIPE, replace(RECIPE, kv_dtype="half"), "dtype_mismatch",
     "stored with KV dtype half; this lookup assumes bfloat16"),
    (RECIPE, replace(RECIPE, tags=(("user", "alice"),)), "tags_mismatch", "carry tags ['user%alice']"),
    (RECIPE, SEED_7, "hash_mismatch", "none of this prompt's"),  # a seed kvctl cannot guess
], ids=["chunk-size", "seed", "seed-unset", "no-vllm", "algorithm", "world-size", "dtype", "tags", "unknown-seed"])
def test_a_prompt_stored_by_another_recipe_is_explained(looked_up, stored, cause, says):
    """The serving process made its keys differently: the diagnosis names what differs (on disk, where
    file names carry the model's '/' as '-')."""
    result = lookup(PROMPT, replace(TARGET, recipe=looked_up), deployment(TARGET, {"disk": chunks_of(PROMPT, stored)}))
    assert result.hit_tokens["total"] == 0
    (diagnostic,) = result.diagnostics
    assert diagnostic.cause == cause and says in diagnostic.message, diagnostic


def test_a_chunk_is_in_a_tier_only_when_every_rank_holds_it():
    recipe = replace(RECIPE, world_size=2)
    target = replace(TARGET, recipe=recipe)
    rank0, rank1 = chunks_of(PROMPT, recipe), chunks_of(PROMPT, recipe.for_worker(1))
    held = {"redis": rank0 + [rank1[0], rank1[2], rank1[3]]}  # rank 1's chunk 1 is gone
    result = lookup(PROMPT, target, deployment(target, held))
    assert [chunk.tiers for chunk in result.chunks] == [["redis"], [], ["redis"], ["redis"]]
    assert result.hit_tokens["total"] == 16
    assert [chunk.key for chunk in result.chunks] == rank0  # keys are shown as rank 0 has them


def test_a_tier_that_cannot_answer_is_named_and_the_others_still_count():
    held = deployment(TARGET, {"disk": chunks_of(PROMPT, indices=[0, 1])})

    def open_source(store):
        if store.tier == "redis":
            raise UnreachableError("cannot reach Redis at 127.0.0.1:6379")
        return held(store)

    result = lookup(PROMPT, TARGET, open_source)
    assert result.errors == {"redis": "cannot reach Redis at 127.0.0.1:6379"}
    assert result.tiers_checked == ["disk"] and result.hit_tokens["total"] == 32


# -- MP mode ---------------------------------------------------------------------------------------

MP_RECIPE = MPKeyRecipe("org/tiny", chunk_size=16)
MP_TARGET = Target("mp", MP_RECIPE, [Store("disk", "mp-fs", ("/nowhere",)), Store("redis", "mp-resp")])


def mp_chunks(recipe=MP_RECIPE, tokens=PROMPT, indices=None):
    ranks = mp_object_keys(tokens, recipe)
    return [key for index, keys in enumerate(ranks) if indices is None or index in indices for key in keys]


def test_mp_lookup_reads_fs_and_resp_names():
    result = lookup(PROMPT, MP_TARGET, deployment(MP_TARGET, {"disk": mp_chunks(indices=[0, 1]),
                                                              "redis": mp_chunks()}))
    assert result.mode == "mp" and result.hit_tokens == {"cpu": None, "disk": 32, "redis": 64, "total": 64}
    assert [chunk.key for chunk in result.chunks] == [key.native_key() for key in mp_chunks()]


@pytest.mark.parametrize(("model", "salt", "tier"), [
    ("org/tiny", "", "disk"), ("org/tiny", "", "redis"),
    ("org/tiny", "tenant-a", "redis"),  # requests with vLLM's cache_salt: the salt ends the stored name
    ("llama@v2", "", "redis"),  # a model name with '@' in it
], ids=["fs", "resp", "salted-chunks", "at-in-model"])
def test_mp_chunk_size_mismatch_is_explained(model, salt, tier):
    recipe = replace(MP_RECIPE, model_name=model)
    target = replace(MP_TARGET, recipe=recipe)
    held = {tier: mp_chunks(replace(recipe, chunk_size=32, cache_salt=salt))}
    (diagnostic,) = lookup(PROMPT, target, deployment(target, held)).diagnostics
    assert diagnostic.cause == "chunk_size_mismatch", diagnostic
    assert "stored with chunk size 32, but the configuration says 16" in diagnostic.message


@pytest.mark.parametrize("layout_tier", ["disk", "redis"])
def test_mp_chunks_of_another_model_are_named(layout_tier):
    held = {layout_tier: mp_chunks(replace(MP_RECIPE, model_name="other"))}
    (diagnostic,) = lookup(PROMPT, MP_TARGET, deployment(MP_TARGET, held)).diagnostics
    assert diagnostic.cause == "model_name_mismatch" and "'other'" in diagnostic.message


# -- a live engine's answers, one per rank ----------------------------------------------------------

def engine_answer(tiers_per_chunk, tiers_checked=("cpu", "disk")):
    return {"prompt_tokens": 64, "tiers_checked": list(tiers_checked),
            "chunks": [{"index": i, "start": 16 * i, "end": 16 * (i + 1), "key": f"k{i}", "tiers": tiers}
                       for i, tiers in enumerate(tiers_per_chunk)]}


INFO = {"model": "org/tiny", "chunk_size": 16, "world_size": 2, "tiers": [{"tier": "cpu"}, {"tier": "disk"}]}


def test_engine_answers_count_a_chunk_only_where_every_rank_has_it():
    rank0 = engine_answer([["cpu", "disk"], ["cpu", "disk"], ["disk"], ["disk"]])
    rank1 = engine_answer([["cpu", "disk"], ["disk"], ["disk"], []])
    result = from_engine_answers(INFO, [rank0, rank1])
    assert [chunk.tiers for chunk in result.chunks] == [["cpu", "disk"], ["disk"], ["disk"], []]
    assert result.hit_tokens == {"cpu": 16, "disk": 48, "redis": None, "total": 48}
    assert (result.model, result.mode, result.prompt_tokens) == ("org/tiny", "inprocess", 64)


def test_engine_answers_leave_out_tiers_not_every_rank_checked_or_that_failed():
    rank0 = engine_answer([["cpu", "disk", "redis"]] * 4, ("cpu", "disk", "redis"))
    rank1 = engine_answer([["cpu", "disk", "redis"]] * 4, ("cpu", "redis"))
    result = from_engine_answers(INFO, [rank0, rank1], {"redis": "Redis is down"})
    assert result.tiers_checked == ["cpu"] and result.errors == {"redis": "Redis is down"}
    assert all(chunk.tiers == ["cpu"] for chunk in result.chunks)
    assert result.hit_tokens == {"cpu": 64, "disk": None, "redis": None, "total": 64}  # never a 0 not seen
