"""The routes token where it is the only guard: an internal API bound beyond loopback.

A network namespace of the test's own (`unshare -n`, as root) whose loopback interface also carries
192.0.2.10 (TEST-NET-1): an engine bound to 0.0.0.0 there is reached at an address beyond loopback,
and no packet ever leaves the namespace. Every process in it is started and stopped by the test.

- the token never shows in LMCache's unauthenticated GET /env (the plugins take it out of the
  environment when they install), on loopback or beyond;
- beyond loopback, LMCache's own routes that leak or act want the token too; only the read-only
  probes (/metrics, versions, thread health) answer without it;
- kvctl sends each instance's own token (from its inventory entry) and doctor calls the guard whole;
  a stock engine (no plugins) bound the same way is an error for doctor.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import (
    KVCTL,
    free_port,
    http_json,
    init_engine,
    run_kvctl,
    standalone_argv,
    start_process,
    stop_process,
    wait_until,
)

OUTER = "192.0.2.10"  # the namespace's address beyond loopback
TOKEN = "exposure-test-token-0123456789abcdef"

pytestmark = pytest.mark.slow  # root, unshare and ip: CI and scripts/setup provide them, and no skip hides them


@contextlib.contextmanager
def private_network():
    """The prefix that runs a command inside a fresh network namespace holding OUTER on its loopback."""
    holder = subprocess.Popen(["unshare", "-n", "sh", "-c", f"ip link set lo up && ip addr add {OUTER}/32 dev lo "
                               "&& echo ready && exec sleep 3600"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        yield ["nsenter", f"--net=/proc/{holder.pid}/ns/net"]
    finally:
        stop_process(holder, grace=2)


PROBE = """
import json, sys, httpx
method, url, token = sys.argv[1:4]
headers = {"Authorization": f"Bearer {token}"} if token else {}
answer = httpx.request(method, url, headers=headers, timeout=10, trust_env=False)
print(json.dumps({"status": answer.status_code, "text": answer.text}))
"""


def ask(netns: list[str], method: str, url: str, token: str = "") -> dict:
    done = subprocess.run([*netns, sys.executable, "-c", PROBE, method, url, token], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def kvctl_in(netns: list[str], *args, env: dict | None = None):
    done = subprocess.run([*netns, str(KVCTL), *map(str, args)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    return done


def engine_config(root, port_start: int, *extra) -> None:
    init = run_kvctl("config", "init", "--out", root, "--tier", "cpu:0.05", "--internal-api-host", "0.0.0.0",
                     "--internal-api-port-start", port_start, *extra)
    assert init.code == 0, init.stderr


def test_the_token_never_shows_in_env_on_loopback(tmp_path):
    """Loopback too: GET /env answers without any token there, so the token must not be in it."""
    with init_engine(tmp_path, "--tier", "cpu:0.05", env={"KVCTL_ROUTES_TOKEN": TOKEN}) as engine:
        env = http_json("GET", f"{engine.url}/env")
        assert "KVCTL_ROUTES_TOKEN" not in env and TOKEN not in json.dumps(env)
        assert env["PYTHONHASHSEED"] == "0"  # /env itself still answers on loopback
        listed = engine.kvctl("ls", env={"KVCTL_ROUTES_TOKEN": TOKEN})
        assert listed.code == 0, listed.stderr  # the routes still hold the token they took


def test_a_token_file_guards_the_routes_and_only_its_path_is_in_env(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with init_engine(tmp_path, "--tier", "cpu:0.05", env={"KVCTL_ROUTES_TOKEN_FILE": str(token_file)}) as engine:
        env = http_json("GET", f"{engine.url}/env")
        assert env["KVCTL_ROUTES_TOKEN_FILE"] == str(token_file) and TOKEN not in json.dumps(env)
        refused = engine.kvctl("ls", env={"KVCTL_ROUTES_TOKEN": ""})
        assert refused.code == 4
        listed = engine.kvctl("ls", env={"KVCTL_ROUTES_TOKEN": "", "KVCTL_ROUTES_TOKEN_FILE": str(token_file)})
        assert listed.code == 0, listed.stderr


def test_an_unreadable_token_file_stops_the_engine_instead_of_opening_the_routes(tmp_path):
    engine = init_engine(tmp_path, "--tier", "cpu:0.05", env={"KVCTL_ROUTES_TOKEN_FILE": str(tmp_path / "none")})
    try:
        assert engine.launch().proc.wait(120) != 0
        assert "cannot read the routes token file" in engine.log.read_text()
    finally:
        engine.stop()


def test_beyond_loopback_lmcache_routes_want_the_token_and_kvctl_sends_each_its_own(tmp_path):
    guarded_port, stock_port = free_port(), free_port()
    engine_config(tmp_path / "guarded", guarded_port)
    engine_config(tmp_path / "stock", stock_port)
    env_file = tmp_path / "guarded" / "env.sh"
    token = next(line.split("=", 1)[1].strip("'\"") for line in env_file.read_text().splitlines()
                 if "KVCTL_ROUTES_TOKEN=" in line)
    inventory = tmp_path / "kvctl.yaml"
    inventory.write_text(json.dumps({"instances": {
        "guarded": {"internal_api": f"http://{OUTER}:{guarded_port + 1}", "env_file": "guarded/env.sh",
                    "config_dir": str(tmp_path / "guarded")},
        "stock": {"internal_api": f"http://{OUTER}:{stock_port + 1}"}}}))
    with private_network() as netns:
        logs = tmp_path / "guarded.log", tmp_path / "stock.log"
        guarded = start_process([*netns, *standalone_argv(tmp_path / "guarded")], logs[0],
                                {"KVCTL_ROUTES_TOKEN": token})
        stock = start_process([*netns, *standalone_argv(tmp_path / "stock", plugins=False)], logs[1])
        try:
            base = f"http://{OUTER}:{guarded_port + 1}"
            wait_until(lambda: ask(netns, "GET", f"{base}/lmc_version")["status"] == 200, 120, "guarded engine",
                       guarded, logs[0])
            # the read-only probes answer anyone (monitoring scrapes them) ...
            for probe in ("/metrics", "/lmc_version", "/periodic-threads-health"):
                assert ask(netns, "GET", base + probe)["status"] == 200, probe
            # ... everything that leaks or acts wants the token beyond loopback
            for method, path in (("GET", "/env"), ("GET", "/conf"), ("PUT", "/freeze/enable"),
                                 ("DELETE", "/cache/clear"), ("GET", "/backends"), ("POST", "/metrics/reset"),
                                 ("GET", "/kvctl/v1/info")):
                assert ask(netns, method, base + path)["status"] == 401, path
                assert ask(netns, method, base + path, "wrong")["status"] == 401, path
            env = ask(netns, "GET", f"{base}/env", token)
            assert env["status"] == 200 and token not in env["text"]
            assert json.loads(ask(netns, "GET", f"{base}/freeze/status", token)["text"])["freeze"] is False
            # kvctl: the guarded member gets its own token from its entry, and kvctl's environment holds none
            frozen = kvctl_in(netns, "freeze", "status", "--instance", "guarded", "--inventory", inventory,
                              "--format", "json", env={"KVCTL_ROUTES_TOKEN": ""})
            assert frozen.returncode == 0, frozen.stderr
            wait_until(lambda: ask(netns, "GET", f"http://{OUTER}:{stock_port + 1}/lmc_version")["status"] == 200,
                       120, "stock engine", stock, logs[1])
            report = kvctl_in(netns, "doctor", "--instance", "all", "--inventory", inventory, "--format", "json",
                              env={"KVCTL_ROUTES_TOKEN": ""})
            findings = [finding for finding in json.loads(report.stdout)["findings"] if finding["check"] == "exposure"]
            by_member = {member: [finding for finding in findings if finding["instance"] == member]
                         for member in ("guarded", "stock")}
            assert by_member["guarded"] and {f["level"] for f in by_member["guarded"]} == {"warning"}, findings
            assert any(f["level"] == "error" and "plugins are not loaded" in f["what"] for f in by_member["stock"])
            assert report.returncode == 1
        finally:
            stop_process(guarded, grace=5)
            stop_process(stock, grace=5)



def test_a_child_of_the_plugins_process_never_inherits_the_token():
    """What the plugins do at install, in a real process: the token leaves os.environ (and so the C
    environment a child is started with), while the routes keep it."""
    script = ("import os, subprocess, sys\n"
              "from kvctl_plugins import protocol\n"
              "token = protocol.adopt_routes_token()\n"
              "probe = 'import os; print(os.environ.get(\"KVCTL_ROUTES_TOKEN\"))'\n"
              "child = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True).stdout.strip()\n"
              "print(token, 'KVCTL_ROUTES_TOKEN' in os.environ, child)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVCTL_ROUTES_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [TOKEN, "False", "None"]
