from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import VENV_BIN, free_port, start_process, stop_process, wait_until

# The property layer (tests/property): a few thousand examples per target in `make test`, a small budget in
# `make test-fast` (--hypothesis-profile=quick). No deadline: a 2-core CI machine is slow, not wrong.
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("quick", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("thorough")

# make test's schedule (pytest-xdist --dist loadscope --no-loadscope-reorder), longest first: an end-to-end
# test starts its own vLLM and shares nothing, so each goes to whichever worker is free (a class of them shares
# one serve and stays together); every other file
# stays whole on one worker, where its tests share their servers (module fixtures set up once, not once per
# worker). pytest-xdist's xdist_group marks cannot say this under pytest 9 (loadgroup no longer groups).
SCHEDULE = ("tests/e2e/", "tests/property/", "tests/integration/")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((index for index, prefix in enumerate(SCHEDULE) if item.nodeid.startswith(prefix)),
                    len(SCHEDULE))

    items.sort(key=rank)  # stable: a file's tests stay together and in order


def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope with the work units of SCHEDULE: one per end-to-end test (or class), one per other file."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WholeFilesApartEndToEnd(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("::")
            return "::".join(parts[:2]) if nodeid.startswith(SCHEDULE[0]) else parts[0]

    return WholeFilesApartEndToEnd(config, log)


@dataclass
class RedisServer:
    port: int
    password: str | None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)


def redis_binary() -> str:
    found = shutil.which("redis-server") or (str(VENV_BIN / "redis-server") if (VENV_BIN / "redis-server").exists()
                                             else None)
    assert found, "redis-server is missing: run scripts/setup"
    return found


class RedisStarter:
    """Starts real redis-server processes on 127.0.0.1 (optionally with a password) and stops them all."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.started = []

    def __call__(self, password: str | None = None) -> RedisServer:
        port = free_port()
        argv = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory)]
        if password:
            argv += ["--requirepass", password]
        log = self.directory / f"redis-{port}.log"
        proc = start_process(argv, log)
        self.started.append(proc)
        server = RedisServer(port, password)
        wait_until(lambda: server.client().ping(), 20, "redis-server", proc, log)
        return server

    def stop_all(self) -> None:
        for proc in self.started:
            stop_process(proc)


@pytest.fixture
def start_redis(tmp_path):
    starter = RedisStarter(tmp_path)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory):
    starter = RedisStarter(tmp_path_factory.mktemp("redis"))
    yield starter()
    starter.stop_all()


@pytest.fixture
def redis_server(start_redis) -> RedisServer:
    return start_redis()


@pytest.fixture(scope="session", autouse=True)
def own_kvctl_directories(tmp_path_factory):
    """kvctl's cache (serve state, pin ledgers, models) and config home (a user-wide inventory) of this
    test session (of this xdist worker) alone: never the user's, never another worker's."""
    import os

    root = tmp_path_factory.mktemp("kvctl-home")
    saved = {name: os.environ.get(name) for name in ("KVCTL_CACHE_DIR", "XDG_CONFIG_HOME")}
    os.environ.update(KVCTL_CACHE_DIR=str(root / "cache"), XDG_CONFIG_HOME=str(root / "config"))
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The project's tiny model, built once per test session by `kvctl model tiny`."""
    from tests.helpers import run_kvctl

    directory = tmp_path_factory.mktemp("models") / "tiny"
    result = run_kvctl("model", "tiny", directory)
    assert result.code == 0, result.stderr
    return directory
