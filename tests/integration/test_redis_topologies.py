"""Redis Cluster and Sentinel, proven: real redis-server processes (three primaries; master + replica +
sentinel), real LMCache engines writing chunks through LMCache's own connectors, and kvctl's lookup, ls,
evict and health on what they wrote.

A chunk's two names (`<key>kv_bytes`, `<key>metadata`) hash to different cluster slots, so they usually
live on different primaries: listing must SCAN every primary and removal must send one name per command.
LMCache 0.5.6's sentinel connector calls redis.asyncio methods without await: it writes nothing
(test_lmcache_056_sentinel_connector_writes_nothing) and its exists() is an un-awaited coroutine,
always truthy, so that engine answers "in Redis" for every chunk: kvctl asks Redis instead.
So in the sentinel stack a second engine writes through LMCache's redis:// connector to the master the
sentinel names, and kvctl works through the redis-sentinel:// URL (its config, and the engine configured
with it). Ground truth never goes through kvctl: names are read per node with plain SCANs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvctl.clients.redis_tier import RedisTier, split_eviction_risk
from kvctl.core.errors import UnreachableError
from kvctl.core.lmcache.keys import KeyRecipe, inprocess_keys
from kvctl.core.lmcache.tiers import parse_redis_url
from tests.helpers import http_json, init_engine, run_kvctl, tier_args, wait_until
from tests.redis_topologies import (
    ClusterDeployment,
    SentinelDeployment,
    failover,
    start_cluster,
    start_sentinel,
    start_server,
)

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2  # kv, layers, tokens, heads x head size, float16
RECIPE = KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half")
# names kvctl must never take: another model's chunk, a plain key, names shaped like this model's chunks
# whose fields LMCache never writes
FOREIGN = ["other@1@0@abc@halfmetadata", "other@1@0@abc@halfkv_bytes", "session:42",
           "tiny@1@0@session-token@halfmetadata", "tiny@1@0@session-token@halfkv_bytes",
           "tiny@2024@12@report@halfmetadata", "tiny@v2@1@0@abc@halfmetadata", "tiny@1@0@00ab@halfmetadata"]


@dataclass
class Stack:
    kind: str  # "cluster" or "sentinel"
    redis: ClusterDeployment | SentinelDeployment
    root: Path
    url: str  # worker 0's internal API of the engine configured with the topology's URL (kvctl --instance)
    writer: str  # worker 0's internal API of the engine that stores chunks
    config: Path  # `kvctl config init` directory with the topology's URL (kvctl --config)
    stored: set[str] = field(default_factory=set)  # chunk keys stored and not removed by a test

    def names(self) -> set[str]:
        """Every name in Redis, read without kvctl: a plain SCAN on each primary / on the current master."""
        import redis

        if self.kind == "cluster":
            nodes = [redis.Redis(host="127.0.0.1", port=port) for port in self.redis.ports]
        else:
            host, port = self.redis.master_address()
            nodes = [redis.Redis(host=host, port=port)]
        return {name.decode() for node in nodes for name in node.scan_iter(count=1000)}

    def write(self, names) -> None:
        client = self.redis.client()
        for name in names:
            client.set(name, b"x")

    def chunk_keys(self) -> set[str]:
        """The chunk keys of model tiny whose metadata name is in Redis (ground truth for ls and evict)."""
        return {name.removesuffix("metadata") for name in self.names()
                if name.endswith("metadata") and name not in FOREIGN and name.startswith("tiny@")}


@pytest.fixture(scope="module", params=["cluster", "sentinel"])
def stack(request, tmp_path_factory):
    """One topology at a time (the other's processes are stopped before it starts): the Redis deployment,
    a `kvctl config init` configuration with its URL, and a standalone LMCache engine on that configuration.

    Cluster: that engine writes through LMCache's RedisClusterConnector. Sentinel: LMCache 0.5.6's
    RedisSentinelConnector writes nothing (see test_lmcache_056_sentinel_connector_writes_nothing), so a
    second engine writes the same chunks (same model, same keys, same two-name layout) through LMCache's
    RedisConnector to the master the sentinel names, and kvctl works through the sentinel URL."""
    root = tmp_path_factory.mktemp(request.param)
    deployment = start_cluster(root / "redis") if request.param == "cluster" else start_sentinel(root / "redis")
    engines = []
    try:
        # LMCache's sentinel connector takes the master's name from the engine's environment only
        env = {"REDIS_SERVICE_NAME": deployment.service_name} if request.param == "sentinel" else {}
        engines.append(init_engine(root / "engine", *tier_args("cpu:0.1", deployment.url), "--model", "tiny", env=env))
        writer = engines[0].start().url
        if request.param == "sentinel":
            master = f"redis://127.0.0.1:{deployment.master_port}"
            engines.append(init_engine(root / "writer", *tier_args("cpu:0.1", master), "--model", "tiny"))
            writer = engines[1].start().url
        yield Stack(request.param, deployment, root, engines[0].url, writer, engines[0].config)
    finally:
        for engine in engines:
            engine.stop()
        deployment.stop()


def store(stack: Stack, start: int, chunks: int, unstored: int = 0, through: str | None = None):
    """Store tokens start .. start + chunks * CHUNK through an engine (the stack's writer by default) and
    wait until both names of every chunk are in Redis. The tokens file holds those tokens, then `unstored`
    full chunks and a partial chunk that were never stored; returns it and the stored chunks' keys."""
    tokens = list(range(start, start + chunks * CHUNK))
    http_json("POST", f"{through or stack.writer}/cache/store",
              params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    keys = inprocess_keys(tokens, RECIPE)
    if through is None:
        wanted = {key + suffix for key in keys for suffix in ("kv_bytes", "metadata")}
        wait_until(lambda: wanted <= stack.names(), 30, "both names of every chunk in Redis")
        stack.stored.update(keys)
    path = stack.root / f"tokens-{start}.json"
    path.write_text(json.dumps(tokens + list(range(10**6, 10**6 + unstored * CHUNK + 100))))
    return path, keys


def kvctl(*args):
    result = run_kvctl(*args, "--format", "json")
    assert "Traceback" not in result.stderr, result.stderr
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


def ok(*args):
    result, report = kvctl(*args)
    assert result.code == 0, result.stderr
    return report


def lookup_offline(stack: Stack, tokens: Path) -> dict:
    return ok("lookup", "--offline", "--config", stack.config, "--tokens-file", tokens, "--kv-dtype", "float16")


@pytest.mark.slow
def test_engine_writes_through_its_connector_and_offline_lookup_sees_it(stack):
    tokens, keys = store(stack, 0, 3)
    report = lookup_offline(stack, tokens)
    assert [chunk["key"] for chunk in report["chunks"]] == keys
    assert [chunk["tiers"] for chunk in report["chunks"]] == [["redis"]] * 3
    assert report["hit_tokens"]["redis"] == 3 * CHUNK and report["hit_tokens"]["total"] == 3 * CHUNK
    assert "redis" in report["tiers_checked"] and not report["errors"]
    import redis

    if stack.kind == "cluster":
        # the layout that broke multi-key UNLINK: a chunk's two names on different primaries
        where = {name.decode(): port for port in stack.redis.ports for name in redis.Redis(port=port).scan_iter()}
        assert any(where[key + "kv_bytes"] != where[key + "metadata"] for key in keys)
    else:
        # LMCache's sentinel connector would answer `exists` from the replica: the names get there too
        replica = redis.Redis(port=stack.redis.replica_port)
        wait_until(lambda: all(replica.exists(key + "metadata", key + "kv_bytes") == 2 for key in keys), 20,
                   "names on the replica")


@pytest.mark.slow
def test_ls_lists_exactly_the_models_chunks(stack):
    _, keys = store(stack, 5_000, 2)
    stack.write(FOREIGN)
    (tier,) = ok("ls", "--config", stack.config, "--tier", "redis", "--model", "tiny", "--limit", "1000")["tiers"]
    listed = {chunk["key"]: chunk for chunk in tier["chunks"]}
    assert set(listed) == stack.chunk_keys() == stack.stored and set(keys) <= set(listed)
    assert tier["total"] == len(listed) and all(chunk["size"] == CHUNK_BYTES for chunk in listed.values())
    (everything,) = ok("ls", "--config", stack.config, "--tier", "redis", "--limit", "1000")["tiers"]
    # every model's chunks (model "other", model "tiny@v2"), and nothing that is not a chunk key
    assert {chunk["key"] for chunk in everything["chunks"]} == stack.stored | {"other@1@0@abc@half",
                                                                               "tiny@v2@1@0@abc@half"}


def test_split_eviction_risk_is_pure():
    assert split_eviction_risk({"maxmemory": 0, "maxmemory_policy": "allkeys-lru"}) is None  # no limit
    assert split_eviction_risk({"maxmemory": 10 << 20, "maxmemory_policy": "noeviction"}) is None
    assert split_eviction_risk({"maxmemory": 10 << 20, "maxmemory_policy": "volatile-lru"}) is None  # no TTLs
    for policy in ("allkeys-lru", "allkeys-lfu", "allkeys-random"):
        warning = split_eviction_risk({"maxmemory": 10 << 20, "maxmemory_policy": policy})
        assert policy in warning and "10 MiB" in warning and "kv_bytes" in warning
    assert split_eviction_risk({}) is None


def test_split_eviction_risk_of_a_real_server(tmp_path):
    """redis-server --maxmemory 10mb --maxmemory-policy allkeys-lru: INFO memory, read by kvctl, is a risk;
    the same server with noeviction, or with no limit, is not."""
    server = start_server(tmp_path, "--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru")
    try:
        with RedisTier(parse_redis_url(server.url)) as tier:
            memory = tier.memory()
            assert (memory["maxmemory"], memory["maxmemory_policy"]) == (10 << 20, "allkeys-lru")
            warning = split_eviction_risk(memory)
            assert warning and "allkeys-lru" in warning and "10 MiB" in warning
            assert tier.eviction_risk() == warning
            server.client().config_set("maxmemory-policy", "noeviction")
            assert split_eviction_risk(tier.memory()) is None
            server.client().config_set("maxmemory-policy", "allkeys-lfu")
            server.client().config_set("maxmemory", "0")
            assert split_eviction_risk(tier.memory()) is None and tier.eviction_risk() is None
    finally:
        server.stop()


@pytest.mark.slow
def test_evict_a_prompt_dry_run_lists_what_the_run_removes(stack):
    """On a sentinel too, although LMCache 0.5.6's connector answers 'in Redis' for every chunk: kvctl
    plans from what Redis holds."""
    tokens, keys = store(stack, 10_000, 2, unstored=1)  # the third chunk of the prompt is not in Redis
    stack.write(FOREIGN)
    before = stack.names()
    dry = ok("evict", "--instance", stack.url, "--tokens-file", tokens, "--tier", "redis", "--dry-run")
    assert dry["dry_run"] and dry["chunks"] == [{"tier": "redis", "key": key} for key in keys]
    assert dry["removed"] == {"redis": 2}
    assert stack.names() == before  # a dry run removes nothing
    done = ok("evict", "--instance", stack.url, "--tokens-file", tokens, "--tier", "redis", "--yes")
    assert done["removed"] == dry["removed"] and done["chunks"] == dry["chunks"]
    gone = {key + suffix for key in keys for suffix in ("kv_bytes", "metadata")}
    assert stack.names() == before - gone  # both names of each selected chunk, nothing else
    stack.stored -= set(keys)
    assert lookup_offline(stack, tokens)["hit_tokens"]["redis"] == 0


@pytest.mark.slow
def test_evict_the_whole_redis_tier_takes_every_chunk_of_the_model_and_nothing_else(stack):
    store(stack, 20_000, 3)
    stack.write(FOREIGN)
    ours = stack.chunk_keys()
    assert len(ours) >= 3 and ours == stack.stored
    dry = ok("evict", "--instance", stack.url, "--tier", "redis", "--dry-run")
    assert dry["removed"] == {"redis": len(ours)} and {chunk["key"] for chunk in dry["chunks"]} == ours
    assert stack.chunk_keys() == ours
    done = ok("evict", "--instance", stack.url, "--tier", "redis", "--yes")
    assert done["removed"] == dry["removed"] and done["chunks"] == dry["chunks"]
    assert stack.names() == set(FOREIGN)  # both names of every chunk went; every foreign name stayed
    stack.stored.clear()
    (tier,) = ok("ls", "--config", stack.config, "--tier", "redis", "--model", "tiny")["tiers"]
    assert tier["total"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["cluster"], indirect=True)
def test_cluster_every_primary_counts(stack):
    """ping answers for every primary, INFO memory adds the primaries up, and the eviction risk names
    the one primary configured to evict any name."""
    with RedisTier(parse_redis_url(stack.redis.url)) as tier:
        assert tier.ping() == "answers (cluster, 3 primaries)"
        assert len(tier.memory_by_node()) == 3 and tier.memory()["nodes"] == 3
        assert tier.eviction_risk() is None
        node = stack.redis.node(stack.redis.ports[1])
        node.config_set("maxmemory", "10mb")
        node.config_set("maxmemory-policy", "allkeys-random")
        try:
            assert tier.eviction_risk().startswith(f"127.0.0.1:{stack.redis.ports[1]}: maxmemory-policy allkeys-random")
            assert tier.memory()["maxmemory"] == 0  # the other primaries have no limit: no limit in all
        finally:
            node.config_set("maxmemory", "0")
            node.config_set("maxmemory-policy", "noeviction")


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["sentinel"], indirect=True)
def test_lmcache_056_sentinel_connector_writes_nothing(stack):
    """The engine configured with redis-sentinel:// accepts a store and writes no name at all; kvctl's
    offline lookup, which asks Redis itself, reports 0 Redis hits."""
    before = stack.names()
    tokens, keys = store(stack, 90_000, 2, through=stack.url)
    with pytest.raises(AssertionError):  # give it every chance to show up
        wait_until(lambda: any(key + "metadata" in stack.names() for key in keys), 5, "LMCache's sentinel write")
    assert stack.names() == before
    assert "was never awaited" in (stack.root / "engine" / "engine.log").read_text()
    report = lookup_offline(stack, tokens)
    assert report["hit_tokens"]["redis"] == 0 and "redis" in report["tiers_checked"]


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["sentinel"], indirect=True)
def test_live_lookup_does_not_trust_the_sentinel_connector(stack):
    """The engine says every chunk is in Redis (LMCache 0.5.6's sentinel connector); kvctl asks Redis."""
    tokens = stack.root / "never-stored.json"
    tokens.write_text(json.dumps(list(range(500_000, 500_000 + 2 * CHUNK))))
    report = ok("lookup", "--instance", stack.url, "--tokens-file", tokens)
    assert report["hit_tokens"]["redis"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["sentinel"], indirect=True)
def test_sentinel_service_name_and_failover(stack, monkeypatch):
    """The service name: REDIS_SERVICE_NAME (what LMCache reads), else the URL's path, else redismaster;
    after a failover kvctl reads and removes on the new master."""
    url = parse_redis_url(stack.redis.url)
    monkeypatch.delenv("REDIS_SERVICE_NAME", raising=False)
    assert RedisTier(url).ping() == f"answers (master 127.0.0.1:{stack.redis.master_port} of 'redismaster')"
    assert RedisTier(parse_redis_url(stack.redis.url + "/redismaster")).ping().startswith("answers")
    with pytest.raises(UnreachableError, match="no Redis master 'elsewhere'") as raised:
        RedisTier(parse_redis_url(stack.redis.url + "/elsewhere")).ping()
    assert "REDIS_SERVICE_NAME" in raised.value.hint
    monkeypatch.setenv("REDIS_SERVICE_NAME", "redismaster")  # what LMCache reads wins over the path
    assert RedisTier(parse_redis_url(stack.redis.url + "/elsewhere")).ping().startswith("answers")
    monkeypatch.setenv("REDIS_SERVICE_NAME", "elsewhere")
    with pytest.raises(UnreachableError):
        RedisTier(url).ping()
    monkeypatch.delenv("REDIS_SERVICE_NAME")

    _, keys = store(stack, 30_000, 2)
    host, port = failover(stack.redis)
    assert port == stack.redis.replica_port
    assert RedisTier(url).ping() == f"answers (master {host}:{port} of 'redismaster')"
    (tier,) = ok("ls", "--config", stack.config, "--tier", "redis", "--model", "tiny")["tiers"]
    assert {chunk["key"] for chunk in tier["chunks"]} == stack.stored and set(keys) <= stack.stored
    done = ok("evict", "--instance", stack.url, "--key", keys[0], "--tier", "redis", "--yes")
    assert done["removed"] == {"redis": 1}  # removed on the new master
    assert not stack.redis.client().exists(keys[0] + "kv_bytes", keys[0] + "metadata")
    assert stack.redis.client().exists(keys[1] + "kv_bytes", keys[1] + "metadata") == 2
    stack.stored.discard(keys[0])


@pytest.mark.slow
def test_health_reports_redis_ok_then_down(stack):
    """Last for each topology: it stops the Redis deployment."""
    result, report = kvctl("health", "--instance", stack.url)
    assert result.code == 0, result.stderr
    checks = {check["component"]: check for check in report["instances"][0]["checks"]}
    assert checks["redis"]["ok"] and checks["redis"]["target"] == stack.redis.url

    def redis_check():
        result, report = kvctl("health", "--instance", stack.url)
        (check,) = [check for check in report["instances"][0]["checks"] if check["component"] == "redis"]
        return result, check

    if stack.kind == "cluster":
        # one primary of three stops: once the others notice (cluster-node-timeout), the cluster refuses
        # every command, and health says so
        stack.redis.processes.stop(f"node-{stack.redis.ports[0]}")
        result, check = wait_until(lambda: (found := redis_check())[0].code == 6 and found, 30, "redis DOWN")
        assert not check["ok"]
        stack.redis.stop()
    else:
        stack.redis.stop_master()
    result, check = redis_check()
    assert result.code == 6 and not check["ok"] and check["detail"], check
    others = [c for c in json.loads(result.stdout)["instances"][0]["checks"] if c["component"] != "redis"]
    assert others and all(c["ok"] for c in others)  # the engine itself still answers


def test_validate_and_health_warn_when_redis_can_split_a_chunk(tmp_path):
    """`allkeys-*` with a maxmemory evicts a chunk's two names one by one: config validate and health say so."""
    server = start_server(tmp_path / "redis", "--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru")
    try:
        assert run_kvctl("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:1", "--tier", server.url).code == 0
        checked = run_kvctl("config", "validate", tmp_path / "cfg", "--no-lmcache", "--format", "json")
        assert checked.code == 0, checked.stderr  # a warning, not an error
        warnings = [f["message"] for f in json.loads(checked.stdout)["findings"] if f["level"] == "warning"]
        assert any("allkeys-lru" in message for message in warnings), warnings
        server.client().config_set("maxmemory-policy", "noeviction")
        calm = run_kvctl("config", "validate", tmp_path / "cfg", "--no-lmcache", "--format", "json")
        assert not any("allkeys" in f["message"] for f in json.loads(calm.stdout)["findings"])
    finally:
        server.stop()


def test_validate_refuses_lmcache_056s_sentinel_connector(tmp_path):
    assert run_kvctl("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:1",
                     "--tier", "redis-sentinel://127.0.0.1:1").code == 0
    checked = run_kvctl("config", "validate", tmp_path / "cfg", "--no-lmcache", "--format", "json")
    assert checked.code == 1
    assert any("redis-sentinel connector never awaits" in f["message"] for f in json.loads(checked.stdout)["findings"])
