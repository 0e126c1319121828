"""Eviction over stores read directly: the plan (dry run) is what executing it removes, no more, no less."""

import json
from dataclasses import FrozenInstanceError, replace

import pytest

from kvctl.core.instance.protocol import EvictionPlan, Selection, execute_plan, plan_store_eviction, store_remover
from kvctl.core.lmcache.keys import KeyRecipe, inprocess_keys, key_string
from tests.fast.memory import MemoryInstance, MemoryStore

LLAMA = KeyRecipe("llama", chunk_size=16, hash_algorithm="sha256_cbor")
PROMPT = list(range(100, 164))
PROMPT_KEYS = inprocess_keys(PROMPT, LLAMA)  # 4 chunks
OTHER_LLAMA = [key_string(LLAMA, 0xA1), key_string(LLAMA, 0xA2)]  # llama chunks of other prompts
LLAMA_V2 = [key_string(replace(LLAMA, model_name="llama@v2"), 0xB1)]  # another model, whose name starts alike
FOREIGN = ["llama@2024@12@report@half", "session:42", "llama@1@0@AB12@half"]  # look alike, are no chunk keys


@pytest.fixture
def stores():
    return [MemoryStore("cpu", PROMPT_KEYS + OTHER_LLAMA + LLAMA_V2 + FOREIGN),
            MemoryStore("disk", PROMPT_KEYS[:2] + LLAMA_V2 + FOREIGN)]


def planned(plan: EvictionPlan) -> dict[str, list[str]]:
    by_tier: dict[str, list[str]] = {}
    for chunk in plan.chunks:
        by_tier.setdefault(chunk["tier"], []).append(chunk["key"])
    return {tier: sorted(keys) for tier, keys in by_tier.items()}


def contents(stores) -> dict[str, set[str]]:
    return {store.tier: set(store.names) for store in stores}


def execute(plan: EvictionPlan, stores) -> EvictionPlan:
    return execute_plan(plan, store_remover(stores))


PROMPT_SELECTION = (Selection(tokens=tuple(PROMPT)), PROMPT_KEYS)
GIVEN_SELECTION = (Selection(keys=(PROMPT_KEYS[0], OTHER_LLAMA[0])), [PROMPT_KEYS[0], OTHER_LLAMA[0]])
WHOLE_SELECTION = (Selection(model="llama"), None)


def test_a_prompt_takes_its_chunks_on_every_tier(stores):
    selection, wanted = PROMPT_SELECTION
    plan = plan_store_eviction(stores, selection, "llama", wanted)
    assert plan.dry_run and plan.removed == {"cpu": 4, "disk": 2} and plan.total == 6
    assert plan.skipped_pinned == {"cpu": 0, "disk": 0}
    assert planned(plan) == {"cpu": sorted(PROMPT_KEYS), "disk": sorted(PROMPT_KEYS[:2])}


@pytest.mark.parametrize(("tiers", "removed", "missing"), [
    (None, {"cpu": 4, "disk": 2}, []),
    (("all",), {"cpu": 4, "disk": 2}, []),
    (("disk",), {"disk": 2}, []),
    (("disk", "cpu"), {"disk": 2, "cpu": 4}, []),
    (("disk", "redis"), {"disk": 2}, ["redis"]),
    (("redis",), {}, ["redis"]),
])
def test_only_the_selected_tiers_are_planned(stores, tiers, removed, missing):
    selection = replace(PROMPT_SELECTION[0], tiers=tiers)
    plan = plan_store_eviction(stores, selection, "llama", PROMPT_KEYS)
    assert plan.removed == removed and set(planned(plan)) == set(removed)
    assert selection.missing([store.tier for store in stores]) == missing


def test_given_keys_are_taken_once_and_only_where_held(stores):
    absent = key_string(LLAMA, 0xFFF)
    given = [PROMPT_KEYS[0], PROMPT_KEYS[0], OTHER_LLAMA[0], absent, FOREIGN[0]]
    plan = plan_store_eviction(stores, Selection(keys=tuple(given)), "llama", given)
    assert planned(plan) == {"cpu": sorted([PROMPT_KEYS[0], OTHER_LLAMA[0]]), "disk": [PROMPT_KEYS[0]]}
    assert plan.removed == {"cpu": 2, "disk": 1}


