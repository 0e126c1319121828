"""OfflineInstance: eviction from a configuration directory with no engine running. A real LMCache
engine writes chunks of two models to its disk tier and a real Redis, and a real MP server writes to
its fs and resp L2 adapters; stray files and foreign Redis keys lie beside them. Every test starts
from that state, restored byte for byte."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvctl.core.config.init import mp_server_argv
from kvctl.core.errors import UsageError
from kvctl.core.instance.offline import OfflineInstance
from kvctl.core.instance.protocol import Selection, Unsupported
from kvctl.core.lmcache.keys import KeyRecipe, MPKeyRecipe, ObjectKey, disk_file_name, inprocess_keys, mp_object_keys
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.conftest import RedisStarter
from tests.helpers import (
    STACK_ENV,
    Engine,
    free_port,
    http_json,
    init_engine,
    run_cli,
    run_kvctl,
    start_process,
    stop_process,
    tier_args,
    wait_until,
)
from tests.integration.test_mp_l1_lookup import MODEL as MP_MODEL
from tests.integration.test_mp_l1_lookup import Server, tokens

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2  # kv, layers, tokens, heads x head size, float16
PROMPTS = {"a": [(0, 4), (2048, 2)], "b": [(0, 4)]}  # per model: (first token, chunks) stored with tokens_mock
STRAY_FILES = {"notes.txt": b"not a chunk", "readme.pt": b"not a chunk either", "a@1@0@report@half.pt": b"look-alike"}
FOREIGN_KEYS = ("user:1", "foo@bar", "a@1@0@report@halfmetadata", "c@1@0@1f@halfkv_bytes", "c@1@0@1f@halfmetadata")


def prompt(start: int, chunks: int) -> list[int]:
    return list(range(start, start + chunks * CHUNK))


def keys_of(model: str, *prompts: tuple[int, int]) -> list[str]:
    recipe = KeyRecipe(model, CHUNK, "sha256_cbor", "0", kv_dtype="half")
    return [key for start, chunks in prompts for key in inprocess_keys(prompt(start, chunks), recipe)]


def redis_names(keys: list[str]) -> set[str]:
    return {key + suffix for key in keys for suffix in ("kv_bytes", "metadata")}


class Stores:
    """A disk directory and a Redis database as the engine left them, restorable before each test."""

    def __init__(self, directory: Path, redis) -> None:
        self.directory, self.redis = directory, redis

    def snapshot(self) -> None:
        self.files = {path.name: path.read_bytes() for path in self.directory.iterdir()}
        self.values = {key: self.redis.dump(key) for key in self.redis.scan_iter()}

    def restore(self) -> None:
        for path in self.directory.iterdir():
            path.unlink()
        for name, data in self.files.items():
            (self.directory / name).write_bytes(data)
        self.redis.flushdb()
        for key, value in self.values.items():
            self.redis.restore(key, 0, value)

    def file_names(self) -> set[str]:
        return {path.name for path in self.directory.iterdir()}

    def key_names(self) -> set[str]:
        return {key.decode() for key in self.redis.scan_iter()}


class InProcess(Stores):
    def __init__(self, root: Path, redis, url: str) -> None:
        super().__init__(root / "disk", redis)
        self.root, self.config, self.url = root, root / "cfg", url

    @contextlib.contextmanager
    def engine(self, model: str):
        with Engine(self.root, model=model):
            yield

    def store(self, model: str, prompts: list[tuple[int, int]]) -> None:
        """Store through the running engine, and wait until every chunk is whole on disk and in Redis."""
        for start, chunks in prompts:
            http_json("POST", f"{self.url}/cache/store", params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
        keys = keys_of(model, *prompts)
        files = [self.directory / disk_file_name(key) for key in keys]
        wait_until(lambda: all(path.exists() and path.stat().st_size == CHUNK_BYTES for path in files), 30,
                   "disk files")
        wait_until(lambda: all(self.redis.exists(key + "metadata") for key in keys), 30, "chunks in Redis")

    def instance(self, model: str | None = None) -> OfflineInstance:
        return OfflineInstance(self.config, model, "float16", 1, None, None)


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """No `kvctl serve` state of this machine's user is read (they could name a running engine)."""
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "kvctl-cache"))


