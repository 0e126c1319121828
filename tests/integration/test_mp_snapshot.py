"""`kvctl snapshot` against real `lmcache server`s (MP mode) with kvctl's routes: server A holds a prompt's
chunks in L1, stored by LMCache's own MP client; its snapshot loads into server B, which never saw the
prompt, through B's storage manager, byte for byte, and B then serves that KV to a vLLM-like client. A
target with another chunk size, a changed file, an in-process target, another tier and malformed frames
are refused with nothing written; reading takes no lock it keeps and leaves L1's eviction order alone.

Offline, an MP configuration's fs directory and resp Redis (real redis-servers) are read and written
directly: A's snapshot loaded into a configuration no server runs is byte for byte what LMCache's own fs
and resp adapters write for the same prompt (server W), and a server then started on it serves the KV
from L2; W's L2, saved from its configuration, loads into B, which serves it."""

import contextlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from kvctl_plugins.wire import frame_header, read_frames

from kvctl.clients.mp_server import MPServerClient
from kvctl.core.config.init import mp_server_argv
from kvctl.core.errors import RejectedError
from kvctl.core.instance.opening import Selector, open_instance
from kvctl.core.lmcache.keys import MPKeyRecipe, mp_object_keys
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.conftest import RedisStarter
from tests.helpers import STACK_ENV, free_port, http_client, run_cli, start_process, stop_process, wait_until
from tests.integration.test_mp_l1_lookup import CHUNK, CHUNK_BYTES, MODEL, tokens, write_tokens

HOLD_SCRIPT = Path(__file__).parent / "scripts" / "mp_hold.py"
L1_GB = 0.002  # 16.4 chunks; the LRU eviction starts at 80 %, i.e. at the 14th chunk
PROMPT = tokens(60, 3 * CHUNK + 100)
PROMPT_KEYS = [ranks[0].native_key() for ranks in mp_object_keys(PROMPT, MPKeyRecipe(MODEL, CHUNK))]


class Holder:
    """LMCache's MP client, connected (its KV cache registered) for as long as the module runs."""

    def __init__(self, rpc: str, http: str, log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(HOLD_SCRIPT), rpc, http], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True,
                                     env={**os.environ, **STACK_ENV})
        ready = self.proc.stdout.readline()
        assert ready and json.loads(ready)["model"] == MODEL, log.read_text()[-3000:]

    def ask(self, op: str, ids: list[int]) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, "tokens": ids}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the MP client failed: {self.log.name}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        stop_process(self.proc)
        self.log.close()


class Node:
    def __init__(self, http: str, holder: Holder | None) -> None:
        self.http, self.holder = http, holder

    def l1(self) -> dict:
        with MPServerClient(self.http) as client:
            return client.status()["storage_manager"]["l1_managers"]["_default"]

    def clear(self) -> None:
        with MPServerClient(self.http) as client:
            client.clear(force=True)

    def kvctl(self, *args: str):
        result = run_cli(*args, "--instance", self.http, "--format", "json")
        return result, (json.loads(result.stdout) if result.stdout else None)


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """No `kvctl serve` state of this machine's user is read (it could name a running engine)."""
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "kvctl-cache"))


def configure(out: Path, *tiers: str, chunk: int = CHUNK) -> tuple[str, str]:
    """A `kvctl config init --mode mp` directory (chunk size `chunk`) and its server's (RPC, HTTP) URLs."""
    port, http_port = free_port(), free_port()
    init = run_cli("config", "init", "--mode", "mp", "--out", out, *(arg for tier in tiers for arg in ("--tier", tier)),
                   "--mp-port", port, "--mp-http-port", http_port, "--model", MODEL)
    assert init.code == 0, init.stderr
    values = yaml.safe_load((out / "lmcache.yaml").read_text())
    (out / "lmcache.yaml").write_text(yaml.safe_dump({**values, "chunk_size": chunk}))
    return f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"


