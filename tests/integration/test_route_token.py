"""kvctl's routes behind a bearer token: an engine whose environment holds KVCTL_ROUTES_TOKEN (as
`kvctl config init --internal-api-host` beyond loopback writes it to env.sh) answers only its bearer;
kvctl sends it from the environment. Without a token, a non-loopback bind answers no one."""

import json

import httpx
import pytest

from kvctl.core.config_init import ConfigRequest, build_config
from kvctl.core.lmcache_config import parse_env_file
from tests.helpers import (
    free_port,
    http_json,
    proxy_answering_200,
    run_kvctl,
    start_standalone_engine,
    stop_process,
    wait_until,
)


def test_a_bind_beyond_loopback_gets_a_token_in_env_sh(tmp_path):
    assert run_kvctl("config", "init", "--out", tmp_path / "cfg", "--internal-api-host", "10.1.2.3").code == 0
    env_file = tmp_path / "cfg" / "env.sh"
    token = parse_env_file(env_file.read_text())["KVCTL_ROUTES_TOKEN"]
    assert len(token) >= 40 and env_file.stat().st_mode & 0o077 == 0
    local = build_config(ConfigRequest(), tmp_path / "local")
    assert "KVCTL_ROUTES_TOKEN" not in local.env  # on loopback the Host check is the guard


@pytest.mark.slow
def test_routes_answer_only_the_bearer_of_the_token(tmp_path):
    port_start = free_port()
    assert run_kvctl("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:0.05",
                     "--internal-api-port-start", port_start).code == 0
    token = "s3cret-token-for-kvctl-routes"
    log = tmp_path / "engine.log"
    proc = start_standalone_engine(tmp_path / "cfg", log, env={"KVCTL_ROUTES_TOKEN": token})
    url = f"http://127.0.0.1:{port_start + 1}"
    try:
        wait_until(lambda: http_json("GET", f"{url}/lmc_version"), 120, "standalone engine", proc, log)
        assert httpx.get(f"{url}/kvctl/v1/info").status_code == 401
        assert httpx.get(f"{url}/kvctl/v1/info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/kvctl/v1/info", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        refused = run_kvctl("ls", "--instance", url, "--format", "json", env={"KVCTL_ROUTES_TOKEN": ""})
        assert refused.code == 4 and "KVCTL_ROUTES_TOKEN" in refused.stderr.split("hint:")[1]
        listed = run_kvctl("ls", "--instance", url, "--format", "json", env={"KVCTL_ROUTES_TOKEN": token})
        assert listed.code == 0, listed.stderr
        assert [tier["tier"] for tier in json.loads(listed.stdout)["tiers"]] == ["cpu"]
    finally:
        stop_process(proc)


def test_a_proxy_in_the_environment_never_sees_kvctl_requests(monkeypatch):
    """A proxy that answers 200 to everything: kvctl's requests (prompts' token ids) never go to it,
    and a server that is not there stays unreachable."""
    with proxy_answering_200(monkeypatch) as proxied:
        result = run_kvctl("health", "--instance", "http://127.0.0.1:1", "--format", "json")
    assert result.code == 3 and proxied == []
