"""`kvctl reconfigure` and `kvctl checksums` against a real `lmcache server`: a Device-DAX L2 adapter with
hotplug on a regular file, a Device-DAX L1 on another file (LMCache maps both with mmap), kvctl's routes, and a
KV cache registered through the request plane by LMCache's own MP client, whose tensors the server maps."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.clients.mp_server import MPServerClient
from kvctl.core.errors import ExitCode, RejectedError
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.helpers import STACK_ENV, free_port, run_cli, start_process, stop_process, wait_until

REGISTER_SCRIPT = Path(__file__).parent / "scripts" / "mp_register.py"
MIB = 1 << 20
SLOT = 128 * 1024
FILE_BYTES = 16 * MIB  # every device file: room to grow into (LMCache refuses a map past a file's end)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("mp-reconfigure")
    for name in ("l2-a", "l2-b", "l2-c", "l1-a", "l1-b"):
        os.truncate(_touch(base / f"{name}.dax"), FILE_BYTES)
    port, http_port = free_port(), free_port()
    l2 = {"type": "dax", "device_path": str(base / "l2-a.dax"), "max_dax_size_gb": 4 / 1024, "slot_bytes": SLOT,
          "hotplug_enabled": True}
    argv = [sys.executable, "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", "256", "--l1-size-gb",
            "0.008", "--eviction-policy", "LRU", "--no-l1-use-lazy", "--shm-name", "", "--l1-devdax-path",
            str(base / "l1-a.dax"), "--l2-adapter", json.dumps(l2), *MP_ROUTES_ARGV]
    log = base / "server.log"
    proc = start_process(argv, log)
    http = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: MPServerClient(http).info(), 120, "lmcache server", proc, log)
        yield {"http": http, "rpc": f"tcp://127.0.0.1:{port}", "dir": base}
    finally:
        stop_process(proc)


def _touch(path: Path) -> Path:
    path.touch()
    return path


def kvctl(server, *args):
    result = run_cli(*args, "--instance", server["http"], "--format", "json")
    return result, (json.loads(result.stdout) if result.stdout else None)


def device(server, name: str) -> str:
    return str(server["dir"] / f"{name}.dax")


def devices(server) -> dict[tuple[str, str], dict]:
    """(tier, file name) → the status row of each live device."""
    result, status = kvctl(server, "reconfigure", "status")
    assert result.code == 0, result.stderr
    return {(row["tier"], Path(row["device"]).stem): row for row in status["devices"]
            if row["state"] not in ("removed", "closed")}


@pytest.mark.slow
def test_status_shows_the_dax_adapter_and_the_l1_arena(server):
    result, status = kvctl(server, "reconfigure", "status")
    assert result.code == 0, result.stderr
    assert status["adapters"] == [{"index": 0, "type_name": "dax", "tier": "l2", "primary": True,
                                   "reconfigurable": True}]
    rows = devices(server)
    assert rows[("l2", "l2-a")] == {"tier": "l2", "backend": "dax", "adapter": 0, "device": device(server, "l2-a"),
                                    "capacity_bytes": 4 * MIB, "used_bytes": 0, "state": "active"}
    assert rows[("l1", "l1-a")]["state"] == "active" and status["l1"]["dax"] is True
    assert status["l2"][0]["status"]["slot_bytes"] == SLOT


@pytest.mark.slow
def test_add_resize_remove_an_l2_device_asking_where_chunks_can_go(server):
    b = device(server, "l2-b")
    result, plan = kvctl(server, "reconfigure", "add", "--device", b, "--size", "4MiB", "--dry-run")
    assert result.code == 0, result.stderr
    assert plan["dry_run"] and plan["answer"] is None
    assert plan["request"] == {"method": "POST", "path": "/reconfigure/dax/l2/add",
                               "body": {"device_path": b, "adapter_index": 0, "size": 4 * MIB}}
    assert ("l2", "l2-b") not in devices(server)  # a dry run changes nothing

    result, added = kvctl(server, "reconfigure", "add", "--device", b, "--size", "4MiB")
    assert result.code == 0, result.stderr
    assert added["answer"]["status"] == "ok" and not added["dry_run"]
    assert devices(server)[("l2", "l2-b")]["capacity_bytes"] == 4 * MIB

    again, _ = kvctl(server, "reconfigure", "add", "--device", b, "--size", "8MiB")  # 409 from the server
    assert again.code == ExitCode.REJECTED and "already active with a different size" in again.stderr
    taken, _ = kvctl(server, "reconfigure", "add", "--device", device(server, "l1-a"), "--size", "4MiB")
    assert taken.code == ExitCode.REJECTED and "already mapped by L1" in taken.stderr

    result, grown = kvctl(server, "reconfigure", "resize", "--device", b, "--size", "8MiB")  # growing: no question
    assert result.code == 0, result.stderr
    assert grown["risk"] is None and devices(server)[("l2", "l2-b")]["capacity_bytes"] == 8 * MIB

    refused, _ = kvctl(server, "reconfigure", "resize", "--device", b, "--size", "2MiB")
    assert refused.code == ExitCode.USAGE and "without --yes" in refused.stderr and "hint:" in refused.stderr
    assert devices(server)[("l2", "l2-b")]["capacity_bytes"] == 8 * MIB
    result, shrunk = kvctl(server, "reconfigure", "resize", "--device", b, "--size", "2MiB", "--yes")
    assert result.code == 0, result.stderr
    assert shrunk["answer"]["old_size_bytes"] == 8 * MIB
    assert devices(server)[("l2", "l2-b")]["capacity_bytes"] == 2 * MIB

    refused, _ = kvctl(server, "reconfigure", "remove", "--device", b)
    assert refused.code == ExitCode.USAGE and "without --yes" in refused.stderr
    assert devices(server)[("l2", "l2-b")]["state"] == "active"
    result, removed = kvctl(server, "reconfigure", "remove", "--device", b, "--yes")
    assert result.code == 0, result.stderr
    assert removed["answer"]["state"] == "removed" and ("l2", "l2-b") not in devices(server)
    gone, _ = kvctl(server, "reconfigure", "remove", "--device", b, "--yes")  # 404: no such device now
    assert gone.code == ExitCode.REJECTED and "DAX device not found" in gone.stderr


@pytest.mark.slow
def test_refusals_before_anything_is_sent(server):
    c = device(server, "l2-c")
    for args, said in ((("add", "--device", c), "needs --size"), (("add", "--device", c, "--size", "4XB"), "bad size"),
                       (("remove", "--device", c, "--size", "4MiB"), "No such option"),
                       (("remove", "--device", c, "--tier", "l1", "--mode", "evict"), "does not apply"),
                       (("add", "--device", c, "--size", "1MiB", "--tier", "l1", "--adapter", "1"), "--adapter")):
        result, _ = kvctl(server, "reconfigure", *args)
        assert result.code == ExitCode.USAGE and said in result.stderr, (args, result.stderr)
    assert ("l2", "l2-c") not in devices(server)
    slot, _ = kvctl(server, "reconfigure", "add", "--device", c, "--size", "1KiB")  # the server's 400
    assert slot.code == ExitCode.REJECTED and "does not fit one slot" in slot.stderr


@pytest.mark.slow
def test_l1_arena_add_and_drain(server):
    b = device(server, "l1-b")
    result, added = kvctl(server, "reconfigure", "add", "--tier", "l1", "--device", b, "--size", "4MiB")
    assert result.code == 0, result.stderr
    assert added["request"]["path"] == "/reconfigure/dax/l1/add" and added["answer"]["added"]["state"] == "active"
    assert devices(server)[("l1", "l1-b")]["capacity_bytes"] == 4 * MIB
    result, drained = kvctl(server, "reconfigure", "remove", "--tier", "l1", "--device", b)  # drain: no question
    assert result.code == 0, result.stderr
    assert drained["risk"] is None and ("l1", "l1-b") not in devices(server)


@pytest.fixture
def registered(server, tmp_path):
    tensors = tmp_path / "kv.pt"
    proc = subprocess.Popen([sys.executable, str(REGISTER_SCRIPT), server["rpc"], server["http"], str(tensors)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=(tmp_path / "register.log").open("w"),
                            text=True, env={**os.environ, **STACK_ENV})
    try:
        line = proc.stdout.readline()
        assert line, (tmp_path / "register.log").read_text()[-3000:]
        import torch

        yield {**json.loads(line), "tensors": torch.load(tensors)}
    finally:
        proc.stdin.close()
        proc.wait(60)


def expected_md5(tensors, blocks: list[int], layers=None) -> str:
    """What LMCache hashes for one chunk: each layer's blocks (axis 1 of [2, NB, BS, NH, HS]), layer after layer."""
    import torch

    md5 = hashlib.md5()
    for layer in layers if layers is not None else tensors:
        md5.update(layer.index_select(1, torch.tensor(blocks)).contiguous().numpy().tobytes())
    return md5.hexdigest()


