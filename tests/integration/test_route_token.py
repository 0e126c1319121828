"""kvctl's routes behind a bearer token: an engine whose environment holds KVCTL_ROUTES_TOKEN (as
`kvctl config init --internal-api-host` beyond loopback writes it to env.sh) answers only its bearer;
kvctl sends each instance its own token and no other server any. Without a token, a non-loopback
bind answers no one (test_route_token_exposure.py)."""

import json
import threading
from http.server import ThreadingHTTPServer

import pytest

from kvctl.core.config.init import ConfigRequest, build_config
from kvctl.core.lmcache.config import parse_env_file
from tests.helpers import (
    Answers200,
    free_port,
    http_client,
    init_engine,
    proxy_answering_200,
    run_kvctl,
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
    token = "s3cret-token-for-kvctl-routes"
    with init_engine(tmp_path, "--tier", "cpu:0.05", env={"KVCTL_ROUTES_TOKEN": token}) as engine:
        url = engine.url
        assert http_client().get(f"{url}/kvctl/v1/info").status_code == 401
        assert http_client().get(f"{url}/kvctl/v1/info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        authorized = {"Authorization": f"Bearer {token}"}
        assert http_client().get(f"{url}/kvctl/v1/info", headers=authorized).status_code == 200
        refused = engine.kvctl("ls", env={"KVCTL_ROUTES_TOKEN": ""})
        assert refused.code == 4 and "KVCTL_ROUTES_TOKEN" in refused.stderr.split("hint:")[1]
        listed = engine.kvctl("ls", env={"KVCTL_ROUTES_TOKEN": token})
        assert listed.code == 0, listed.stderr
        assert [tier["tier"] for tier in json.loads(listed.stdout)["tiers"]] == ["cpu"]


def test_a_proxy_in_the_environment_never_sees_kvctl_requests(monkeypatch):
    """A proxy that answers 200 to everything: kvctl's requests (prompts' token ids) never go to it,
    and a server that is not there stays unreachable."""
    with proxy_answering_200(monkeypatch) as proxied:
        result = run_kvctl("health", "--instance", "http://127.0.0.1:1", "--format", "json")
    assert result.code == 3 and proxied == []


@pytest.mark.slow
def test_each_fleet_member_gets_its_own_token_and_no_other_server_any(tmp_path):
    """Two engines with different tokens and a stranger in one inventory, kvctl's environment holding a
    third token: each engine answers (its own token from its entry), the stranger and the vLLM URL
    that tokenizes the prompt never see an Authorization header."""
    stranger = ThreadingHTTPServer(("127.0.0.1", free_port()), Answers200)
    stranger.requests, stranger.authorizations = [], []
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    stranger_url = f"http://127.0.0.1:{stranger.server_port}"
    engines, urls = [], {}
    try:
        for name, token in (("a", "token-of-a-0123456789"), ("b", "token-of-b-0123456789")):
            engine = init_engine(tmp_path / name, "--tier", "cpu:0.05", env={"KVCTL_ROUTES_TOKEN": token})
            (engine.config / "env.sh").open("a").write(f"export KVCTL_ROUTES_TOKEN={token}\n")
            engines.append(engine.launch())
            urls[name] = engine.url
        (tmp_path / "a.token").write_text("token-of-a-0123456789\n")
        inventory = tmp_path / "kvctl.yaml"
        inventory.write_text(json.dumps({"instances": {
            "a": {"internal_api": urls["a"], "token_file": "a.token", "vllm": stranger_url},
            "b": {"internal_api": urls["b"], "env_file": "b/cfg/env.sh"},
            "stranger": {"internal_api": stranger_url}}}))
        for engine in engines:
            engine.ready()
        env = {"KVCTL_ROUTES_TOKEN": "token-of-kvctls-environment"}
        listed = run_kvctl("ls", "--instance", "all", "--inventory", inventory, "--format", "json", env=env)
        reports = {report["instance"]: report for report in json.loads(listed.stdout)["instances"]}
        assert not reports["a"].get("errors") and not reports["b"].get("errors"), reports
        assert reports["stranger"]["errors"] and listed.code == 6
        (tmp_path / "prompt.txt").write_text("hello " * 40)
        run_kvctl("lookup", "--prompt-file", tmp_path / "prompt.txt", "--instance", "a", "--inventory", inventory,
                  env=env)  # tokenized by a's vLLM URL: the stranger
        assert stranger.requests and set(stranger.authorizations) == {None}, stranger.requests
        # a URL addressed alone takes kvctl's environment's token, and the wrong one is refused
        alone = run_kvctl("ls", "--instance", urls["a"], "--format", "json", env=env)
        assert alone.code == 4 and "KVCTL_ROUTES_TOKEN" in alone.stderr
    finally:
        stranger.shutdown()
        for engine in engines:
            engine.stop()
