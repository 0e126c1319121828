"""The Instance protocol's contract: one set of tests, run against every kind of instance (conftest.Kind:
in memory, an offline configuration, a real standalone engine, a real MP server). What a kind does
differently is asserted as its documented difference (the tiers it has, where its pins hold, Unsupported
for pins offline), never skipped."""

from dataclasses import FrozenInstanceError, replace

import pytest

from kvctl.core.instance.protocol import EvictionPlan, Selection, Unsupported

pytestmark = pytest.mark.slow

EVERY_CHUNK = 10_000  # a listing limit above anything a test stores


def planned(plan: EvictionPlan) -> dict[str, set[str]]:
    """The plan's chunk keys, per tier."""
    keys: dict[str, set[str]] = {}
    for chunk in plan.chunks:
        keys.setdefault(chunk["tier"], set()).add(chunk["key"])
    return keys


def listed(kind, limit: int = EVERY_CHUNK) -> dict[str, tuple[int, set[str]]]:
    """Per tier: its total and the keys listed."""
    listing = kind.instance.list(None, None, limit)
    assert listing.errors == {}
    return {tier.tier: (tier.total, {chunk.key for chunk in tier.chunks}) for tier in listing.tiers}


def prompt_keys(kind, tokens: list[int]) -> set[str]:
    return {chunk.key for chunk in kind.instance.lookup(tokens).chunks}


def assert_stored(kind, tokens: list[int]) -> None:
    result = kind.instance.lookup(tokens)
    assert [chunk.tiers for chunk in result.chunks] == [list(kind.tiers)] * (len(tokens) // kind.chunk_size)
    assert result.hit_tokens["total"] == len(tokens)


def assert_gone(kind, tokens: list[int]) -> None:
    result = kind.instance.lookup(tokens)
    assert [chunk.tiers for chunk in result.chunks] == [[]] * (len(tokens) // kind.chunk_size)
    assert result.hit_tokens["total"] == 0


def test_lookup_reports_every_stored_chunk_on_its_tiers_and_an_unstored_prompt_hits_nothing(kind):
    [tokens] = kind.store(3)
    result = kind.instance.lookup(tokens)
    assert (result.chunk_size, result.prompt_tokens, len(result.chunks)) == (kind.chunk_size, len(tokens), 3)
    assert_stored(kind, tokens)
    assert_gone(kind, kind.unstored(3))


def test_list_counts_the_stored_chunks_per_tier_and_respects_the_limit(kind):
    before = listed(kind)
    prompts = kind.store(3, 2)
    after = listed(kind)
    assert set(after) == set(kind.tiers)
    keys = set().union(*(prompt_keys(kind, tokens) for tokens in prompts))
    for tier, (total, tier_keys) in after.items():
        assert total == before[tier][0] + 5 and len(tier_keys) == total, tier
        assert keys <= tier_keys, tier
    assert {tier: (total, len(keys)) for tier, (total, keys) in listed(kind, limit=2).items()} == {
        tier: (total, 2) for tier, (total, _keys) in after.items()}


def test_an_executed_plan_removes_exactly_the_prompts_chunks_and_nothing_else(kind):
    target, other = kind.store(3, 2)
    plan = kind.instance.plan_eviction(Selection(tokens=tuple(target), model=kind.model))
    assert plan.dry_run and plan.removed == dict.fromkeys(kind.tiers, 3)
    assert plan.skipped_pinned == dict.fromkeys(kind.tiers, 0)
    assert planned(plan) == dict.fromkeys(kind.tiers, prompt_keys(kind, target))

    done = kind.instance.execute_eviction(plan)
    assert not done.dry_run and done.errors == {}
    assert done.removed == plan.removed and planned(done) == planned(plan)
    assert_gone(kind, target)
    assert_stored(kind, other)


def test_planning_alone_removes_nothing(kind):
    [tokens] = kind.store(2)
    before = listed(kind)
    prompt = Selection(tokens=tuple(tokens), model=kind.model)
    for selection in (prompt, replace(prompt, force=True), Selection(model=kind.model)):
        plan = kind.instance.plan_eviction(selection)
        assert plan.dry_run and plan.total >= 2 * len(kind.tiers), selection
        with pytest.raises(FrozenInstanceError):
            plan.removed = {}
    assert listed(kind) == before
    assert_stored(kind, tokens)


def test_a_pin_keeps_its_chunks_from_an_eviction_unless_forced(kind):
    [tokens] = kind.store(2)
    selection = Selection(tokens=tuple(tokens), model=kind.model)
    if kind.pinned_tiers is None:  # no pins: each pin operation refused as a usage error, with a hint
        for refused in (lambda: kind.instance.pin(tokens, None, None, kind.model),
                        lambda: kind.instance.unpin(tokens=tokens, model=kind.model),
                        kind.instance.pins):
            with pytest.raises(Unsupported) as error:
                refused()
            assert error.value.exit_code == 2 and error.value.hint
        assert not kind.instance.pin_ids
        assert kind.instance.plan_eviction(selection).removed == dict.fromkeys(kind.tiers, 2)
        return

    pin = kind.instance.pin(tokens, None, None, kind.model)
    try:
        held = kind.instance.pins().pins
        assert held
        if kind.instance.pin_ids:
            assert pin.pin_id in [entry.pin_id for entry in held]
        plan = kind.instance.plan_eviction(selection)
        assert plan.skipped_pinned == {tier: 2 if tier in kind.pinned_tiers else 0 for tier in kind.tiers}
        assert plan.removed == {tier: 0 if tier in kind.pinned_tiers else 2 for tier in kind.tiers}
        assert set(planned(plan)) == set(kind.tiers) - set(kind.pinned_tiers)
        forced = kind.instance.plan_eviction(replace(selection, force=True))
        assert forced.removed == dict.fromkeys(kind.tiers, 2)
        assert forced.skipped_pinned == dict.fromkeys(kind.tiers, 0)
    finally:
        kind.instance.unpin(tokens=tokens, model=kind.model)
    assert kind.instance.plan_eviction(selection).removed == dict.fromkeys(kind.tiers, 2)
    assert_stored(kind, tokens)


def test_key_facts_name_the_deployments_chunk_size_hash_and_model(kind):
    facts = kind.instance.key_facts()
    assert (facts.chunk_size, facts.hash_algorithm) == (kind.chunk_size, kind.hash_algorithm)
    assert facts.model == kind.model


def test_the_instance_takes_its_own_model_where_none_is_given(kind):
    """No model given means the instance's: the fake's, the configuration's, the engine's, and for an MP
    server the Selector's (--model) when no vLLM is registered with it, as its lookup and key_facts take it
    (model_name and plan_eviction ignored it: 'which model? the server has no model registered')."""
    [tokens] = kind.store(1)
    assert kind.instance.model_name() == kind.model
    assert planned(kind.instance.plan_eviction(Selection(tokens=tuple(tokens)))) == dict.fromkeys(
        kind.tiers, prompt_keys(kind, tokens))
