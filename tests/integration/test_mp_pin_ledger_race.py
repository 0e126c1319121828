"""#20 item 11: two `kvctl pin apply` processes at once on one MP coordinator's pin set keep both ledger
updates and pin each prompt once (a lost record is a coordinator pin nobody ever releases). A real
`lmcache server` and `lmcache coordinator`, real kvctl processes."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import run_kvctl
from tests.integration.test_mp_cache_commands import native_keys, stack  # noqa: F401  (stack: the fixture)
from tests.integration.test_mp_l1_lookup import CHUNK, MODEL, tokens, write_tokens

PROMPTS = 6  # per set: enough pins that the two processes' plans and writes overlap


def apply_at_once(stack, *sets):  # noqa: F811
    flags = ("--model", MODEL, "--coordinator", stack.coordinator, "--config", stack.config, "--instance", stack.http,
             "--format", "json")
    with ThreadPoolExecutor(len(sets)) as pool:
        results = list(pool.map(lambda path: run_kvctl("pin", "apply", path, *flags), sets))
    for result in results:
        assert result.code == 0, result.stderr
    return [json.loads(result.stdout) for result in results]


def ledger(cache) -> dict:
    (path,) = cache.glob("pin-ledgers/*/race.json")
    return json.loads(path.read_text())


def pin_counts(stack) -> dict[str, int]:  # noqa: F811
    result = run_kvctl("pins", "--model", MODEL, "--coordinator", stack.coordinator, "--instance", stack.http,
                       "--format", "json")
    assert result.code == 0, result.stderr
    return {pin["key"]: pin["pin_count"] for pin in json.loads(result.stdout)["pins"]}


@pytest.mark.slow
def test_two_applies_at_once_keep_both_records_and_pin_each_prompt_once(stack, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    stack.fresh()
    prompts = [tokens(120 + n, CHUNK) for n in range(2 * PROMPTS)]
    stack.store_all(*prompts)
    sets = []
    for side in (0, 1):  # one set, in two versions: each lists its own prompts
        folder = tmp_path / f"side{side}"
        folder.mkdir()
        names = [f"p{n}.json" for n in range(side * PROMPTS, (side + 1) * PROMPTS)]
        for name, ids in zip(names, prompts[side * PROMPTS:]):
            write_tokens(folder / name, ids)
        sets.append(folder / "pins.yaml")
        sets[-1].write_text("name: race\npins:\n" + "".join(f"  - tokens_file: {name}\n" for name in names))
    try:
        first, second = apply_at_once(stack, *sets)
        assert first["counts"]["pin"] == second["counts"]["pin"] == PROMPTS
        pinned, released = ({step["pin_id"] for answer in (first, second) for step in answer["steps"]
                             if step["action"] == action} for action in ("pin", "release"))
        assert len(pinned) == 2 * PROMPTS
        # Whichever ran first (they overlap, or on a busy machine one ends before the other plans and the
        # later version releases what it no longer lists): every pin made and not released is recorded.
        before = set(ledger(tmp_path / "cache"))
        assert before == pinned - released and before

        own = {step["pin_id"] for step in first["steps"] if step["action"] == "pin"}
        again = apply_at_once(stack, sets[0], sets[0])  # the same file twice: the second finds it applied
        changes = len(own - before) + len(before - own)
        assert sorted(answer["counts"]["pin"] + answer["counts"]["release"] for answer in again) == [0, changes]
        assert set(ledger(tmp_path / "cache")) == own  # not first's releases (of the other version's pins)
        assert set(pin_counts(stack).values()) == {1}  # every chunk pinned once: one release frees it
    finally:  # leave the coordinator as found: as many unpins as each prompt holds pins
        counts = pin_counts(stack)
        for ids in prompts:
            write_tokens(tmp_path / "unpin.json", ids)
            for _ in range(max(counts.get(key, 0) for key in native_keys(ids))):
                assert run_kvctl("unpin", "--tokens-file", tmp_path / "unpin.json", "--model", MODEL,
                                 "--coordinator", stack.coordinator, "--instance", stack.http).code == 0
