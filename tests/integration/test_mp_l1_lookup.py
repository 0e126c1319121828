"""The MP server's L1 (cpu) tier through kvctl's routes: a real `lmcache server` loaded the way
`kvctl serve --mode mp` loads it, chunks stored by LMCache's own MP client (the CPU worker of
`lmcache bench server`), and `kvctl lookup` merging the server's L1 answer with the fs L2 files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvctl.clients.mp_server import MPServerClient
from kvctl.core.config.init import mp_server_argv
from kvctl.core.lmcache.keys import MPKeyRecipe, mp_object_keys
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.helpers import STACK_ENV, free_port, run_cli, start_process, stop_process, wait_until

STORE_SCRIPT = Path(__file__).parent / "scripts" / "mp_store.py"
MODEL = "test-model"  # the bench client's model name
CHUNK = 256
CHUNK_BYTES = 128 * 1024  # what the store script's KV layout makes of one chunk
L1_GB = 0.002  # 16.4 chunks; the LRU eviction starts at 80 %, i.e. at the 14th chunk


class Server:
    def __init__(self, config: Path, rpc: str, http: str, l2: Path) -> None:
        self.config, self.rpc, self.http, self.l2 = config, rpc, http, l2

    def store(self, *sequences: list[int]) -> None:
        done = subprocess.run([sys.executable, str(STORE_SCRIPT), self.rpc, self.http,
                               *(json.dumps(tokens) for tokens in sequences)],
                              capture_output=True, text=True, timeout=120, env={**os.environ, **STACK_ENV})
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout)["model"] == MODEL

    def lookup(self, tokens_file: Path, *extra: str):
        result = run_cli("lookup", "--config", self.config, "--tokens-file", tokens_file, "--model", MODEL,
                         "--kv-dtype", "float16", "--format", "json", *extra)
        return result, (json.loads(result.stdout) if result.stdout else None)

    def l1_status(self) -> dict:
        with MPServerClient(self.http) as client:
            return client.status()["storage_manager"]["l1_managers"]["_default"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("mp-l1")
    port, http_port = free_port(), free_port()
    init = run_cli("config", "init", "--mode", "mp", "--out", base / "cfg", "--tier", f"cpu:{L1_GB}", "--tier",
                   f"disk:{base}/l2", "--mp-port", port, "--mp-http-port", http_port, "--model", MODEL)
    assert init.code == 0, init.stderr
    values = yaml.safe_load((base / "cfg" / "lmcache.yaml").read_text())
    log = base / "server.log"
    proc = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values),
                          *MP_ROUTES_ARGV], log)
    http = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: MPServerClient(http).info()["chunk_size"] == CHUNK, 120, "lmcache server", proc, log)
        yield Server(base / "cfg", f"tcp://127.0.0.1:{port}", http, base / "l2")
    finally:
        stop_process(proc)


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(count)]


def write_tokens(path: Path, ids: list[int]) -> Path:
    path.write_text(json.dumps(ids))
    return path


def wait_for_l2(server: Server, ids: list[int]) -> None:
    """The fs adapter writes after the store is answered."""
    names = [ranks[0].fs_file_name() for ranks in mp_object_keys(ids, MPKeyRecipe(MODEL, CHUNK))]
    wait_until(lambda: all((server.l2 / name).exists() for name in names), 30, "fs L2 files")


@pytest.mark.slow
def test_lookup_reports_cpu_for_exactly_the_stored_chunks(server, tmp_path):
    prompt = tokens(1, 3 * CHUNK + 100)
    server.store(prompt[:2 * CHUNK])
    wait_for_l2(server, prompt[:2 * CHUNK])
    result, report = server.lookup(write_tokens(tmp_path / "p.json", prompt), "--instance", server.http)
    assert result.code == 0, result.stderr
    assert report["mode"] == "mp" and report["tiers_checked"] == ["cpu", "disk"]
    assert [chunk["tiers"] for chunk in report["chunks"]] == [["cpu", "disk"], ["cpu", "disk"], []]
    assert report["hit_tokens"] == {"cpu": 2 * CHUNK, "disk": 2 * CHUNK, "redis": None, "total": 2 * CHUNK}
    expected = mp_object_keys(prompt, MPKeyRecipe(MODEL, CHUNK))
    assert [chunk["key"] for chunk in report["chunks"]] == [ranks[0].native_key() for ranks in expected]
    assert "L1 (cpu)" not in result.stderr

    _, other = server.lookup(write_tokens(tmp_path / "other.json", tokens(2, 2 * CHUNK)), "--instance", server.http)
    assert [chunk["tiers"] for chunk in other["chunks"]] == [[], []] and other["hit_tokens"]["total"] == 0

    offline, report = server.lookup(tmp_path / "p.json", "--offline")
    assert offline.code == 0 and report["tiers_checked"] == ["disk"] and report["hit_tokens"]["cpu"] is None

    down, report = server.lookup(tmp_path / "p.json", "--instance", f"http://127.0.0.1:{free_port()}")
    assert down.code == 6 and report["tiers_checked"] == ["disk"] and "cpu" in report["errors"]


@pytest.mark.slow
def test_a_server_with_another_chunk_size_is_refused_not_misread(server, tmp_path):
    config = tmp_path / "cfg"
    config.mkdir()
    for name in ("lmcache.yaml", "kv-transfer-config.json", "env.sh"):
        (config / name).write_text((server.config / name).read_text().replace("chunk_size: 256", "chunk_size: 128"))
    result = run_cli("lookup", "--config", config, "--tokens-file", write_tokens(tmp_path / "t.json", tokens(3, 512)),
                     "--model", MODEL, "--kv-dtype", "float16", "--instance", server.http, "--format", "json")
    assert result.code == 6 and "other chunk keys" in json.loads(result.stdout)["errors"]["cpu"]


@pytest.mark.slow
def test_lookup_takes_no_lock_and_leaves_the_eviction_order_alone(server, tmp_path):
    """Older A, newer B; A is looked up many times; then L1 fills past the watermark. LRU evicts A
    first only if the lookups left it where it was (a touch would move A behind B)."""
    with MPServerClient(server.http) as client:
        client.clear(force=True)
    first, second = tokens(10, 2 * CHUNK), tokens(11, 2 * CHUNK)
    server.store(first, second)
    before = server.l1_status()
    assert before["total_object_count"] == 4 and before["read_locked_count"] == 0
    with MPServerClient(server.http) as client:
        for _ in range(20):
            assert [chunk["tiers"] for chunk in client.lookup(first, MODEL)["chunks"]] == [["cpu"], ["cpu"]]
    result, _ = server.lookup(write_tokens(tmp_path / "first.json", first), "--instance", server.http)
    assert result.code == 0, result.stderr
    after = server.l1_status()
    assert (after["total_object_count"], after["read_locked_count"], after["write_locked_count"]) == (4, 0, 0)

    fillers = [tokens(20 + n, 2 * CHUNK) for n in range(5)]  # 14 chunks: over the watermark
    server.store(*fillers)
    with MPServerClient(server.http) as client:
        wait_until(lambda: client.lookup(first, MODEL)["chunks"][0]["tiers"] == [], 30, "eviction of the oldest prompt")
        assert [chunk["tiers"] for chunk in client.lookup(second, MODEL)["chunks"]] == [["cpu"], ["cpu"]]
    wait_for_l2(server, first)
    _, report = server.lookup(tmp_path / "first.json", "--instance", server.http)
    assert [chunk["tiers"] for chunk in report["chunks"]] == [["disk"], ["disk"]]  # evicted from L1, kept in L2
