"""The four kinds of instance the contract runs against, each started once per module: the in-memory
instance of the fast tests, a configuration directory a real engine filled and left (offline), a real
LMCache standalone engine with kvctl's plugins, and a real `lmcache server` with kvctl's MP routes and a
real `lmcache coordinator` for its pins. Each is a Kind: the opened Instance, what its deployment is
(chunk size, hash algorithm, the tiers a stored chunk lands on, the tiers a pin holds) and `store`."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kvctl.core.config.init import mp_server_argv
from kvctl.core.instance.opening import Selector, open_instance
from kvctl.core.instance.protocol import Instance
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.fast.memory import CHUNK_TOKENS, MemoryInstance, MemoryStore, memory_keys
from tests.helpers import (
    STACK_ENV,
    free_port,
    http_json,
    run_cli,
    standalone_engine,
    start_process,
    stop_process,
    wait_until,
)
from tests.integration.test_mp_l1_lookup import MODEL as MP_MODEL
from tests.integration.test_mp_l1_lookup import Server

CHUNK = 256  # the real deployments' chunk size (kvctl config init's default)
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2  # a standalone engine's chunk on disk: kv, layers, tokens, heads x head size, fp16
PROMPT_SPACING = 100_000  # prompts start this far apart: no two share a prefix, so none shares a chunk
KINDS = ("memory", "offline", "standalone", "mp")


@dataclass
class Kind:
    """One kind of instance under the contract. `store(*chunks)` stores a fresh prompt of each many full
    chunks and answers their token ids once every tier holds them; `unstored(chunks)` a prompt never stored.
    `model` is the one its chunks are of, `pinned_tiers` the tiers a pin holds its chunks on (None: no pins)."""

    name: str
    instance: Instance
    model: str
    chunk_size: int
    hash_algorithm: str
    tiers: tuple[str, ...]
    pinned_tiers: tuple[str, ...] | None
    store: Callable[..., list[list[int]]]
    next_start: list[int] = field(default_factory=lambda: [PROMPT_SPACING])

    def fresh_tokens(self, chunks: int) -> list[int]:
        start = self.next_start[0]
        self.next_start[0] += PROMPT_SPACING
        return list(range(start, start + chunks * self.chunk_size))

    def unstored(self, chunks: int) -> list[int]:
        return self.fresh_tokens(chunks)


def files_in(directory: Path, size: int | None = None) -> set[str]:
    """The regular files of a tier's directory (of exactly `size` bytes when given: written whole)."""
    return {entry.name for entry in os.scandir(directory)
            if entry.is_file(follow_symlinks=False) and (size is None or entry.stat().st_size == size)}


def stored_on_disk(directory: Path, before: set[str], chunks: int, size: int | None = None) -> set[str]:
    """The files a store of `chunks` chunks wrote (the tier writes after the store is answered)."""
    def written() -> set[str] | None:
        new = files_in(directory, size) - before
        return new if len(new) == chunks else None

    return wait_until(written, 30, f"{chunks} chunk files in {directory}")


def no_store(*_chunks: int) -> list[list[int]]:
    raise AssertionError("each kind's fixture sets its own store")


@pytest.fixture(scope="module")
def memory_kind() -> Kind:
    instance = MemoryInstance("memory", [MemoryStore("cpu"), MemoryStore("disk")], model="tiny")
    kind = Kind("memory", instance, "tiny", CHUNK_TOKENS, "crc32", ("cpu", "disk"), ("cpu", "disk"), no_store)

    def store(*chunks: int) -> list[list[int]]:
        prompts = [kind.fresh_tokens(count) for count in chunks]
        for tier in instance.stores:
            tier.names.update(key for tokens in prompts for key in memory_keys(tokens, "tiny"))
        return prompts

    kind.store = store
    return kind


def store_mock(url: str, tokens: list[int]) -> None:
    """A standalone engine stores range(start, end) as a prompt's KV (LMCache's tokens_mock)."""
    http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"{tokens[0]},{tokens[-1] + 1}"})


@pytest.fixture(scope="module")
def standalone_kind(tmp_path_factory) -> Iterator[Kind]:
    root = tmp_path_factory.mktemp("contract-standalone")
    disk = root / "disk"
    with standalone_engine(root, "--tier", "cpu:0.1", "--tier", f"disk:{disk}:1", "--model", "tiny") as url:
        instance = open_instance(Selector(instance=url))
        kind = Kind("standalone", instance, "tiny", CHUNK, "sha256_cbor", ("cpu", "disk"), ("cpu", "disk"), no_store)

        def store(*chunks: int) -> list[list[int]]:
            prompts = [kind.fresh_tokens(count) for count in chunks]
            before = files_in(disk)
            for tokens in prompts:
                store_mock(url, tokens)
            stored_on_disk(disk, before, sum(chunks), CHUNK_BYTES)
            return prompts

        kind.store = store
        yield kind


