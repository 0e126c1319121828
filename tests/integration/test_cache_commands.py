"""`kvctl pin`, `unpin`, `pins` and `evict` against a real LMCache engine with kvctl's routes."""

import json

import pytest

from kvctl.cli.cache import parse_duration
from kvctl.core.errors import UsageError
from tests.helpers import free_port, http_json, run_kvctl, start_standalone_engine, stop_process, wait_until

CHUNK = 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-commands")
    port_start = free_port()
    assert run_kvctl("config", "init", "--out", root / "cfg", "--tier", "cpu:0.1", "--tier", f"disk:{root}/disk:1",
                     "--internal-api-port-start", port_start).code == 0
    log = root / "engine.log"
    proc = start_standalone_engine(root / "cfg", log)
    url = f"http://127.0.0.1:{port_start + 1}"
    try:
        wait_until(lambda: http_json("GET", f"{url}/lmc_version"), 120, "standalone engine", proc, log)
        yield {"url": url, "root": root}
    finally:
        stop_process(proc)


def store(engine, start, chunks):
    http_json("POST", f"{engine['url']}/cache/store", params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    path = engine["root"] / f"tokens-{start}.json"
    path.write_text(json.dumps(list(range(start, start + chunks * CHUNK))))
    wait_until(lambda: len(list((engine["root"] / "disk").glob("*.pt"))) >= chunks, 30, "disk files")
    return path


def kvctl(engine, *args):
    return run_kvctl(*args, "--instance", engine["url"], "--format", "json")


def test_durations():
    assert [parse_duration(text) for text in ("600", "30s", "10m", "2h", "1.5d")] == [600, 30, 600, 7200, 129600]
    for bad in ("", "10x", "-5", "0"):
        with pytest.raises(UsageError):
            parse_duration(bad)


@pytest.mark.slow
def test_pin_pins_unpin(engine):
    tokens = store(engine, 0, 2)
    pinned = kvctl(engine, "pin", "--tokens-file", tokens, "--ttl", "10m")
    assert pinned.code == 0, pinned.stderr
    pin = json.loads(pinned.stdout)
    assert pin["pinned"] == {"cpu": 2, "disk": 2} and 590 < pin["ttl_remaining_s"] <= 600
    listed = json.loads(kvctl(engine, "pins").stdout)["pins"]
    assert [entry["pin_id"] for entry in listed] == [pin["pin_id"]]
    kept = json.loads(kvctl(engine, "evict", "--tokens-file", tokens, "--yes").stdout)
    assert kept["removed"] == {"cpu": 0, "disk": 0} and kept["skipped_pinned"] == {"cpu": 2, "disk": 2}
    released = json.loads(kvctl(engine, "unpin", "--tokens-file", tokens).stdout)["unpinned"]
    assert [entry["pin_id"] for entry in released] == [pin["pin_id"]]
    assert json.loads(kvctl(engine, "pins").stdout)["pins"] == []
    assert kvctl(engine, "unpin", "--pin-id", "nope").code == 4


@pytest.mark.slow
def test_evict_asks_for_yes_lists_on_dry_run_and_removes(engine):
    tokens = store(engine, 10_000, 2)
    dry = json.loads(kvctl(engine, "evict", "--tokens-file", tokens, "--dry-run").stdout)
    assert dry["dry_run"] and dry["removed"] == {"cpu": 2, "disk": 2} and len(dry["chunks"]) == 4
    refused = kvctl(engine, "evict", "--tokens-file", tokens)
    assert refused.code == 2 and "without --yes" in refused.stderr
    lookup = json.loads(run_kvctl("lookup", "--instance", engine["url"], "--tokens-file", tokens).stdout)
    assert lookup["hit_tokens"]["total"] == 2 * CHUNK  # neither the dry run nor the refusal removed anything
    done = json.loads(kvctl(engine, "evict", "--tokens-file", tokens, "--tier", "disk", "--yes").stdout)
    assert done["removed"] == {"disk": 2}
    after = json.loads(run_kvctl("lookup", "--instance", engine["url"], "--tokens-file", tokens).stdout)
    assert [chunk["tiers"] for chunk in after["chunks"]] == [["cpu"], ["cpu"]]
    everything = json.loads(kvctl(engine, "evict", "--tier", "cpu", "--yes").stdout)
    assert everything["removed"]["cpu"] >= 2
    assert kvctl(engine, "evict").code == 2