@pytest.fixture(scope="module")
def inprocess(tmp_path_factory, module_redis):
    """Chunks of models a and b, written by two runs of a real engine (CPU, disk and Redis tiers), then
    the decoys; the engine stopped."""
    root = tmp_path_factory.mktemp("offline-evict")
    configured = init_engine(root, *tier_args("cpu:0.1", f"disk:{root}/disk:1", module_redis.url), "--model", "a")
    deployment = InProcess(root, module_redis.client(), configured.url)
    for model, stored in PROMPTS.items():
        with deployment.engine(model):
            deployment.store(model, stored)
    for name, data in STRAY_FILES.items():
        (deployment.directory / name).write_bytes(data)
    for key in FOREIGN_KEYS:
        deployment.redis.set(key, b"keep me")
    deployment.snapshot()
    assert deployment.file_names() == {disk_file_name(key) for key in keys_of("a", *PROMPTS["a"])
                                       + keys_of("b", *PROMPTS["b"])} | set(STRAY_FILES)
    yield deployment


def fresh(deployment: Stores) -> Stores:
    deployment.restore()
    return deployment


def chunk_pairs(plan) -> list[tuple[str, str]]:
    return sorted((chunk["tier"], chunk["key"]) for chunk in plan.chunks)


@pytest.mark.slow
def test_whole_tiers_take_exactly_the_models_chunks_and_execute_removes_what_was_planned(inprocess):
    deployment = fresh(inprocess)
    files, keys = deployment.file_names(), deployment.key_names()
    a_keys = keys_of("a", *PROMPTS["a"])
    plan = deployment.instance().plan_eviction(Selection())  # the model: env.sh's KVCTL_MODEL
    assert plan.dry_run and plan.removed == {"disk": 6, "redis": 6} and plan.skipped_pinned == {"disk": 0, "redis": 0}
    assert chunk_pairs(plan) == sorted((tier, key) for tier in ("disk", "redis") for key in a_keys)
    assert deployment.file_names() == files and deployment.key_names() == keys  # a dry run removes nothing

    done = deployment.instance().execute_eviction(plan)
    assert not done.dry_run and done.removed == plan.removed and chunk_pairs(done) == chunk_pairs(plan)
    assert deployment.file_names() == files - {disk_file_name(key) for key in a_keys}
    assert deployment.key_names() == keys - redis_names(a_keys)  # both names of every chunk, nothing else
    assert all((deployment.directory / name).read_bytes() == data for name, data in STRAY_FILES.items())

    b_keys = keys_of("b", *PROMPTS["b"])
    plan = deployment.instance().plan_eviction(Selection(tiers=("redis",), model="b"))
    assert plan.removed == {"redis": 4} and chunk_pairs(plan) == sorted(("redis", key) for key in b_keys)
    assert deployment.instance().execute_eviction(plan).removed == {"redis": 4}
    assert deployment.key_names() == set(FOREIGN_KEYS)
    assert deployment.file_names() == set(STRAY_FILES) | {disk_file_name(key) for key in b_keys}


@pytest.mark.slow
def test_a_prompt_takes_its_chunks_on_every_selected_tier_and_nothing_else(inprocess):
    deployment = fresh(inprocess)
    files, keys = deployment.file_names(), deployment.key_names()
    second = keys_of("a", PROMPTS["a"][1])
    selection = Selection(tokens=tuple(prompt(*PROMPTS["a"][1]) + list(range(100))))  # an unfull tail stores nothing
    plan = deployment.instance().plan_eviction(selection)
    assert plan.removed == {"disk": 2, "redis": 2}
    assert chunk_pairs(plan) == sorted((tier, key) for tier in ("disk", "redis") for key in second)
    assert chunk_pairs(deployment.instance().execute_eviction(plan)) == chunk_pairs(plan)
    assert deployment.file_names() == files - {disk_file_name(key) for key in second}
    assert deployment.key_names() == keys - redis_names(second)

    first_of_b = keys_of("b", PROMPTS["b"][0])
    plan = deployment.instance().plan_eviction(Selection(tokens=tuple(prompt(*PROMPTS["b"][0])), model="b",
                                                         tiers=("disk",)))
    assert chunk_pairs(plan) == sorted(("disk", key) for key in first_of_b)
    deployment.instance().execute_eviction(plan)
    assert deployment.file_names() == files - {disk_file_name(key) for key in second + first_of_b}
    assert deployment.key_names() == keys - redis_names(second)