OFFLINE_POOL = {3: 3, 2: 4, 1: 1}  # chunks -> how many prompts of that size the engine stores for the offline kind


@pytest.fixture(scope="module")
def offline_kind(tmp_path_factory) -> Kind:
    """A real engine stores a pool of prompts on its disk tier and stops; each prompt's files are set aside,
    and `store` puts one back: exactly the files LMCache wrote for it, in the configuration's disk tier."""
    root = tmp_path_factory.mktemp("contract-offline")
    disk = root / "disk"
    pool: dict[int, list[tuple[list[int], Path]]] = {chunks: [] for chunks in OFFLINE_POOL}
    starts = [PROMPT_SPACING]
    with standalone_engine(root, "--tier", "cpu:0.1", "--tier", f"disk:{disk}:1", "--model", "tiny") as url:
        for chunks, count in OFFLINE_POOL.items():
            for _ in range(count):
                tokens = list(range(starts[0], starts[0] + chunks * CHUNK))
                starts[0] += PROMPT_SPACING
                before = files_in(disk)
                store_mock(url, tokens)
                aside = root / "aside" / str(tokens[0])
                aside.mkdir(parents=True)
                for name in stored_on_disk(disk, before, chunks, CHUNK_BYTES):
                    shutil.copy2(disk / name, aside / name)
                pool[chunks].append((tokens, aside))
    for name in files_in(disk):
        (disk / name).unlink()
    instance = open_instance(Selector(config=root / "cfg", kv_dtype="float16"))
    kind = Kind("offline", instance, "tiny", CHUNK, "sha256_cbor", ("disk",), None, no_store, starts)

    def store(*chunks: int) -> list[list[int]]:
        prompts = []
        for count in chunks:
            tokens, aside = pool[count].pop(0)
            for path in aside.iterdir():
                shutil.move(path, disk / path.name)
            prompts.append(tokens)
        return prompts

    kind.store = store
    return kind


@contextlib.contextmanager
def mp_stack(base: Path) -> Iterator[tuple[Server, str]]:
    """A real `lmcache server` (L1 cpu, fs L2 disk) with kvctl's MP routes, and a real coordinator."""
    port, http_port, coordinator_port = free_port(), free_port(), free_port()
    init = run_cli("config", "init", "--mode", "mp", "--out", base / "cfg", "--tier", "cpu:0.05", "--tier",
                   f"disk:{base}/l2", "--mp-port", port, "--mp-http-port", http_port, "--model", MP_MODEL)
    assert init.code == 0, init.stderr
    (base / "l2").mkdir(exist_ok=True)
    values = yaml.safe_load((base / "cfg" / "lmcache.yaml").read_text())
    env = {**os.environ, **STACK_ENV}
    server_log, coordinator_log = base / "server.log", base / "coordinator.log"
    server = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values),
                            *MP_ROUTES_ARGV], server_log, env=env)
    coordinator = start_process([sys.executable, "-m", "lmcache.v1.mp_coordinator", "--host", "127.0.0.1", "--port",
                                 str(coordinator_port), "--chunk-size", str(CHUNK)], coordinator_log, env=env)
    http, coordinator_url = f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{coordinator_port}"
    try:
        wait_until(lambda: http_json("GET", f"{http}/healthcheck"), 120, "lmcache server", server, server_log)
        wait_until(lambda: http_json("GET", f"{coordinator_url}/healthz"), 60, "lmcache coordinator", coordinator,
                   coordinator_log)
        yield Server(base / "cfg", f"tcp://127.0.0.1:{port}", http, base / "l2"), coordinator_url
    finally:
        stop_process(coordinator)
        stop_process(server)


@pytest.fixture(scope="module")
def mp_kind(tmp_path_factory) -> Iterator[Kind]:
    with mp_stack(tmp_path_factory.mktemp("contract-mp")) as (server, coordinator):
        instance = open_instance(Selector(instance=server.http, config=server.config, coordinator=coordinator,
                                          model=MP_MODEL))
        kind = Kind("mp", instance, MP_MODEL, CHUNK, "blake3", ("cpu", "disk"), ("disk",), no_store)  # pins: L2

        def store(*chunks: int) -> list[list[int]]:
            prompts = [kind.fresh_tokens(count) for count in chunks]
            before = files_in(server.l2)
            server.store(*prompts)  # the store client's model is registered with the server only while it runs
            stored_on_disk(server.l2, before, sum(chunks))
            return prompts

        kind.store = store
        yield kind


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> Kind:
    return request.getfixturevalue(f"{request.param}_kind")