def launch(config: Path, log: Path) -> subprocess.Popen:
    """`lmcache server` of a configuration, with kvctl's routes, as `kvctl serve --mode mp` starts it."""
    values = yaml.safe_load((config / "lmcache.yaml").read_text())
    return start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values),
                          *MP_ROUTES_ARGV], log)


def wait_serving(proc: subprocess.Popen, log: Path, http: str, chunk: int = CHUNK) -> None:
    wait_until(lambda: MPServerClient(http).info()["chunk_size"] == chunk, 120, "lmcache server", proc, log)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """A and B (chunk size 256, each with a connected client), C (chunk size 128, nothing connected)."""
    base = tmp_path_factory.mktemp("mp-snapshot")
    started, holders, found = [], [], {}
    try:
        for name, gb, chunk in (("a", L1_GB, CHUNK), ("b", 0.05, CHUNK), ("c", 0.05, 128)):
            rpc, http = configure(base / name, f"cpu:{gb}", chunk=chunk)
            log = base / f"{name}.log"
            started.append((launch(base / name, log), log))
            found[name] = (rpc, http, chunk)
        for (proc, log), (_, http, chunk) in zip(started, found.values()):
            wait_serving(proc, log, http, chunk)
        for name in ("a", "b"):
            holders.append(Holder(found[name][0], found[name][1], base / f"{name}-client.log"))
        yield {name: Node(http, holder) for (name, (_, http, _)), holder in zip(found.items(), [*holders, None])}
    finally:
        for holder in holders:
            holder.close()
        for proc, _ in started:
            stop_process(proc)


@pytest.fixture(scope="module")
def snapshot_of_a(nodes, tmp_path_factory):
    """A's snapshot of PROMPT (3 complete chunks in A's L1), and the KV checksums A's client stored."""
    base = tmp_path_factory.mktemp("saved")
    nodes["a"].clear()
    stored = nodes["a"].holder.ask("store", PROMPT)["checksums"]
    prompt = write_tokens(base / "prompt.json", PROMPT)
    result, report = nodes["a"].kvctl("snapshot", "save", "--tokens-file", prompt, "-o", base / "a.kvsnap")
    assert result.code == 0, result.stderr
    assert report["chunks"] == 3 and report["bytes"] == 3 * CHUNK_BYTES and report["missing"] == 0
    return base / "a.kvsnap", prompt, stored


def manifest_of(path: Path) -> dict:
    with tarfile.open(path) as archive:
        return json.load(archive.extractfile("manifest.json"))


