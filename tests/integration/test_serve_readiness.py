"""How `kvctl serve` waits, with real processes and no vLLM: readiness that proves it talks to the component
(a server answering 200 to everything is not vLLM, LMCache or its coordinator; a proxy from the environment
is never used), a child that logs a fatal line reported within seconds, and inherited LMCACHE_* variables
kept from the children (`kvctl serve --mode mp` up to its first child, the coordinator), and an
operator's proxy kept out of what the children say to each other on loopback."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvctl.core.serve.launch import Component, LaunchPlan, build_plan
from kvctl.core.serve.supervisor import ChildFailed, Supervisor
from tests.helpers import KVCTL, REPO, free_port, http_client, proxy_answering_200, wait_until

# A child process that answers 200 "ok" to every request and prints each request line.
ANSWERS_200 = f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.helpers import answer_200_forever; " \
              "answer_200_forever(int(sys.argv[1]))"
SLEEPS = "import time; time.sleep(120)"


@pytest.fixture(autouse=True)
def kvctl_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))


def supervise(tmp_path, argv, ready, ready_timeout=3.0):
    """Start one real child with the given readiness checks; returns the ChildFailed it ends with and the time
    that took (the child is always stopped)."""
    component = Component("child", [sys.executable, "-c", *argv], {}, str(tmp_path / "child.log"), ready)
    supervisor = Supervisor(LaunchPlan("t", "inprocess", "m", str(tmp_path), str(tmp_path / "state.json"),
                                       [component], {}), ready_timeout=ready_timeout)
    started = time.monotonic()
    try:
        with pytest.raises(ChildFailed) as failed:
            supervisor.start()
        return failed.value, time.monotonic() - started
    finally:
        supervisor.stop(timeout=5)


def checks(mode, port):
    """Every readiness check of a real plan whose components would all listen on `port`."""
    plan = build_plan(model=None, mode=mode, tiers=[], config=None, port=port, internal_api_port_start=port,
                      mp_http_port=port, coordinator_port=port, write=False)
    return {check.label: check for component in plan.components for check in component.ready}


@pytest.mark.parametrize("mode, label", [("inprocess", "vLLM"), ("inprocess", "LMCache's scheduler API"),
                                         ("mp", "the LMCache MP server"), ("mp", "the LMCache coordinator")])
def test_a_server_answering_200_to_everything_is_not_ready(tmp_path, mode, label):
    port = free_port()
    check = checks(mode, port)[label]
    error, _ = supervise(tmp_path, [ANSWERS_200, str(port)], [check])
    assert error.message.startswith(f"child was not ready after 3 s ({label} at {check.target})")
    assert f"GET {check.target.split(str(port), 1)[1]} HTTP/1.1" in (tmp_path / "child.log").read_text()  # it asked


def test_readiness_never_goes_through_a_proxy_from_the_environment(tmp_path, monkeypatch):
    ready = list(checks("inprocess", free_port(3)).values())  # vLLM and LMCache's APIs, none of them running
    with proxy_answering_200(monkeypatch) as proxied:
        error, _ = supervise(tmp_path, [SLEEPS], ready, ready_timeout=2)
    assert error.message.startswith("child was not ready after 2 s (vLLM at http://127.0.0.1:")
    assert proxied == []


@pytest.mark.parametrize("line", [
    "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 7000): address already in use",
    "(EngineCore pid=7) ERROR 12-03 10:12:16 [core.py:1510] EngineCore failed to start.",
    "Traceback (most recent call last):",
])
def test_a_child_that_logs_a_fatal_line_is_reported_within_seconds(tmp_path, line):
    (tmp_path / "child.log").write_text("ERROR left in the log by an older run\n")
    script = f"print('starting', flush=True); print({line!r}, flush=True); print('the rest', flush=True); {SLEEPS}"
    error, took = supervise(tmp_path, [script], list(checks("inprocess", free_port(3)).values()), ready_timeout=60)
    assert took < 10
    assert error.message.splitlines()[0] == f"child failed while starting: {line}"
    assert error.message.splitlines()[-1] == "the rest" and "older run" not in error.message
    assert error.hint == f"the whole log is {tmp_path / 'child.log'}"


def test_a_log_from_an_older_run_is_not_read_as_this_one(tmp_path):
    (tmp_path / "child.log").write_text("Traceback (most recent call last):\nERROR from an older run\n")
    error, _ = supervise(tmp_path, [SLEEPS], list(checks("inprocess", free_port(3)).values()), ready_timeout=2)
    assert "was not ready after 2 s" in error.message


def started_child(pid: int, module: str) -> int:
    """The pid of kvctl's child that runs `module`, once it has been started."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if module in Path(f"/proc/{child}/cmdline").read_text():
            return int(child)
    raise LookupError(module)