def test_a_whole_tier_takes_the_models_chunks_and_nothing_else(stores):
    plan = plan_store_eviction(stores, Selection(model="llama"), "llama")
    assert planned(plan) == {"cpu": sorted(PROMPT_KEYS + OTHER_LLAMA), "disk": sorted(PROMPT_KEYS[:2])}
    v2 = plan_store_eviction(stores, Selection(model="llama@v2"), "llama@v2")
    assert planned(v2) == {"cpu": LLAMA_V2, "disk": LLAMA_V2}


def test_a_whole_tier_of_every_model_still_leaves_foreign_names(stores):
    plan = plan_store_eviction(stores, Selection(), None)
    assert planned(plan) == {"cpu": sorted(PROMPT_KEYS + OTHER_LLAMA + LLAMA_V2),
                             "disk": sorted(PROMPT_KEYS[:2] + LLAMA_V2)}
    execute(plan, stores)
    assert contents(stores) == {"cpu": set(FOREIGN), "disk": set(FOREIGN)}


@pytest.mark.parametrize(("selection", "wanted", "cpu_held"), [
    (*PROMPT_SELECTION, set(PROMPT_KEYS)),
    (*GIVEN_SELECTION, {PROMPT_KEYS[0], OTHER_LLAMA[0]}),
    (*WHOLE_SELECTION, {*PROMPT_KEYS, *OTHER_LLAMA}),
], ids=["prompt", "keys", "whole-tier"])
def test_pinned_chunks_stay_unless_forced(stores, selection, wanted, cpu_held):
    pinned = {PROMPT_KEYS[0], OTHER_LLAMA[0], LLAMA_V2[0]}
    kept = cpu_held & pinned
    plan = plan_store_eviction(stores, selection, "llama", wanted, pinned)
    assert set(planned(plan).get("cpu", [])) == cpu_held - pinned
    assert plan.skipped_pinned["cpu"] == len(kept) and plan.removed["cpu"] == len(cpu_held) - len(kept)
    forced = plan_store_eviction(stores, replace(selection, force=True), "llama", wanted, pinned)
    assert set(planned(forced)["cpu"]) == cpu_held and forced.skipped_pinned["cpu"] == 0
    execute(forced, stores)
    assert not cpu_held & stores[0].names


@pytest.mark.parametrize(("selection", "wanted"), [PROMPT_SELECTION, GIVEN_SELECTION, WHOLE_SELECTION],
                         ids=["prompt", "keys", "whole-tier"])
def test_execute_removes_exactly_what_the_dry_run_showed(stores, selection, wanted):
    before = contents(stores)
    plan = plan_store_eviction(stores, selection, "llama", wanted, {OTHER_LLAMA[1]})
    assert contents(stores) == before  # planning removes nothing
    done = execute(plan, stores)
    assert not done.dry_run and plan.dry_run
    assert done.removed == plan.removed and done.skipped_pinned == plan.skipped_pinned
    assert planned(done) == planned(plan)
    gone = planned(plan)
    assert contents(stores) == {tier: names - set(gone.get(tier, [])) for tier, names in before.items()}


def test_a_chunk_written_after_the_plan_is_not_taken(stores):
    plan = plan_store_eviction(stores, Selection(model="llama"), "llama")
    newcomer = key_string(LLAMA, 0xC0FFEE)
    stores[0].names.add(newcomer)
    done = execute(plan, stores)
    assert done.removed == plan.removed == {"cpu": 6, "disk": 2}
    assert newcomer in stores[0].names


def test_a_chunk_someone_else_removed_meanwhile_is_not_counted(stores):
    plan = plan_store_eviction(stores, Selection(tokens=tuple(PROMPT)), "llama", PROMPT_KEYS)
    stores[0].names.discard(PROMPT_KEYS[0])  # LMCache evicted it on its own
    done = execute(plan, stores)
    assert done.removed == {"cpu": 3, "disk": 2} and done.total == 5
    assert planned(done)["cpu"] == sorted(PROMPT_KEYS[1:])


