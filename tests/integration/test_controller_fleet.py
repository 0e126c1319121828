"""A fleet from LMCache's own controller: a real controller (`python -m lmcache.v1.api_server`) and two
real standalone engines registered with it through `kvctl config init --controller`. No inventory:
`--instance controller://HOST:PORT` finds them, a stopped one is reported stale and not asked."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from tests.helpers import (
    edit_yaml,
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
WORKER_TIMEOUT_S = 4  # below the engines' 5 s heartbeats: doctor must say so (health checks stay off)
STALE_S = 20  # the engines beat every 5 s: a stopped one is stale after this in the tests


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("controller-fleet")
    port = free_port(span=4)
    ports = {"pull": port + 1, "reply": port + 2, "heartbeat": port + 3}
    started = []
    try:
        started.append(start_process([sys.executable, "-m", "lmcache.v1.api_server", "--host", "127.0.0.1", "--port",
                                      str(port), "--monitor-ports", json.dumps(ports), "--lmcache-worker-timeout",
                                      str(WORKER_TIMEOUT_S)], root / "controller.log"))
        controller = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_json("GET", f"{controller}/controller/key-stats"), 120, "controller", started[0],
                   root / "controller.log")
        urls = {}
        for name in ("node-a", "node-b"):
            port_start = free_port(span=110)  # the internal API and, 100 above it, the controller worker port
            init = run_kvctl("config", "init", "--out", root / name, "--tier", "cpu:0.05", "--controller",
                             f"127.0.0.1:{port}", "--internal-api-port-start", port_start,
                             "--hash-algorithm", "builtin")  # what the controller's own /lookup hashes with
            assert init.code == 0, init.stderr
            assert "builtin and chunk size 256 only" not in init.stderr
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


def store(url: str, start: int, end: int) -> None:
    """Cache tokens start..end on an engine (LMCache's debug store), again until its own lookup holds them:
    an engine drops stores while it freezes for the full sync after registering with the controller."""
    tokens = list(range(start, end))

    def landed() -> bool:
        http_json("POST", f"{url}/cache/store?tokens_mock={start},{end}")
        answer = http_json("POST", f"{url}/kvctl/v1/lookup", json={"tokens": tokens})
        return answer["hit_tokens"]["total"] == len(tokens)

    wait_until(landed, 60, f"tokens {start}..{end} cached at {url}")


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


def test_doctor_reads_from_the_controllers_process_what_its_api_does_not_say(fleet, tmp_path):
    result, report = fleet_json("doctor", "--instance", fleet["controller"], cwd=tmp_path)
    assert result.stdout, result.stderr
    checks = [finding["check"] for finding in report["findings"]]
    assert "controller_version" not in checks, report["findings"]  # read from its process: the engines' own
    beats = {finding["instance"]: finding for finding in report["findings"]
             if finding["check"] == "controller_heartbeats"}
    assert set(beats) == {"kvctl-node-a", "kvctl-node-b"}, report["findings"]
    assert f"times workers out after {WORKER_TIMEOUT_S} s" in beats["kvctl-node-a"]["what"]


def test_lookup_names_the_instance_that_holds_a_prompt_and_pins_and_evicts_through_the_fleet(fleet, tmp_path):
    store(fleet["urls"]["kvctl-node-a"], 0, 2 * CHUNK)
    result, report = fleet_json("lookup", "--tokens-file", fleet["tokens"], "--instance", fleet["controller"],
                                cwd=tmp_path)
    assert result.code == 0, result.stderr
    hits = {name: entry["hit_tokens"]["total"] for name, entry in by_instance(report).items()}
    assert hits == {"kvctl-node-a": 2 * CHUNK, "kvctl-node-b": 0}
    routing = report["routing"]  # the routing question, from the instances' answers and the controller's index
    assert routing["best"] == {"instance": "kvctl-node-a", "hit_tokens": 2 * CHUNK}
    assert routing["controller_index"] == {"kvctl-node-a": {"location": "LocalCPUBackend", "tokens": 2 * CHUNK}}
    assert routing["disagreements"] == [] and "longest cached prefix: kvctl-node-a (512 tokens)" in result.stderr
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


def test_a_pin_set_brings_every_registered_instance_in_line(fleet, tmp_path):
    pin_set = tmp_path / "pins.yaml"
    pin_set.write_text(f"name: fleet-set\npins:\n  - tokens_file: {fleet['tokens']}\n")
    result, report = fleet_json("pin", "apply", pin_set, "--instance", fleet["controller"], cwd=tmp_path)
    assert result.code == 0, result.stderr
    assert set(by_instance(report)) == {"kvctl-node-a", "kvctl-node-b"}
    for url in fleet["urls"].values():
        pins = http_json("GET", f"{url}/kvctl/v1/pins")["pins"]
        assert [pin["pin_id"].startswith("set-fleet-set-") for pin in pins] == [True]
    result, _ = fleet_json("unpin", "--all", "--instance", fleet["controller"], cwd=tmp_path)
    assert result.code == 0, result.stderr


def test_a_stopped_instance_is_stale_and_never_asked(fleet, tmp_path):
    """Last: node-b dies (SIGKILL, as a crash or an OOM kill). The controller keeps it registered and
    indexed; kvctl reports it stale from its heartbeat age instead of hanging on it. (On SIGTERM LMCache
    0.5.6 sometimes deregisters and sometimes not: the dead instance then simply is not listed.)"""
    other = fleet["root"] / "other.json"  # a prompt only node-b holds, in the controller's index too
    other.write_text(json.dumps(list(range(10_000, 10_000 + 2 * CHUNK))))
    store(fleet["urls"]["kvctl-node-b"], 10_000, 10_000 + 2 * CHUNK)
    wait_until(lambda: fleet_json("lookup", "--tokens-file", other, "--instance", fleet["controller"],
                                  cwd=tmp_path)[1]["routing"]["controller_index"], 60, "the controller's index")
    os.killpg(fleet["engines"][1].pid, signal.SIGKILL)  # a crash: no deregistration reaches the controller
    fleet["engines"][1].wait(30)
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
    result, report = fleet_json("lookup", "--tokens-file", other, "--instance", stale, cwd=tmp_path)
    routing = report["routing"]  # the index still names the dead holder: said, not trusted
    assert routing["best"] is None and "kvctl-node-b" in routing["controller_index"]
    assert any("kvctl-node-b" in note and "stale" in note for note in routing["disagreements"])
    result, report = fleet_json("doctor", "--instance", stale, cwd=tmp_path)
    checks = {(finding["check"], finding.get("instance")): finding for finding in report["findings"]}
    drift = checks[("controller_drift", "kvctl-node-b")]  # the dead instance is still indexed
    assert drift["level"] == "warning" and f"indexes {2} chunks" in drift["what"], drift
    assert not [key for key in checks if key == ("controller_drift", "kvctl-node-a")], report["findings"]
    assert ("controller_address", None) in checks  # both registered from this host's one address


def test_an_instance_configured_elsewhere_is_answered_for_by_the_controller(fleet, tmp_path):
    """An engine someone else configured: registered, its internal API not at the controller port - 100.
    kvctl asks the controller for it (health, its index, a pin, clearing its CPU tier), says each answer
    came from there, and refuses what needs the engine itself."""
    root, controller_port = fleet["root"], fleet["controller"].rsplit(":", 1)[1]
    mapped, api = free_port(span=110), free_port()
    init = run_kvctl("config", "init", "--out", root / "node-c", "--tier", "cpu:0.05", "--controller",
                     f"127.0.0.1:{controller_port}", "--internal-api-port-start", mapped, "--hash-algorithm", "builtin")
    assert init.code == 0, init.stderr
    edit_yaml(root / "node-c" / "lmcache.yaml", internal_api_server_port_start=api, pin_timeout_sec=10,
              pin_check_interval_sec=2)  # LMCache checks pins every 30 s unless told
    url, log = f"http://127.0.0.1:{api + 1}", root / "node-c.log"
    proc = start_standalone_engine(root / "node-c", log)
    stale = f"{fleet['controller']}?stale_after_s={STALE_S}"
    try:
        wait_until(lambda: http_json("GET", f"{url}/lmc_version"), 120, "node-c", proc, log)
        store(url, 20_000, 20_000 + 2 * CHUNK)  # through its own API, which kvctl is not told of
        prompt = root / "node-c.json"
        prompt.write_text(json.dumps(list(range(20_000, 20_000 + 2 * CHUNK))))

        def node_c(*args):
            result, report = fleet_json(*args, "--instance", stale, cwd=tmp_path)
            return result, by_instance(report)["kvctl-node-c"], report

        _, health, _ = node_c("health")
        (check,) = health["checks"]
        assert health["healthy"] and check["component"] == "controller" and "only the controller" in check["detail"]
        wait_until(lambda: node_c("lookup", "--tokens-file", prompt)[1]["hit_tokens"]["total"] == 2 * CHUNK, 60,
                   "the controller's index")
        _, lookup, report = node_c("lookup", "--tokens-file", prompt)
        assert lookup["hit_tokens"] == {"total": 2 * CHUNK, "cpu": 2 * CHUNK, "disk": None, "redis": None}
        assert lookup["tiers_checked"] == ["controller_index"]
        assert lookup["diagnostics"][0]["cause"] == "controller_index"
        assert report["routing"]["best"] == {"instance": "kvctl-node-c", "hit_tokens": 2 * CHUNK}
        # the controller's key counts may lag its /lookup (its listings are cached up to 30 s)
        wait_until(lambda: node_c("stats")[1]["controller_index"] == {"chunks": 2}, 60, "the controller's key counts")
        _, listing, _ = node_c("ls")
        assert "only its controller answers" in listing["errors"]["instance"] and "kvctl.yaml" in listing["hint"]
        result, report = fleet_json("doctor", "--instance", stale, cwd=tmp_path)
        (finding,) = [f for f in report["findings"] if f.get("instance") == "kvctl-node-c"]
        assert finding["check"] == "controller_only" and "2 chunks" in finding["what"]
        _, pinned, _ = node_c("pin", "--tokens-file", prompt)
        assert pinned == {"instance": "kvctl-node-c", "answered_by": "controller", "location": "LocalCPUBackend",
                          "pinned_tokens": 2 * CHUNK}
        _, held, _ = node_c("evict", "--tier", "cpu", "--all", "--yes")
        assert held["removed"] == {"cpu": 0} and held["cleared_whole"] == ["cpu"]  # pinned: LMCache skips them
        wait_until(lambda: node_c("evict", "--tier", "cpu", "--all", "--yes")[1]["removed"] == {"cpu": 2}, 30,
                   "the pin timeout (10 s, checked every 2 s) and the clear")
        assert http_json("POST", f"{url}/kvctl/v1/lookup", json={"tokens": json.loads(prompt.read_text())})[
            "hit_tokens"]["total"] == 0
    finally:
        stop_process(proc, grace=5)