@pytest.mark.slow
def test_a_snapshot_of_one_server_loads_into_another_which_then_serves_the_same_kv(nodes, snapshot_of_a, tmp_path):
    path, prompt, stored = snapshot_of_a
    manifest = manifest_of(path)
    assert manifest["keys"] == {"model": MODEL, "kv_dtype": "float16", "world_size": 1, "chunk_size": CHUNK,
                                "hash_algorithm": "blake3", "hash_seed": manifest["keys"]["hash_seed"]}
    assert manifest["source"]["kind"] == "mp" and manifest["source"]["key_format"] == "mp-object"
    assert manifest["prompts"][0]["keys"] == PROMPT_KEYS
    assert [chunk["key"] for chunk in manifest["chunks"]] == PROMPT_KEYS
    assert all(chunk["metadata"] is None for chunk in manifest["chunks"])

    b = nodes["b"]
    b.clear()
    assert b.holder.ask("retrieve", PROMPT)["hit_chunks"] == 0
    result, report = b.kvctl("snapshot", "load", path)
    assert result.code == 0, result.stderr
    assert (report["written"], report["already"], report["dropped"]) == ({"cpu": 3}, {"cpu": 0}, {"cpu": 0})
    assert report["prompts"] == [{"source": str(prompt), "tokens": len(PROMPT), "chunks": 3, "cached": 3,
                                  "hit_tokens": 3 * CHUNK}]
    l1 = b.l1()
    assert (l1["total_object_count"], l1["read_locked_count"], l1["write_locked_count"]) == (3, 0, 0)

    looked, answer = b.kvctl("lookup", "--tokens-file", prompt, "--model", MODEL)
    assert looked.code == 0, looked.stderr
    assert [chunk["tiers"] for chunk in answer["chunks"]] == [["cpu"]] * 3 and answer["hit_tokens"]["cpu"] == 3 * CHUNK
    assert [chunk["key"] for chunk in answer["chunks"]] == PROMPT_KEYS

    again, copy = b.kvctl("snapshot", "save", "--tokens-file", prompt, "-o", tmp_path / "b.kvsnap")
    assert again.code == 0, again.stderr
    assert [(c["key"], c["blake3"]) for c in manifest_of(tmp_path / "b.kvsnap")["chunks"]] == \
        [(c["key"], c["blake3"]) for c in manifest["chunks"]]  # byte for byte
    whole, report = b.kvctl("snapshot", "save", "--tier", "cpu", "--all", "-o", tmp_path / "l1.kvsnap")
    assert whole.code == 0 and report["chunks"] == 3, whole.stderr
    served = b.holder.ask("retrieve", PROMPT)  # LMCache itself hands the loaded KV to its client
    assert served["hit_chunks"] == 3 and served["checksums"] == stored

    twice, report = b.kvctl("snapshot", "load", path)
    assert twice.code == 0 and (report["written"], report["already"]) == ({"cpu": 0}, {"cpu": 3})
    listed = run_cli("snapshot", "ls", path, "--format", "json")
    assert listed.code == 0 and json.loads(listed.stdout)["source"]["key_format"] == "mp-object"


@pytest.mark.slow
def test_what_would_not_be_hit_or_was_changed_is_refused_with_nothing_written(nodes, snapshot_of_a, tmp_path):
    path, _, _ = snapshot_of_a
    b, c = nodes["b"], nodes["c"]
    b.clear()
    result, _ = c.kvctl("snapshot", "load", path)
    assert result.code == 2 and "chunk size 256" in result.stderr and "128" in result.stderr, result.stderr
    assert "hint:" in result.stderr and c.l1()["total_object_count"] == 0

    changed = tmp_path / "changed.kvsnap"
    data = bytearray(path.read_bytes())
    data[512 + 1000] ^= 1  # a byte of the first chunk's data
    changed.write_bytes(data)
    result, _ = b.kvctl("snapshot", "load", changed)
    assert result.code == 1 and "checksum" in result.stderr, result.stderr

    result, _ = b.kvctl("snapshot", "load", path, "--tier", "disk")
    assert result.code == 2 and "L1 (cpu) only" in result.stderr, result.stderr
    assert b.l1()["total_object_count"] == 0

    config = tmp_path / "inprocess"
    assert run_cli("config", "init", "--out", config, "--tier", f"disk:{tmp_path}/disk", "--model", "tiny").code == 0
    result = run_cli("snapshot", "load", path, "--config", config, "--model", "tiny", "--kv-dtype", "float16")
    lines = result.stderr.splitlines()
    assert result.code == 2 and "keyed by an MP object key" in lines[0] and lines[1].startswith("hint:"), lines
    assert not (tmp_path / "disk").exists() or not any((tmp_path / "disk").iterdir())


