"""A fleet from LMCache's own controller: a real controller (`python -m lmcache.v1.api_server`) and two
real standalone engines registered with it through `kvctl config init --controller`. No inventory:
`--instance controller://HOST:PORT` finds them, a stopped one is reported stale and not asked."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import (
    free_port,
    http_json,
    run_kvctl,
    start_process,
    start_standalone_engine,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.slow
CHUNK = 256
STALE_S = 20  # the engines beat every 5 s: a stopped one is stale after this in the tests


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("controller-fleet")
    port = free_port(span=4)
    ports = {"pull": port + 1, "reply": port + 2, "heartbeat": port + 3}
    started = []
    try:
        started.append(start_process([sys.executable, "-m", "lmcache.v1.api_server", "--host", "127.0.0.1", "--port",
                                      str(port), "--monitor-ports", json.dumps(ports)], root / "controller.log"))
        controller = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_json("GET", f"{controller}/controller/key-stats"), 120, "controller", started[0],
                   root / "controller.log")
        urls = {}
        for name in ("node-a", "node-b"):
            port_start = free_port(span=110)  # the internal API and, 100 above it, the controller worker port
            init = run_kvctl("config", "init", "--out", root / name, "--tier", "cpu:0.05", "--controller",
                             f"127.0.0.1:{port}", "--internal-api-port-start", port_start)
            assert init.code == 0, init.stderr
            assert "builtin and chunk size 256 only" in init.stderr  # the blind /lookup is said
            started.append(start_standalone_engine(root / name, root / f"{name}.log"))
            urls[f"kvctl-{name}"] = f"http://127.0.0.1:{port_start + 1}"  # config init's instance id
        for (name, url), proc in zip(urls.items(), started[1:]):
            wait_until(lambda url=url: http_json("GET", f"{url}/lmc_version"), 120, name, proc, root / f"{name}.log")
        wait_until(lambda: len(http_json("POST", f"{controller}/query_worker_info",
                                         json={"instance_id": "all", "worker_ids": None})["worker_infos"]) == 2,
                   60, "both engines registered")
        tokens = root / "tokens.json"
        tokens.write_text(json.dumps(list(range(2 * CHUNK))))
        yield {"controller": f"controller://127.0.0.1:{port}", "urls": urls, "engines": started[1:], "root": root,
               "tokens": tokens}
    finally:
        for proc in started:
            stop_process(proc, grace=5)


def fleet_json(*args, **options):
    result = run_kvctl(*args, "--format", "json", **options)
    return result, json.loads(result.stdout) if result.stdout else None


def by_instance(report) -> dict:
    return {entry["instance"]: entry for entry in report["instances"]}


def test_the_controller_names_the_fleet_without_an_inventory(fleet, tmp_path):
    result, report = fleet_json("health", "--instance", fleet["controller"], cwd=tmp_path)
    assert result.code == 0, result.stderr
    members = by_instance(report)
    assert set(members) == {"kvctl-node-a", "kvctl-node-b"} and all(member["healthy"] for member in members.values())
    targets = {name: member["checks"][0]["target"] for name, member in members.items()}
    assert targets == fleet["urls"]  # the internal APIs found from the registrations, each checked by its id


def test_lookup_names_the_instance_that_holds_a_prompt_and_pins_and_evicts_through_the_fleet(fleet, tmp_path):
    stored = http_json("POST", f"{fleet['urls']['kvctl-node-a']}/cache/store?tokens_mock=0,{2 * CHUNK}")
    assert stored["num_tokens"] == 2 * CHUNK
    result, report = fleet_json("lookup", "--tokens-file", fleet["tokens"], "--instance", fleet["controller"],
                                cwd=tmp_path)
    assert result.code == 0, result.stderr
    hits = {name: entry["hit_tokens"]["total"] for name, entry in by_instance(report).items()}
    assert hits == {"kvctl-node-a": 2 * CHUNK, "kvctl-node-b": 0}
    result, report = fleet_json("pin", "--tokens-file", fleet["tokens"], "--instance", fleet["controller"],
                                cwd=tmp_path)
    assert result.code == 0, result.stderr
    pinned = {name: entry["chunks"] for name, entry in by_instance(report).items()}
    assert pinned == {"kvctl-node-a": 2, "kvctl-node-b": 2}
    result, report = fleet_json("evict", "--tokens-file", fleet["tokens"], "--instance", fleet["controller"],
                                "--yes", cwd=tmp_path)
    assert result.code == 0, result.stderr
    assert by_instance(report)["kvctl-node-a"]["skipped_pinned"]["cpu"] == 2  # pinned through the fleet: kept
    fleet_json("unpin", "--all", "--instance", fleet["controller"], cwd=tmp_path)
    result, report = fleet_json("evict", "--tokens-file", fleet["tokens"], "--instance", fleet["controller"],
                                "--yes", cwd=tmp_path)
    assert result.code == 0 and by_instance(report)["kvctl-node-a"]["removed"]["cpu"] == 2, result.stderr


def test_a_stopped_instance_is_stale_and_never_asked(fleet, tmp_path):
    """Last: it stops node-b. The controller keeps it registered (LMCache 0.5.6 never deregisters on
    SIGTERM); kvctl reports it stale from its heartbeat age instead of hanging on it."""
    stop_process(fleet["engines"][1], grace=5)
    stale = f"{fleet['controller']}?stale_after_s={STALE_S}"
    wait_until(lambda: "stale" in json.dumps(fleet_json("health", "--instance", stale, cwd=tmp_path)[1]), 60,
               "node-b stale")
    result, report = fleet_json("health", "--instance", stale, cwd=tmp_path)
    members = by_instance(report)
    assert result.code == 6 and members["kvctl-node-a"]["healthy"] is True, json.dumps(report)[:1500]
    (check,) = members["kvctl-node-b"]["checks"]
    assert check["ok"] is False and "stale" in check["detail"] and "heartbeat" in check["detail"]
    result, report = fleet_json("ls", "--instance", stale, cwd=tmp_path)
    assert result.code == 6 and "stale" in by_instance(report)["kvctl-node-b"]["errors"]["instance"]
