"""#20 item 12: a Redis key spelled like an MP fs adapter file (`model@0x01000100@0@<hash>.data`) is no
chunk of the resp adapter, which writes `model@01000100@0@<hash>`: ls does not count it and neither an
eviction through the server nor one from the configuration alone removes it. A real `lmcache server`
with its resp L2 on a real redis-server."""

import json

import pytest

from kvctl.core.lmcache.keys import MPKeyRecipe, mp_object_keys
from tests.helpers import run_kvctl
from tests.integration.test_mp_cache_commands import native_keys, stack  # noqa: F401  (stack: the fixture)
from tests.integration.test_mp_l1_lookup import CHUNK, MODEL, tokens

KEEP = b"someone else's"


def fs_spelled(stack, ids: list[int], stored: list[int]) -> list[str]:  # noqa: F811
    """Foreign keys spelled like the fs files of a stored chunk and of one never stored."""
    names = [mp_object_keys(prompt, MPKeyRecipe(MODEL, CHUNK))[0][0].fs_file_name() for prompt in (stored, ids)]
    for name in names:
        stack.redis.set(name, KEEP)
    return names


def kvctl(stack, *args):  # noqa: F811
    result = run_kvctl(*args, "--config", stack.config, "--format", "json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_a_redis_key_spelled_like_an_fs_file_is_never_listed_or_evicted(stack, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    prompt, never = tokens(140, 2 * CHUNK), tokens(141, CHUNK)
    whole_tier = ("evict", "--all", "--tier", "redis", "--model", MODEL)
    for how in (("--instance", stack.http), ("--force",)):  # through the server; from the configuration alone
        stack.fresh()
        stack.store_all(prompt)
        foreign = fs_spelled(stack, never, prompt)
        listed = kvctl(stack, "ls", "--tier", "redis", "--instance", stack.http)["tiers"][0]
        assert listed["total"] == 2 and {chunk["key"] for chunk in listed["chunks"]} == set(native_keys(prompt))
        planned = kvctl(stack, *whole_tier, "--dry-run", *how)
        assert planned["removed"] == {"redis": 2} and {c["key"] for c in planned["chunks"]} == set(native_keys(prompt))
        done = kvctl(stack, *whole_tier, "--yes", *how)
        assert done["removed"] == {"redis": 2}, how
        assert [stack.redis.get(name) for name in foreign] == [KEEP, KEEP], how
        assert not any(stack.redis.exists(key) for key in native_keys(prompt)) and stack.decoys_intact()