@pytest.mark.slow
def test_the_write_route_checks_every_frame_before_it_writes_any(nodes, snapshot_of_a):
    a, b = nodes["a"], nodes["b"]
    with MPServerClient(a.http) as client:
        body, rest = client.read_chunks(PROMPT_KEYS + ["test-model@01000100@0@" + "ab" * 32])
    assert rest == [] and [key for key, _, _ in read_frames(body)] == PROMPT_KEYS  # the unknown one: not held
    (key, data, _), (other, other_data, _) = list(read_frames(body))[:2]
    good = frame_header(key, len(data), None) + bytes(data)
    fields = other.split("@")

    def frame(name: str, chunk: bytes, metadata: bytes | None = None) -> bytes:
        return good + frame_header(name, len(chunk), metadata) + chunk

    refusals = {
        "wrong size": (frame(other, bytes(other_data)[:-2]), f"{CHUNK_BYTES - 2} bytes"),
        "another model": (frame("other@" + other.split("@", 1)[1], bytes(other_data)), "'other' at world size 1"),
        "another world size": (frame("@".join([fields[0], "02000200", *fields[2:]]), bytes(other_data)),
                               "world size 2"),
        "no such rank": (frame("@".join([fields[0], "01010101", *fields[2:]]), bytes(other_data)), "no worker makes"),
        "another group": (frame("@".join([fields[0], fields[1], "1", fields[3]]), bytes(other_data)),
                          "object group 1"),
        "metadata": (frame(other, bytes(other_data), b"\1\2"), "metadata header"),
        "not a key": (frame("test-model@1@0@zz", bytes(other_data)), "not an MP object key"),
        "twice": (frame(key, bytes(data)), "comes twice"),
        "cut short": (good + frame_header(other, len(other_data), None) + bytes(other_data)[:-10], "cut short"),
        "empty": (b"", "no chunk frames"),
    }
    b.clear()
    with MPServerClient(b.http) as client:
        for name, (payload, message) in refusals.items():
            with pytest.raises(RejectedError, match="rejected") as refused:
                client.write_chunks(payload)
            assert message in refused.value.message, name
        url = f"{b.http}/kvctl/v1/chunks/write"
        answer = http_client().post(url, params={"tiers": "l2"}, content=good,
                            headers={"Content-Type": "application/octet-stream"})
        assert answer.status_code == 400 and "L1 (cpu) only" in answer.json()["message"]
        assert http_client().post(url, json={"keys": []}).status_code == 415
        assert http_client().post(f"{b.http}/kvctl/v1/chunks/read", json={"keys": ["nope"]}).status_code == 400
        assert b.l1()["total_object_count"] == 0
        assert client.write_chunks(good) == {"written": {"cpu": 1}, "already": {"cpu": 0}, "dropped": {"cpu": 0}}
        again, _ = client.read_chunks([key])
    assert list(read_frames(again))[0][1] == data


@pytest.mark.slow
def test_reading_takes_no_lock_it_keeps_and_leaves_the_eviction_order_alone(nodes):
    """Older A, newer B; A's bytes are read many times; then L1 fills past the watermark. LRU evicts A
    first only if the reads left it where it was (a touch would move A behind B)."""
    node = nodes["a"]
    node.clear()
    first, second = tokens(70, 2 * CHUNK), tokens(71, 2 * CHUNK)
    node.holder.ask("store", first)
    node.holder.ask("store", second)
    first_keys = [ranks[0].native_key() for ranks in mp_object_keys(first, MPKeyRecipe(MODEL, CHUNK))]
    with MPServerClient(node.http) as client:
        for _ in range(20):
            body, _ = client.read_chunks(first_keys)
            assert len(list(read_frames(body))) == 2
        l1 = node.l1()
        assert (l1["total_object_count"], l1["read_locked_count"], l1["write_locked_count"]) == (4, 0, 0)
        for n in range(5):  # 10 more chunks: over the watermark
            node.holder.ask("store", tokens(80 + n, 2 * CHUNK))
        wait_until(lambda: client.lookup(first, MODEL)["chunks"][0]["tiers"] == [], 30, "eviction of the oldest")
        assert [chunk["tiers"] for chunk in client.lookup(second, MODEL)["chunks"]] == [["cpu"], ["cpu"]]


# -- an MP configuration offline: its fs directory and resp Redis read and written directly ----------


