"""Chunk bytes out of and into running LMCache engines (what `kvctl snapshot` moves): the chunks/read and
chunks/write routes, their client and InProcessInstance.read_chunks / write_chunks, against real standalone
engines (CPU + disk + Redis on the source, CPU + disk on a fresh target)."""

import json
import os
import socket
from types import SimpleNamespace

import pytest
from kvctl_plugins.wire import frame_header, read_frames

from kvctl.clients.internal_api import InternalAPIClient
from kvctl.core.errors import RejectedError
from kvctl.core.instance.opening import Selector, open_instance
from kvctl.core.instance.protocol import StoredChunk
from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import http_client, http_json, standalone_engine, wait_until

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2  # kv, layers, tokens, heads x head size, float16
RECIPE = KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half")


def tokens(start, chunks):
    return list(range(start, start + chunks * CHUNK))


def keys_of(start, chunks):
    return inprocess_keys(tokens(start, chunks), RECIPE)


@pytest.fixture(scope="module")
def source(tmp_path_factory, module_redis):
    root = tmp_path_factory.mktemp("snapshot-source")
    tiers = ("--tier", "cpu:0.1", "--tier", f"disk:{root}/disk:1", "--tier", module_redis.url)
    with standalone_engine(root, *tiers) as url:
        with InternalAPIClient(url) as client:
            yield SimpleNamespace(url=url, root=root, client=client, redis=module_redis.client(),
                                  instance=open_instance(Selector(instance=url)))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("snapshot-target")
    with standalone_engine(root, "--tier", "cpu:0.1", "--tier", f"disk:{root}/disk:1") as url:
        with InternalAPIClient(url) as client:
            yield SimpleNamespace(url=url, root=root, client=client, instance=open_instance(Selector(instance=url)))