@pytest.mark.slow
def test_given_keys_of_any_model_are_taken_and_a_non_key_is_refused(inprocess):
    deployment = fresh(inprocess)
    files, keys = deployment.file_names(), deployment.key_names()
    chosen = [keys_of("b", *PROMPTS["b"])[2], keys_of("a", *PROMPTS["a"])[0], "c@1@0@1f@half"]
    instance = deployment.instance()
    plan = instance.plan_eviction(Selection(keys=(*chosen, chosen[0], "a@1@0@123@half")))  # a repeat, one not stored
    assert plan.removed == {"disk": 2, "redis": 3}
    assert chunk_pairs(plan) == sorted([("disk", key) for key in chosen[:2]] + [("redis", key) for key in chosen])
    assert deployment.instance().execute_eviction(plan).removed == {"disk": 2, "redis": 3}
    assert deployment.file_names() == files - {disk_file_name(key) for key in chosen[:2]}
    assert deployment.key_names() == keys - redis_names(chosen)

    for bad in ("user:1", "a@1@0@report@half", "a@1@0@0AB@half"):
        with pytest.raises(UsageError, match="not an LMCache chunk key"):
            instance.plan_eviction(Selection(keys=(bad,)))
    assert deployment.file_names() == files - {disk_file_name(key) for key in chosen[:2]}


@pytest.mark.slow
def test_removal_counts_what_really_went_and_never_follows_a_symlink(inprocess, tmp_path):
    deployment = fresh(inprocess)
    a_keys = keys_of("a", *PROMPTS["a"])
    plan = deployment.instance().plan_eviction(Selection())
    (deployment.directory / disk_file_name(a_keys[0])).unlink()  # gone behind the plan's back
    deployment.redis.unlink(*redis_names(a_keys[1:2]))
    done = deployment.instance().execute_eviction(plan)
    assert done.removed == {"disk": 5, "redis": 5}
    assert ("disk", a_keys[0]) not in chunk_pairs(done) and ("redis", a_keys[1]) not in chunk_pairs(done)

    outside = tmp_path / "precious.pt"
    outside.write_bytes(b"not LMCache's")
    link_key = "a@1@0@abc@half"
    (deployment.directory / disk_file_name(link_key)).symlink_to(outside)
    plan = deployment.instance().plan_eviction(Selection(keys=(link_key,)))
    assert plan.removed == {"disk": 1, "redis": 0}
    assert deployment.instance().execute_eviction(plan).removed == {"disk": 1, "redis": 0}
    assert not (deployment.directory / disk_file_name(link_key)).is_symlink()
    assert outside.read_bytes() == b"not LMCache's"


@pytest.mark.slow
def test_tiers_it_has_not_and_what_needs_an_engine_are_refused(inprocess):
    deployment = fresh(inprocess)
    instance = deployment.instance()
    with pytest.raises(UsageError) as cpu:
        instance.plan_eviction(Selection(tiers=("cpu",)))
    assert "--instance" in cpu.value.hint
    with pytest.raises(UsageError, match=r"no ssd tier \(it has disk, redis\)"):
        instance.plan_eviction(Selection(tiers=("ssd",)))
    assert instance.plan_eviction(Selection(tiers=("all",))).removed == {"disk": 6, "redis": 6}
    for refused in (lambda: instance.pin([1], None, None), lambda: instance.unpin(everything=True), instance.pins,
                    lambda: instance.prefetch([1])):
        with pytest.raises(Unsupported) as error:
            refused()
        assert error.value.exit_code == 2 and "--instance" in error.value.hint
    files, keys = deployment.file_names(), deployment.key_names()
    assert files == set(deployment.files) and keys == {key.decode() for key in deployment.values}


@pytest.mark.slow
def test_lookup_and_list_read_the_stores(inprocess):
    deployment = fresh(inprocess)
    instance = deployment.instance()
    result = instance.lookup(prompt(*PROMPTS["a"][0]))
    assert result.hit_tokens["total"] == 4 * CHUNK and result.tiers_checked == ["disk", "redis"]
    assert result.model == "a" and instance.notes == []  # env.sh gives the model and the hash seed
    assert instance.lookup(prompt(*PROMPTS["a"][1]), "b").hit_tokens["total"] == 0  # b never stored that prompt
    unseeded = OfflineInstance(deployment.config, "b", "float16", 1, None, None)
    (deployment.config / "env.sh").rename(deployment.root / "env.sh")
    try:
        assert unseeded.lookup(prompt(*PROMPTS["b"][0])).hit_tokens["total"] == 0
        assert any("PYTHONHASHSEED" in note for note in unseeded.notes)
    finally:
        (deployment.root / "env.sh").rename(deployment.config / "env.sh")
    listing = instance.list(None, "b", 100)
    assert [(tier.tier, tier.total) for tier in listing.tiers] == [("disk", 4), ("redis", 4)]