class Offline:
    """An MP configuration (cpu, fs L2 in `l2`, resp L2 on `redis`) and, once started, its server."""

    def __init__(self, base: Path, name: str, redis) -> None:
        self.config, self.l2, self.redis = base / name, base / f"{name}-l2", redis.client()
        self.rpc, self.http = configure(self.config, "cpu:0.05", f"disk:{self.l2}", redis.url)
        self.log = base / f"{name}.log"

    def kvctl(self, *args: str):
        result = run_cli(*args, "--config", self.config, "--format", "json")
        return result, (json.loads(result.stdout) if result.stdout else None)

    def files(self) -> dict[str, bytes]:
        return {path.name: path.read_bytes() for path in self.l2.iterdir()} if self.l2.exists() else {}

    def values(self) -> dict[bytes, bytes]:
        return {name: self.redis.get(name) for name in self.redis.keys("*")}

    @contextlib.contextmanager
    def serving(self):
        """Its server, with LMCache's MP client connected, for as long as the block runs."""
        proc = launch(self.config, self.log)
        holder = None
        try:
            wait_serving(proc, self.log, self.http)
            holder = Holder(self.rpc, self.http, self.log.with_suffix(".client.log"))
            yield holder
        finally:
            if holder:
                holder.close()
            stop_process(proc)


@pytest.fixture(scope="module")
def l2_stack(tmp_path_factory):
    """W: a running server with fs and resp L2 (LMCache's own adapters) that stored PROMPT through its
    client, and its checksums; O: a configuration of the same shape on its own directory and Redis,
    with no server (yet)."""
    base = tmp_path_factory.mktemp("mp-l2")
    redis = RedisStarter(base)
    w, o = Offline(base, "w", redis()), Offline(base, "o", redis())
    proc = launch(w.config, w.log)
    holder = None
    try:
        wait_serving(proc, w.log, w.http)
        holder = Holder(w.rpc, w.http, base / "w-client.log")
        stored = holder.ask("store", PROMPT)["checksums"]
        names = [ranks[0] for ranks in mp_object_keys(PROMPT, MPKeyRecipe(MODEL, CHUNK))]
        wait_until(lambda: all((w.l2 / key.fs_file_name()).exists() and w.redis.exists(key.native_key())
                               for key in names), 30, "fs and resp L2 writes")
        yield {"w": w, "o": o, "stored": stored}
    finally:
        if holder:
            holder.close()
        stop_process(proc)
        redis.stop_all()


@pytest.mark.slow
def test_a_live_servers_snapshot_loads_offline_as_lmcaches_own_l2_adapters_write_it_and_is_served(
        nodes, snapshot_of_a, l2_stack, tmp_path):
    path, prompt, stored = snapshot_of_a
    w, o = l2_stack["w"], l2_stack["o"]
    offline, live = open_instance(Selector(config=o.config)), open_instance(Selector(instance=w.http))
    assert offline.key_format == live.key_format == "mp-object"
    assert offline.prompt_keys(PROMPT) == live.prompt_keys(PROMPT) == PROMPT_KEYS

    for tier in ("disk", "redis"):
        result, report = o.kvctl("snapshot", "load", path, "--tier", tier)
        assert result.code == 0, result.stderr
        assert (report["written"], report["already"]) == ({tier: 3}, {tier: 0})
        assert report["prompts"] == [{"source": str(prompt), "tokens": len(PROMPT), "chunks": 3, "cached": 3,
                                      "hit_tokens": 3 * CHUNK}]
    assert o.files() == w.files() and len(w.files()) == 3  # names and bytes: what the fs adapter wrote
    assert o.values() == w.values() and len(w.values()) == 3  # and the resp adapter: the object's bytes alone

    again, _ = o.kvctl("snapshot", "load", path, "--tier", "disk")
    assert again.code == 0 and json.loads(again.stdout)["already"] == {"disk": 3}
    with o.serving() as holder:  # a fresh server: its L1 is empty, LMCache prefetches from its L2
        served = holder.ask("retrieve", PROMPT)
        assert served["hit_chunks"] == 3 and served["checksums"] == stored == l2_stack["stored"]


