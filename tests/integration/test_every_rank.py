"""pin, unpin, pins and evict act on every tensor-parallel worker of an in-process instance: two real
LMCache engines as ranks 0 and 1 of one instance (CPU + disk + Redis), each holding its own rank's keys."""

import json

import pytest

from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import http_json, init_engine, run_kvctl, tier_args, wait_until

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2


def keys_of(token_ids, rank):
    recipe = KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", world_size=2, kv_dtype="half")
    return inprocess_keys(token_ids, recipe.for_worker(rank))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, module_redis):
    root = tmp_path_factory.mktemp("ranks")
    first = init_engine(root, *tier_args("cpu:0.05", f"disk:{root}/disk:1", module_redis.url), port_span=3,
                        world_size=2)
    engines = [first, first.rank(1)]
    try:
        for engine in engines:
            engine.launch()
        for engine in engines:
            engine.ready()
        yield {"urls": [engine.url for engine in engines], "root": root, "redis": module_redis.client()}
    finally:
        for engine in engines:
            engine.stop()


def store_everywhere(ranks, start, chunks):
    token_ids = list(range(start, start + chunks * CHUNK))
    for url in ranks["urls"]:
        http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    for rank in (0, 1):
        files = [ranks["root"] / "disk" / disk_file_name(key) for key in keys_of(token_ids, rank)]
        wait_until(lambda files=files: all(f.exists() and f.stat().st_size == CHUNK_BYTES for f in files), 30, "files")
        names = [key + "metadata" for key in keys_of(token_ids, rank)]
        wait_until(lambda names=names: all(ranks["redis"].exists(name) for name in names), 30, "Redis")
    path = ranks["root"] / f"tokens-{start}.json"
    path.write_text(json.dumps(token_ids))
    return path, token_ids


def kvctl(ranks, *args):
    result = run_kvctl(*args, "--instance", ranks["urls"][0], "--format", "json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def pins_of(url):
    return http_json("GET", f"{url}/kvctl/v1/pins")["pins"]


@pytest.mark.slow
def test_pin_unpin_and_evict_reach_every_rank(ranks):
    tokens, token_ids = store_everywhere(ranks, 0, 2)
    pin = kvctl(ranks, "pin", "--tokens-file", tokens)
    assert pin["pinned"] == {"cpu": 2, "disk": 2} and pin["ranks"] == 2
    assert [[entry["pin_id"] for entry in pins_of(url)] for url in ranks["urls"]] == [[pin["pin_id"]]] * 2
    assert [entry["pin_id"] for entry in kvctl(ranks, "pins")["pins"]] == [pin["pin_id"]]
    kept = kvctl(ranks, "evict", "--tokens-file", tokens, "--yes")
    assert kept["removed"] == {"cpu": 0, "disk": 0, "redis": 0}
    assert kept["skipped_pinned"] == {"cpu": 4, "disk": 4, "redis": 4}  # two chunks on each of two ranks
    released = kvctl(ranks, "unpin", "--pin-id", pin["pin_id"])["unpinned"]
    assert [entry["pin_id"] for entry in released] == [pin["pin_id"]]
    assert [pins_of(url) for url in ranks["urls"]] == [[], []]

    disk = kvctl(ranks, "evict", "--tier", "disk", "--yes")
    assert disk["removed"] == {"disk": 4}
    assert not list((ranks["root"] / "disk").glob("*.pt"))  # rank 1's files too
    redis = kvctl(ranks, "evict", "--tier", "redis", "--yes")
    assert redis["removed"] == {"redis": 4}
    assert not [name for name in ranks["redis"].scan_iter("tiny@*")]


@pytest.mark.slow
def test_keys_go_to_the_worker_of_their_rank(ranks):
    tokens, token_ids = store_everywhere(ranks, 10_000, 1)
    (rank1_key,) = keys_of(token_ids, 1)
    done = kvctl(ranks, "evict", "--key", rank1_key, "--tier", "cpu", "--yes")
    assert done["removed"] == {"cpu": 1} and done["chunks"] == [{"tier": "cpu", "key": rank1_key}]
    lookup = kvctl(ranks, "lookup", "--tokens-file", tokens)
    assert lookup["chunks"][0]["tiers"] == ["disk", "redis"]  # rank 1 lost its CPU copy: not on cpu for both


@pytest.mark.slow
def test_an_eviction_opens_each_worker_once_and_asks_its_info_once(ranks, monkeypatch):
    """One command, one decision of the instance, one client per worker: counted on the wire (every
    request kvctl sends goes through HTTPClient.send), against the two real ranks."""
    from kvctl.clients.http import HTTPClient
    from tests.helpers import run_cli

    tokens, _ = store_everywhere(ranks, 40_000, 2)
    opened, asked = [], []
    original_init, original_send = HTTPClient.__init__, HTTPClient.send

    def counting_init(self, url, *args, **kwargs):
        opened.append(url)
        original_init(self, url, *args, **kwargs)

    def counting_send(self, method, path, **options):
        asked.append((self.url, method, path))
        return original_send(self, method, path, **options)

    monkeypatch.setattr(HTTPClient, "__init__", counting_init)
    monkeypatch.setattr(HTTPClient, "send", counting_send)
    result = run_cli("evict", "--tokens-file", tokens, "--tier", "cpu", "--tier", "disk", "--yes",
                     "--instance", ranks["urls"][0])
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["removed"] == {"cpu": 4, "disk": 4}
    infos = [url for url, _method, path in asked if path == "/kvctl/v1/info"]
    assert infos == [ranks["urls"][0]], asked  # worker 0's, once
    # worker 0: the probe that tells an in-process worker from an MP server (its own short timeout), then
    # the one client of every operation; worker 1: once
    assert [opened.count(url) for url in ranks["urls"]] == [2, 1], opened