def test_execute_goes_through_the_given_remover_and_counts_what_it_really_removed(stores):
    def remove_all_but_first(store, keys):  # e.g. LMCache holds the first one for a reader meanwhile
        return store.remove(keys[1:])

    plan = plan_store_eviction(stores, Selection(tokens=tuple(PROMPT)), "llama", PROMPT_KEYS)
    done = execute_plan(plan, store_remover(stores, remove_all_but_first))
    assert done.removed == {"cpu": 3, "disk": 1}
    assert {key for key in PROMPT_KEYS if key in stores[0].names} == {plan.chunks[0]["key"]}


def test_plans_of_several_parts_add_up():
    first = EvictionPlan({"cpu": 2}, {"cpu": 1}, ({"tier": "cpu", "key": "a"}, {"tier": "cpu", "key": "b"}))
    plan = first.merged(EvictionPlan({"cpu": 1, "disk": 3}, {"disk": 2}, ({"tier": "cpu", "key": "c"},), {"cpu": 1}))
    plan = plan.merged(EvictionPlan({"disk": 1}, {}, (), {"cpu": 2, "disk": 1}))
    assert first.removed == {"cpu": 2} and len(first.chunks) == 2  # folding makes a new plan
    assert plan.removed == {"cpu": 3, "disk": 4} and plan.total == 7
    assert plan.skipped_pinned == {"cpu": 1, "disk": 2}
    assert plan.held_by_lmcache == {"cpu": 3, "disk": 1}
    assert [chunk["key"] for chunk in plan.chunks] == ["a", "b", "c"]


@pytest.mark.parametrize("held", [None, {"cpu": 2}])
def test_a_plan_survives_its_json_form(held):
    plan = EvictionPlan({"cpu": 1, "disk": 0}, {"cpu": 1, "disk": 0}, ({"tier": "cpu", "key": PROMPT_KEYS[0]},), held)
    shown = plan.as_dict()
    assert ("held_by_lmcache" in shown) == (held is not None)
    again = EvictionPlan.from_dict(json.loads(json.dumps(shown)))
    assert again == plan and again.dry_run
    assert EvictionPlan.from_dict({**shown, "dry_run": False}).dry_run is False


def test_a_plan_read_back_executes_on_the_instance(stores):
    instance = MemoryInstance("memory", stores)
    shown = instance.plan_eviction(Selection(keys=tuple(PROMPT_KEYS), tiers=("disk",))).as_dict()
    done = instance.execute_eviction(EvictionPlan.from_dict(json.loads(json.dumps(shown))))
    assert done.removed == {"disk": 2} and not set(PROMPT_KEYS) & stores[1].names


@pytest.mark.parametrize("change", [{"dry_run": False}, {"removed": {}}, {"chunks": ()}, {"selection": None}])
def test_a_plan_cannot_be_changed_once_made(stores, change):
    plan = plan_store_eviction(stores, PROMPT_SELECTION[0], "llama", PROMPT_KEYS)
    (name, value), = change.items()
    with pytest.raises(FrozenInstanceError):
        setattr(plan, name, value)


@pytest.mark.parametrize(("selection", "pinned", "cpu_keeps_first"), [
    (Selection(tokens=tuple(range(16))), False, False),
    (Selection(tokens=tuple(range(16)), tiers=("disk",)), False, True),
    (Selection(model="llama"), True, True),
    (Selection(model="llama", force=True), True, False),
], ids=["prompt", "prompt-on-disk", "whole-tier-pinned", "whole-tier-forced"])
def test_the_instance_executes_exactly_its_plan(selection, pinned, cpu_keeps_first):
    from tests.fast.memory import memory_keys

    prompt, other = memory_keys(range(16), "llama"), memory_keys(range(100, 108), "llama")
    stores = [MemoryStore("cpu", prompt + other + FOREIGN), MemoryStore("disk", prompt[:2] + FOREIGN)]
    instance = MemoryInstance("memory", stores)
    if pinned:
        instance.pin(list(range(4)), None, None)
    before = contents(stores)
    plan = instance.plan_eviction(selection)
    assert contents(stores) == before and plan.dry_run and plan.selection == selection
    done = instance.execute_eviction(plan)
    gone = planned(plan)
    assert contents(stores) == {tier: names - set(gone.get(tier, [])) for tier, names in before.items()}
    assert not done.dry_run and done.removed == plan.removed and planned(done) == gone and plan.total > 0
    assert (prompt[0] in stores[0].names) == cpu_keeps_first
