"""Security guarantees of SECURITY.md that no other test checked, each against real processes: a
standalone engine with kvctl's plugins (loopback, and bound beyond it inside a private network
namespace), a real `lmcache server`, and real kvctl processes."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import ThreadingHTTPServer

import httpx
import pytest
import yaml

from kvctl.core.config.init import mp_server_argv
from kvctl.core.instance import offline
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.helpers import (
    Answers200,
    free_port,
    http_client,
    http_json,
    run_cli,
    run_kvctl,
    standalone_argv,
    standalone_engine,
    start_process,
    stop_process,
    wait_until,
)
from tests.integration.test_mp_l1_lookup import CHUNK as MP_CHUNK
from tests.integration.test_mp_l1_lookup import MODEL as MP_MODEL
from tests.integration.test_offline_edges import PARTIAL, chunk_files, warm_snapshot
from tests.integration.test_route_token_exposure import OUTER, ask, engine_config, kvctl_in, private_network
from tests.integration.test_snapshot import OFFLINE, answer, configuration

pytestmark = pytest.mark.slow

TOKEN = "security-edges-token-0123456789abcdef"
REBOUND = {"Host": "attacker.example"}  # what a page whose DNS name was rebound to 127.0.0.1 sends


class AnswersEvery200(Answers200):
    """Answers200 for a coordinator: its unpins are DELETEs."""

    do_DELETE = Answers200.do_GET  # noqa: N815


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with standalone_engine(tmp_path_factory.mktemp("security-edges"), "--tier", "cpu:0.05") as url:
        yield url


def test_lmcache_routes_refuse_a_rebound_host_on_loopback(engine):
    """LMCache's own routes (/env shows the environment) keep the Host check kvctl's routes have."""
    for method, path in (("GET", "/env"), ("GET", "/conf"), ("GET", "/backends"), ("POST", "/metrics/reset")):
        refused = http_client().request(method, engine + path, headers=REBOUND, timeout=10)
        assert refused.status_code == 403, (path, refused.text[:300])
        assert refused.json()["error"] == "forbidden" and "loopback" in refused.json()["message"]
        allowed = http_client().request(method, engine + path, headers={"Host": "localhost"}, timeout=10)
        assert allowed.status_code == 200


def test_the_routes_send_no_cors_headers_and_refuse_multipart_bodies(engine):
    """A cross-site page gets no CORS permission to read an answer, and a multipart form (a body it can
    send without a preflight) is refused before the route reads it."""
    origin = {"Origin": "http://attacker.example"}
    preflight = httpx.options(f"{engine}/kvctl/v1/lookup", timeout=10, headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    answered = http_client().get(f"{engine}/kvctl/v1/info", headers=origin, timeout=10)
    assert answered.status_code == 200
    for response in (preflight, answered):
        assert not [name for name in response.headers if name.lower().startswith("access-control-")], \
            dict(response.headers)
    form = http_client().post(f"{engine}/kvctl/v1/lookup", files={"tokens": ("t.json", json.dumps({"tokens": [1]}))},
                      timeout=10)
    assert form.status_code == 415 and form.json()["error"] == "unsupported_media_type"
    assert "multipart/form-data" in form.json()["message"]


def test_beyond_loopback_without_a_token_the_routes_answer_no_one(tmp_path):
    """An engine with the plugins, bound to 0.0.0.0 and started without a routes token: reached at an
    address beyond loopback, kvctl's routes and LMCache's own that leak or act refuse everyone, a bearer
    of any token too, with a message that says how to set one; on loopback they still answer."""
    port_start = free_port()
    engine_config(tmp_path / "cfg", port_start)  # writes a token to env.sh, which this engine is not given
    no_token = {"KVCTL_ROUTES_TOKEN": "", "KVCTL_ROUTES_TOKEN_FILE": ""}
    with private_network() as netns:
        log = tmp_path / "engine.log"
        proc = start_process([*netns, *standalone_argv(tmp_path / "cfg")], log, no_token)
        outer, inner = f"http://{OUTER}:{port_start + 1}", f"http://127.0.0.1:{port_start + 1}"
        try:
            wait_until(lambda: ask(netns, "GET", f"{outer}/lmc_version")["status"] == 200, 120, "engine", proc, log)
            for method, path in (("GET", "/kvctl/v1/info"), ("POST", "/kvctl/v1/evict"), ("GET", "/env"),
                                 ("DELETE", "/cache/clear")):
                for token in ("", "any-token-at-all"):
                    refused = ask(netns, method, outer + path, token)
                    assert refused["status"] == 403, (path, refused)
                    body = json.loads(refused["text"])
                    assert body["error"] == "forbidden" and "KVCTL_ROUTES_TOKEN_FILE" in body["message"], body
            assert ask(netns, "GET", f"{inner}/kvctl/v1/info")["status"] == 200
            listed = kvctl_in(netns, "ls", "--instance", outer, "--format", "json", env=no_token)
            assert listed.returncode == 4 and "hint:" in listed.stderr and "Traceback" not in listed.stderr
        finally:
            stop_process(proc, grace=5)


def test_an_offline_load_never_writes_through_a_planted_symlink(tmp_path, monkeypatch):
    """A disk tier directory another user can write: a symlink named like a chunk file is left as it
    is (never written through), and one at the partial name a load stages under (fresh each time;
    here guessed) makes the load stop with nothing written, its target untouched."""
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "kvctl-cache"))  # no kvctl serve state of this user
    snap, files = warm_snapshot(tmp_path / "source", 3, 1024)
    config, _ = configuration(tmp_path / "target", "cpu:0.1", f"disk:{tmp_path}/target/disk:1")
    disk, victim = tmp_path / "target" / "disk", tmp_path / "victim"
    disk.mkdir()
    victim.write_bytes(b"the victim's own bytes")
    first, *others = sorted(files)
    (disk / first).symlink_to(victim)
    loaded = answer("snapshot", "load", snap, "--config", config, *OFFLINE)
    assert loaded["written"] == {"disk": 2} and (disk / first).is_symlink()
    assert chunk_files(disk) == {first: b"the victim's own bytes", **{name: files[name] for name in others}}
    assert victim.read_bytes() == b"the victim's own bytes"

    for name in files:
        (disk / name).unlink()
    guessed = disk / f".{first}.guessed{PARTIAL}"
    guessed.symlink_to(victim)
    monkeypatch.setattr(offline, "partial_name", lambda name: f".{name}.guessed{PARTIAL}")
    refused = answer("snapshot", "load", snap, "--config", config, *OFFLINE, code=1)
    assert "cannot write" in refused.stderr and "hint:" in refused.stderr and "Traceback" not in refused.stderr
    assert victim.read_bytes() == b"the victim's own bytes" and chunk_files(disk) == {}
    assert os.listdir(disk) == [guessed.name] and guessed.is_symlink()


def test_the_routes_token_never_goes_to_a_coordinator(tmp_path):
    """A real MP server guarded by a token (kvctl's environment holds it, the URL is addressed alone) and a
    stand-in coordinator that records what it is sent: the server answers kvctl (so the token was sent
    to it), and none of the pin, unpin and pins requests the coordinator got carried an Authorization."""
    coordinator = ThreadingHTTPServer(("127.0.0.1", free_port()), AnswersEvery200)
    coordinator.requests, coordinator.authorizations = [], []
    threading.Thread(target=coordinator.serve_forever, daemon=True).start()
    port, http_port = free_port(), free_port()
    init = run_cli("config", "init", "--mode", "mp", "--out", tmp_path / "cfg", "--tier", "cpu:0.05",
                   "--mp-port", port, "--mp-http-port", http_port, "--model", MP_MODEL)
    assert init.code == 0, init.stderr
    values = yaml.safe_load((tmp_path / "cfg" / "lmcache.yaml").read_text())
    log, http = tmp_path / "server.log", f"http://127.0.0.1:{http_port}"
    server = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values),
                            *MP_ROUTES_ARGV], log, {"KVCTL_ROUTES_TOKEN": TOKEN})
    try:
        wait_until(lambda: http_json("GET", f"{http}/healthcheck"), 120, "lmcache server", server, log)
        assert http_client().get(f"{http}/kvctl/v1/info", timeout=10).status_code == 401  # guarded by the token
        prompt = tmp_path / "prompt.json"
        prompt.write_text(json.dumps(list(range(3, 3 + 2 * MP_CHUNK))))
        flags = ("--model", MP_MODEL, "--coordinator", f"http://127.0.0.1:{coordinator.server_port}",
                 "--instance", http, "--format", "json")
        env = {"KVCTL_ROUTES_TOKEN": TOKEN}
        assert run_kvctl("ls", "--instance", http, "--format", "json", env=env).code == 0
        for command in (("pin", "--tokens-file", prompt), ("unpin", "--tokens-file", prompt), ("pins",)):
            run_kvctl(*command, *flags, env=env)  # the stand-in's "ok" is no coordinator's answer
        methods = {line.split()[0] for line in coordinator.requests}
        assert methods == {"POST", "DELETE", "GET"} and set(coordinator.authorizations) == {None}, coordinator.requests
    finally:
        coordinator.shutdown()
        stop_process(server, grace=5)