@pytest.mark.slow
def test_what_a_server_wrote_to_l2_saved_from_its_configuration_loads_into_another_server(
        nodes, snapshot_of_a, l2_stack, tmp_path):
    path, prompt, _ = snapshot_of_a
    w, b = l2_stack["w"], nodes["b"]
    saved = {}
    for name, selection in (("prompt", ("--tokens-file", prompt)), ("resp", ("--tier", "redis", "--all"))):
        result, report = w.kvctl("snapshot", "save", *selection, "-o", tmp_path / f"{name}.kvsnap")
        assert result.code == 0 and report["chunks"] == 3 and report["missing"] == 0, result.stderr
        saved[name] = manifest_of(tmp_path / f"{name}.kvsnap")
    live = manifest_of(path)
    assert saved["prompt"]["source"]["kind"] == "offline" and saved["prompt"]["source"]["key_format"] == "mp-object"
    unknown_offline = {"kv_dtype": None, "hash_seed": saved["prompt"]["keys"]["hash_seed"]}  # blake3: seed-free
    assert saved["prompt"]["keys"] == {**live["keys"], **unknown_offline}  # no vLLM registered a dtype here
    assert saved["prompt"]["prompts"][0]["keys"] == live["prompts"][0]["keys"] == PROMPT_KEYS
    for manifest in saved.values():  # fs and resp hold the very bytes L1 holds
        assert sorted((c["key"], c["blake3"], c["metadata"]) for c in manifest["chunks"]) == \
            sorted((c["key"], c["blake3"], c["metadata"]) for c in live["chunks"])

    b.clear()
    result, report = b.kvctl("snapshot", "load", tmp_path / "prompt.kvsnap")
    assert result.code == 0 and report["written"] == {"cpu": 3}, result.stderr
    served = b.holder.ask("retrieve", PROMPT)
    assert served["hit_chunks"] == 3 and served["checksums"] == l2_stack["stored"]


@pytest.mark.slow
def test_an_mp_configuration_refuses_what_it_cannot_take_with_nothing_written(nodes, snapshot_of_a, l2_stack,
                                                                              tmp_path):
    path, _, _ = snapshot_of_a
    w = l2_stack["w"]
    before = (w.files(), w.values())
    for tier in ("disk", "redis"):  # its server runs: it would not account for what is written behind its back
        result, _ = w.kvctl("snapshot", "load", path, "--tier", tier)
        assert result.code == 2 and f"running at {w.http}" in result.stderr, result.stderr
        assert f"--instance {w.http}" in result.stderr
    result, _ = w.kvctl("snapshot", "load", path, "--tier", "cpu")
    assert result.code == 2 and "hint: the MP server's L1 (cpu) lives in a running server" in result.stderr
    assert (w.files(), w.values()) == before and not [p for p in w.l2.iterdir() if "partial" in p.name]

    other = tmp_path / "other"
    configure(other, "cpu:0.05", f"disk:{tmp_path}/other-l2", chunk=128)
    result = run_cli("snapshot", "load", path, "--config", other)
    assert result.code == 2 and "chunk size 256" in result.stderr and "128" in result.stderr, result.stderr
    assert not (tmp_path / "other-l2").exists()

    inprocess = tmp_path / "inprocess"  # a chunk-keyed snapshot, saved from an in-process configuration's disk
    assert run_cli("config", "init", "--out", inprocess, "--tier", f"disk:{tmp_path}/disk", "--model", MODEL).code == 0
    key = "test-model@1@0@1f@half"
    (tmp_path / "disk").mkdir(exist_ok=True)
    (tmp_path / "disk" / f"{key}.pt").write_bytes(b"\1" * 64)
    saved = run_cli("snapshot", "save", "--tier", "disk", "--all", "--config", inprocess, "--kv-dtype", "float16",
                    "-o", tmp_path / "chunk.kvsnap")
    assert saved.code == 0, saved.stderr
    result = run_cli("snapshot", "load", tmp_path / "chunk.kvsnap", "--config", other)
    lines = result.stderr.splitlines()
    assert result.code == 2 and "keyed by an LMCache chunk key" in lines[0] and lines[1].startswith("hint:"), lines
    assert not (tmp_path / "other-l2").exists()