def store(source, start, chunks):
    """Store a prompt on the source engine (LMCache's mock GPU connector: zeros) and wait until every tier has it."""
    http_json("POST", f"{source.url}/cache/store", params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    keys = keys_of(start, chunks)
    wait_until(lambda: all(path.exists() and path.stat().st_size == CHUNK_BYTES for path in files(source, keys)), 30,
               "disk files")
    wait_until(lambda: all(source.redis.exists(key + "metadata") for key in keys), 30, "chunks in Redis")
    return keys


def load(engine, start, chunks, tiers):
    """Chunks of random bytes for a prompt's keys, written through chunks/write onto `tiers`: {key: data}."""
    loaded = {key: os.urandom(CHUNK_BYTES) for key in keys_of(start, chunks)}
    answer = engine.client.write_chunks(frames(*((key, data, None) for key, data in loaded.items())), tiers)
    assert answer["written"] == dict.fromkeys(tiers, chunks), answer
    return loaded


def frames(*chunks):
    return b"".join(frame_header(key, len(data), metadata) + bytes(data) for key, data, metadata in chunks)


def files(engine, keys):
    return [engine.root / "disk" / disk_file_name(key) for key in keys]


def tiers_of(engine, start, chunks):
    return [chunk["tiers"] for chunk in engine.client.lookup(tokens(start, chunks))["chunks"]]


def cpu_order(engine):
    return [entry["key"] for entry in engine.client.keys("cpu", limit=10_000)["keys"]]  # LRU -> MRU


def held(engine):
    return {tier["tier"]: tier["keys"] for tier in engine.client.info()["tiers"]}


@pytest.mark.slow
def test_write_lands_the_bytes_on_every_tier_and_read_returns_them(source):
    stored = store(source, 0, 2)
    loaded = load(source, 5_000, 2, ["cpu", "disk", "redis"])
    for key, path in zip(loaded, files(source, loaded)):
        assert path.read_bytes() == loaded[key] == source.redis.get(key + "kv_bytes")
    before = cpu_order(source)
    asked = [*stored, *loaded]
    chunks = list(source.instance.read_chunks([*asked, "tiny@1@0@1234abcd@half", *asked]))
    assert [chunk.key for chunk in chunks] == asked  # each once, an absent key left out
    for chunk in chunks:
        assert chunk.metadata == source.redis.get(chunk.key + "metadata")  # LMCache's own header
        assert bytes(chunk.data) == loaded.get(chunk.key, bytes(CHUNK_BYTES))  # the mock connector stores zeros
    assert cpu_order(source) == before  # the reads moved nothing in the CPU tier's LRU order
    # no reference kept: the chunks are evictable (ref count 1), none held by LMCache
    planned = source.client.evict(keys=asked, tiers=["cpu"], dry_run=True)
    assert planned["removed"] == {"cpu": 4} and planned["held_by_lmcache"] == {"cpu": 0}


@pytest.mark.slow
def test_read_from_disk_or_redis_does_not_fill_the_cpu_tier(source):
    loaded = load(source, 10_000, 2, ["cpu", "disk", "redis"])
    first, second = loaded
    assert source.client.evict(keys=[first], tiers=["cpu"])["removed"] == {"cpu": 1}
    assert source.client.evict(keys=[second], tiers=["cpu", "disk"])["removed"] == {"cpu": 1, "disk": 1}
    assert tiers_of(source, 10_000, 2) == [["disk", "redis"], ["redis"]]
    chunks = list(source.instance.read_chunks(list(loaded)))
    assert [(chunk.key, bytes(chunk.data)) for chunk in chunks] == list(loaded.items())
    assert [chunk.metadata for chunk in chunks] == [source.redis.get(key + "metadata") for key in loaded]
    assert tiers_of(source, 10_000, 2) == [["disk", "redis"], ["redis"]]  # StorageManager.get would have copied
    only_redis = source.client.read_chunks([first, second], tiers=["redis"])[0]
    assert [(key, bytes(data)) for key, data, _ in read_frames(only_redis)] == list(loaded.items())
    assert source.client.read_chunks([second], tiers=["cpu", "disk"]) == (b"", [])


@pytest.mark.slow
def test_write_into_a_fresh_engine_then_read_back_identical(source, target):
    loaded = load(source, 20_000, 3, ["cpu"])
    chunks = list(source.instance.read_chunks(list(loaded)))
    assert target.instance.write_chunks(chunks) == {"written": {"cpu": 3}, "already": {"cpu": 0}, "dropped": {"cpu": 0}}
    assert tiers_of(target, 20_000, 3) == [["cpu"]] * 3
    hits = target.client.lookup(tokens(20_000, 3))["hit_tokens"]
    assert hits["cpu"] == hits["total"] == 3 * CHUNK
    back = list(target.instance.read_chunks(list(loaded)))
    assert [(c.key, bytes(c.data), c.metadata) for c in back] == [(c.key, bytes(c.data), c.metadata) for c in chunks]
    assert [bytes(c.data) for c in back] == list(loaded.values())
    again = target.client.write_chunks(frames(*((c.key, c.data, c.metadata) for c in chunks)))
    assert again == {"written": {"cpu": 0}, "already": {"cpu": 3}, "dropped": {"cpu": 0}}
    # the written objects hold no extra reference: evictable like any stored chunk
    planned = target.client.evict(keys=list(loaded), tiers=["cpu"], dry_run=True)
    assert planned["removed"] == {"cpu": 3} and planned["held_by_lmcache"] == {"cpu": 0}


@pytest.mark.slow
def test_write_to_the_disk_tier_lands_the_file(source, target):
    loaded = load(source, 30_000, 2, ["disk"])
    chunks = [StoredChunk(c.key, c.data) for c in source.instance.read_chunks(list(loaded))]  # no metadata
    assert target.instance.write_chunks(chunks, tier="disk")["written"] == {"disk": 2}
    assert [path.read_bytes() for path in files(target, loaded)] == list(loaded.values())
    assert tiers_of(target, 30_000, 2) == [["disk"]] * 2
    answer = target.client.write_chunks(frames(*((c.key, c.data, None) for c in chunks)), ["cpu", "disk"])
    assert answer["written"] == {"cpu": 2, "disk": 0} and answer["already"] == {"cpu": 0, "disk": 2}


@pytest.mark.slow
def test_a_bad_body_is_refused_whole_and_writes_nothing(source, target):
    loaded = load(source, 40_000, 2, ["cpu"])
    (good_key, good, good_meta), (key, data, metadata) = [(c.key, bytes(c.data), c.metadata)
                                                          for c in source.instance.read_chunks(list(loaded))]
    fields = key.split("@")
    half = source.client.read_chunks([key])[0]
    tampered = bytearray(metadata)
    tampered[-8] ^= 1  # a dimension of the shape
    refusals = {
        "cut short": (frames((good_key, good, good_meta)) + half[:-10], "cut short"),
        "bad frame": (frames((good_key, good, good_meta)) + b"\0\0\0\2{}", "not {key, size, metadata}"),
        "tampered metadata": (frames((good_key, good, good_meta), (key, data, bytes(tampered))),
                              "is not what this engine makes"),
        "another model": (frames((good_key, good, good_meta), ("other@" + key.split("@", 1)[1], data, metadata)),
                          "model 'other'"),
        "another worker": (frames((good_key, good, good_meta), ("@".join([fields[0], "1", "1", *fields[3:]]), data,
                                                                       metadata)), "worker id 1"),
        "another world size": (frames((good_key, good, good_meta), ("@".join([fields[0], "2", *fields[2:]]), data,
                                                                           metadata)), "world size 2"),
        "another dtype": (frames((good_key, good, good_meta), ("@".join([*fields[:4], "bfloat16"]), data, metadata)),
                          "KV dtype 'bfloat16'"),
        "wrong size": (frames((good_key, good, good_meta), (key, data[:-2], None)), f"{CHUNK_BYTES - 2} bytes"),
        "part of a chunk": (frames((good_key, good, good_meta), (key, data[:CHUNK_BYTES // 2], None)),
                            "save_unfull_chunk is off"),
        "twice": (frames((good_key, good, good_meta), (good_key, good, good_meta)), "comes twice"),
        "not a key": (frames((good_key, good, good_meta), ("tiny@1@0@xyz@half", data, None)), "not an LMCache chunk"),
        "empty": (b"", "no chunk frames"),
    }
    before = held(target)
    for name, (body, message) in refusals.items():
        with pytest.raises(RejectedError, match="rejected") as refused:
            target.client.write_chunks(body, ["cpu", "disk"])
        assert message in refused.value.message, name
    with pytest.raises(RejectedError, match="no such tier here: redis"):
        target.client.write_chunks(frames((good_key, good, good_meta)), ["redis"])
    assert held(target) == before and tiers_of(target, 40_000, 2) == [[], []]


@pytest.mark.slow
def test_the_chunk_routes_keep_the_request_checks(target):
    url = f"{target.url}/kvctl/v1/chunks"
    assert http_client().post(f"{url}/write", content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415
    assert http_client().post(f"{url}/write", json={"keys": []}).status_code == 415  # JSON is not frames
    assert http_client().post(f"{url}/read", content=b"{}", headers={"Content-Type": "application/octet-stream"}
                      ).status_code == 415
    assert http_client().post(f"{url}/write", content=b"x", headers={"Content-Type": "application/octet-stream",
                                                               "Host": "evil.example"}).status_code == 403
    with socket.create_connection(("127.0.0.1", int(target.url.rsplit(":", 1)[1])), timeout=10) as connection:
        connection.sendall(b"POST /kvctl/v1/chunks/write HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           b"Content-Type: application/octet-stream\r\nContent-Length: 300000000\r\n\r\n")
        assert connection.recv(4096).startswith(b"HTTP/1.1 413")  # over 256 MiB and a margin: refused unread
    refused = http_client().post(f"{url}/read", json={"keys": "tiny"})
    assert refused.status_code == 400 and json.loads(refused.text)["error"] == "bad_request"


# -- the answer cap, against a stand-in engine (256 MiB of chunks is too much for a test) -------------------


class FakeChunk:
    """A CPU memory object as LocalCPUBackend.get_blocking hands it out, counting its references."""

    def __init__(self, tokens_count):
        import torch

        self.data = bytes(range(256)) * 2 * tokens_count  # 2 x 2 x tokens x 64 float16 values
        self.shape, self.refs = torch.Size([2, 2, tokens_count, 64]), 1

    @property
    def byte_array(self):
        return memoryview(self.data)

    def get_shapes(self):
        return [self.shape]

    def get_dtypes(self):
        import torch

        return [torch.float16]

    def get_memory_format(self):
        from lmcache.v1.memory_management import MemoryFormat

        return MemoryFormat.KV_2LTD

    def ref_count_down(self):
        self.refs -= 1


def fake_engine(objects):
    class CPU:
        def get_blocking(self, key):
            found = objects.get(key.to_string())
            if found is not None:
                found.refs += 1
            return found

    return SimpleNamespace(storage_manager=SimpleNamespace(storage_backends={"LocalCPUBackend": CPU()}),
                           config=SimpleNamespace(remote_url=None),
                           metadata=SimpleNamespace(get_num_groups=lambda: 1))


@pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")  # TestClient
def test_a_read_answer_stops_at_the_cap_and_says_where_to_go_on(monkeypatch):
    from fastapi import FastAPI
    from kvctl_plugins import chunk_bytes, routes, wire
    from starlette.testclient import TestClient

    keys = [f"tiny@1@0@{index + 1:x}@half" for index in range(5)]
    objects = {key: FakeChunk(4) for key in keys if key != keys[1]}  # the second is held by no tier
    size = len(objects[keys[0]].data)
    monkeypatch.setattr(wire, "MAX_CHUNKS_BODY", 2 * size)
    app = FastAPI()
    app.include_router(routes.router)
    app.state.lmcache_adapter = SimpleNamespace(lmcache_engine=fake_engine(objects))
    with InternalAPIClient("http://127.0.0.1:1") as client:
        client._client = TestClient(app, base_url="http://127.0.0.1")
        answers, asked = [], keys
        while asked:
            body, asked = client.read_chunks(asked)
            answers.append([key for key, _, _ in read_frames(body)])
    assert answers == [[keys[0], keys[2]], [keys[3], keys[4]]]
    assert all(chunk.refs == 1 for chunk in objects.values())  # every reference taken was given back
    monkeypatch.setattr(wire, "MAX_CHUNKS_BODY", 1)
    frames, rest = chunk_bytes.read_chunks(fake_engine(objects), [keys[0], keys[2]], None)  # streamed: an iterator
    assert [key for key, _, _ in read_frames(b"".join(frames))] == [keys[0]] and rest == 1  # one over the cap goes