@pytest.mark.slow
def test_checksums_are_the_md5_of_the_registered_blocks(server, registered):
    worker, tensors = str(registered["instance_id"]), registered["tensors"]
    result, report = kvctl(server, "checksums", "--blocks", "0-15,32,40-47", "--worker", worker)
    assert result.code == 0, result.stderr
    assert report["chunk_size"] == 16  # the server's 256-token chunk in 16-token blocks
    assert [(c["index"], c["blocks"]) for c in report["chunks"]] == [(0, "0-15"), (1, "32,40-47")]
    assert [c["md5"] for c in report["chunks"]] == [expected_md5(tensors, list(range(16))),
                                                    expected_md5(tensors, [32, *range(40, 48)])]

    result, layered = kvctl(server, "checksums", "--blocks", "3-6", "--chunk-size", "2", "--layerwise",
                            "--worker", worker)
    assert result.code == 0, result.stderr
    assert [c["layers"] for c in layered["chunks"]] == [
        {f"layer_{n}": expected_md5(tensors, blocks, [layer]) for n, layer in enumerate(tensors)}
        for blocks in ([3, 4], [5, 6])]


@pytest.mark.slow
def test_checksums_refusals(server, registered):
    missing, _ = kvctl(server, "checksums", "--blocks", "0-3", "--chunk-size", "4", "--worker", "7")  # the server's 404
    assert missing.code == ExitCode.REJECTED and "instance_id 7 not registered" in missing.stderr
    unknown, _ = kvctl(server, "checksums", "--blocks", "0-3", "--worker", "7")
    assert unknown.code == ExitCode.REJECTED and f"registered workers: {registered['instance_id']}" in unknown.stderr
    past, _ = kvctl(server, "checksums", "--blocks", "250-256", "--worker", str(registered["instance_id"]))
    assert past.code == ExitCode.USAGE and "past worker" in past.stderr
    for bad in ("5-3", "1,,2", "a-b", "-1"):
        result, _ = kvctl(server, "checksums", "--blocks", bad)
        assert result.code == ExitCode.USAGE and "hint:" in result.stderr, bad
    with MPServerClient(server["http"]) as client, pytest.raises(RejectedError, match="block_ids is required"):
        client.checksums([], 4, registered["instance_id"])  # the server's 400, which kvctl's parser never sends