@pytest.mark.parametrize("keep", [False, True])
def test_inherited_lmcache_variables_never_reach_the_children_unless_kept(tmp_path, tiny_model, keep):
    env = {**os.environ, "KVCTL_CACHE_DIR": str(tmp_path / "cache"), "LMCACHE_CHUNK_SIZE": "16",
           "LMCACHE_COORDINATOR_URL": "http://127.0.0.1:1"}
    stderr = tmp_path / "serve.err"
    ports = [str(free_port()) for _ in range(4)]
    argv = [str(KVCTL), "serve", str(tiny_model), "--mode", "mp", "--port", ports[0], "--mp-port", ports[1],
            "--mp-http-port", ports[2], "--coordinator-port", ports[3], *(["--keep-lmcache-env"] * keep)]
    serve = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr.open("w"), env=env)
    try:
        coordinator = wait_until(lambda: started_child(serve.pid, "lmcache.v1.mp_coordinator"), 60, "the coordinator")
        environ = dict(entry.split("=", 1) for entry in Path(f"/proc/{coordinator}/environ").read_text().split("\0")
                       if "=" in entry)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
    assert environ["PYTHONHASHSEED"] == "0" and environ["KVCTL_CACHE_DIR"] == str(tmp_path / "cache")
    notice = ("warning: leaving LMCACHE_CHUNK_SIZE, LMCACHE_COORDINATOR_URL out of vLLM's and LMCache's environment: "
              "LMCache reads LMCACHE_* variables over the configuration file (--keep-lmcache-env passes them on)")
    if keep:
        assert (environ["LMCACHE_CHUNK_SIZE"], environ["LMCACHE_COORDINATOR_URL"]) == ("16", "http://127.0.0.1:1")
        assert notice not in stderr.read_text()
    else:
        assert "LMCACHE_CHUNK_SIZE" not in environ and "LMCACHE_COORDINATOR_URL" not in environ
        assert notice in stderr.read_text().splitlines()


@pytest.mark.slow
def test_the_mp_server_registers_with_its_coordinator_past_an_operators_proxy(tmp_path, monkeypatch):
    """The MP server reaches the coordinator through httpx, which honours HTTP_PROXY: serve's children get
    the loopback names in NO_PROXY, so registration reaches the coordinator, not the proxy."""

    from tests.helpers import start_process, stop_process

    with proxy_answering_200(monkeypatch) as proxied:
        monkeypatch.setenv("NO_PROXY", "corp.example")  # the operator's own exceptions stay
        coordinator_port = free_port()
        plan = build_plan(model="tiny", mode="mp", tiers=[], config=None, mp_port=free_port(),
                          mp_http_port=free_port(), coordinator_port=coordinator_port, write=False)
        environ = {name: value for name, value in os.environ.items() if name not in plan.unset_env}
        started = []
        try:
            for component in plan.components[:2]:  # the coordinator, then the MP server (no vLLM)
                assert component.env["NO_PROXY"] == "corp.example,127.0.0.1,localhost,::1"
                log = tmp_path / f"{component.name}.log"
                started.append(start_process(component.argv, log, env={**environ, **component.env}))
            coordinator = f"http://127.0.0.1:{coordinator_port}"

            def registered():
                return http_client().get(f"{coordinator}/instances", timeout=10).json()["instances"]

            (server,) = wait_until(registered, 90, "the MP server registered", started[-1],
                                   tmp_path / "lmcache-server.log")
            served_at = int(plan.endpoints["mp_http"].rsplit(":", 1)[1])
            assert (server["ip"], server["http_port"]) == ("127.0.0.1", served_at)
        finally:
            for proc in started:
                stop_process(proc)
    assert proxied == []