@pytest.mark.slow
def test_refused_while_an_engine_of_the_configuration_runs_unless_forced(inprocess):
    deployment = fresh(inprocess)
    files, keys = deployment.file_names(), deployment.key_names()
    planned = deployment.instance().plan_eviction(Selection())
    with deployment.engine("a"):
        with pytest.raises(UsageError, match=f"engine of this configuration is running at {deployment.url}") as error:
            deployment.instance().plan_eviction(Selection(tiers=("redis",)))
        assert f"kvctl evict --instance {deployment.url}" in error.value.hint and "--force" in error.value.hint
        with pytest.raises(UsageError, match="is running at"):
            deployment.instance().execute_eviction(planned)  # planned before it started: checked again
        assert deployment.file_names() == files and deployment.key_names() == keys
        forced = deployment.instance().plan_eviction(Selection(force=True))
        assert forced.removed == {"disk": 6, "redis": 6}
    assert deployment.instance().execute_eviction(planned).removed == {"disk": 6, "redis": 6}


@pytest.mark.slow
def test_refused_while_a_kvctl_serve_of_the_configuration_lives(inprocess, tmp_path):
    deployment = fresh(inprocess)
    state = {"name": "demo", "mode": "inprocess", "config_dir": str(deployment.config), "kvctl_pid": os.getpid(),
             "endpoints": {"internal_api": ["http://127.0.0.1:1", "http://127.0.0.1:2"]}, "processes": []}
    path = Path(os.environ["KVCTL_CACHE_DIR"]) / "serve" / "demo" / "state.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(state))
    with pytest.raises(UsageError, match="running at http://127.0.0.1:2"):
        deployment.instance().plan_eviction(Selection())
    path.write_text(json.dumps({**state, "kvctl_pid": _exited_pid()}))  # a kvctl serve that is gone
    assert deployment.instance().plan_eviction(Selection()).removed == {"disk": 6, "redis": 6}


def _exited_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: no process has this pid now
    return proc.pid


def test_the_model_comes_from_the_flag_or_env_sh(tmp_path):
    init = run_cli("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:0.1", "--tier",
                   f"disk:{tmp_path}/disk:1")
    assert init.code == 0, init.stderr
    instance = OfflineInstance(tmp_path / "cfg")
    assert instance.kind == "offline" and instance.name == str(tmp_path / "cfg")
    with pytest.raises(UsageError, match="which model"):
        instance.plan_eviction(Selection())
    assert OfflineInstance(tmp_path / "cfg", "m").model_name() == "m"
    assert instance.plan_eviction(Selection(model="m")).removed == {"disk": 0}


@pytest.mark.slow
def test_the_cli_evicts_a_configuration_directory(inprocess):
    deployment = fresh(inprocess)
    keys = deployment.key_names()
    result = run_kvctl("evict", "--config", deployment.config, "--tier", "redis", "--yes", "--format", "json")
    assert result.code == 0, result.stderr
    answer = json.loads(result.stdout)
    assert not answer["dry_run"] and answer["removed"] == {"redis": 6}
    assert deployment.key_names() == keys - redis_names(keys_of("a", *PROMPTS["a"]))
    cpu = run_kvctl("evict", "--config", deployment.config, "--tier", "cpu", "--yes")
    assert cpu.code == 2 and "--instance" in cpu.stderr and "Traceback" not in cpu.stderr


# -- MP mode: the fs and resp L2 adapters of a real `lmcache server` ------------------------------------------

MP_STRAY_FILES = {"README.data": b"x", "notes@a@b@c.data": b"x", "scratch.txt": b"x"}
MP_FOREIGN_KEYS = ("session:42", "test-model@not@a@chunk", "other@00000000@0@zz")
OTHER_MODEL = "other/model"


class MP(Stores):
    def __init__(self, base: Path, redis, port: int, http_port: int) -> None:
        super().__init__(base / "l2", redis)
        self.base, self.config = base, base / "cfg"
        self.server = Server(self.config, f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", self.directory)

    @contextlib.contextmanager
    def serve(self):
        values = yaml.safe_load((self.config / "lmcache.yaml").read_text())
        log = self.base / "server.log"
        proc = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values),
                              *MP_ROUTES_ARGV], log, env={**os.environ, **STACK_ENV})
        try:
            wait_until(lambda: http_json("GET", f"{self.server.http}/healthcheck"), 120, "lmcache server", proc, log)
            yield
        finally:
            stop_process(proc)

    def instance(self) -> OfflineInstance:
        return OfflineInstance(self.config, None, "float16", 1, None, None)


MP_PROMPTS = (tokens(90, 2 * CHUNK), tokens(91, 2 * CHUNK))


def object_keys(ids: list[int], model: str = MP_MODEL) -> list[ObjectKey]:
    return [ranks[0] for ranks in mp_object_keys(ids, MPKeyRecipe(model, CHUNK))]


@pytest.fixture(scope="module")
def mp(tmp_path_factory):
    """Two prompts of the MP client's model in the fs and resp L2 stores, a copy of one of its chunks under
    another model's keys, and the decoys; the server stopped."""
    base = tmp_path_factory.mktemp("offline-mp")
    starter = RedisStarter(base)
    redis = starter()
    port, http_port = free_port(), free_port()
    init = run_cli("config", "init", "--mode", "mp", "--out", base / "cfg", "--tier", "cpu:0.05", "--tier",
                   f"disk:{base}/l2", "--tier", redis.url, "--mp-port", port, "--mp-http-port", http_port,
                   "--model", MP_MODEL)
    assert init.code == 0, init.stderr
    (base / "l2").mkdir(exist_ok=True)
    deployment = MP(base, redis.client(), port, http_port)
    try:
        with deployment.serve():
            deployment.server.store(*MP_PROMPTS)
            stored = [key for ids in MP_PROMPTS for key in object_keys(ids)]
            wait_until(lambda: all((deployment.directory / key.fs_file_name()).exists()
                                   and deployment.redis.exists(key.native_key()) for key in stored), 30, "L2 writes")
        real = object_keys(MP_PROMPTS[0])[0]
        copy = ObjectKey(real.chunk_hash, OTHER_MODEL, real.kv_rank)
        (deployment.directory / copy.fs_file_name()).write_bytes((deployment.directory / real.fs_file_name())
                                                                 .read_bytes())
        deployment.redis.restore(copy.native_key(), 0, deployment.redis.dump(real.native_key()))
        for name, data in MP_STRAY_FILES.items():
            (deployment.directory / name).write_bytes(data)
        for key in MP_FOREIGN_KEYS:
            deployment.redis.set(key, b"keep me")
        deployment.snapshot()
        yield deployment
    finally:
        starter.stop_all()


@pytest.mark.slow
def test_mp_whole_tiers_prompts_and_keys(mp):
    deployment = fresh(mp)
    files, keys = deployment.file_names(), deployment.key_names()
    first, second = object_keys(MP_PROMPTS[0]), object_keys(MP_PROMPTS[1])
    instance = deployment.instance()

    plan = instance.plan_eviction(Selection(tokens=tuple(MP_PROMPTS[0])))
    assert chunk_pairs(plan) == sorted((tier, key.native_key()) for tier in ("disk", "redis") for key in first)
    assert chunk_pairs(deployment.instance().execute_eviction(plan)) == chunk_pairs(plan)
    assert deployment.file_names() == files - {key.fs_file_name() for key in first}
    assert deployment.key_names() == keys - {key.native_key() for key in first}

    deployment = fresh(mp)
    plan = instance.plan_eviction(Selection())  # the model: env.sh's KVCTL_MODEL
    assert plan.removed == {"disk": 4, "redis": 4}
    done = deployment.instance().execute_eviction(plan)
    assert done.removed == {"disk": 4, "redis": 4} and chunk_pairs(done) == chunk_pairs(plan)
    other = ObjectKey(first[0].chunk_hash, OTHER_MODEL, first[0].kv_rank)
    assert deployment.file_names() == set(MP_STRAY_FILES) | {other.fs_file_name()}
    assert deployment.key_names() == set(MP_FOREIGN_KEYS) | {other.native_key()}

    deployment = fresh(mp)
    chosen = (other.native_key(), second[1].native_key())
    plan = instance.plan_eviction(Selection(keys=chosen, tiers=("disk",)))
    assert chunk_pairs(plan) == sorted(("disk", key) for key in chosen)
    deployment.instance().execute_eviction(plan)
    assert deployment.file_names() == files - {other.fs_file_name(), second[1].fs_file_name()}
    assert deployment.key_names() == keys
    with pytest.raises(UsageError, match="not an MP chunk key"):
        instance.plan_eviction(Selection(keys=("test-model@not@a@chunk",)))


@pytest.mark.slow
def test_mp_refused_while_its_server_runs(mp):
    deployment = fresh(mp)
    with deployment.serve():
        with pytest.raises(UsageError, match=f"running at {deployment.server.http}"):
            deployment.instance().plan_eviction(Selection())
        assert deployment.instance().plan_eviction(Selection(force=True, tiers=("redis",))).removed == {"redis": 4}
