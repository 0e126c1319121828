"""#20 item 18 against a real `lmcache server` with kvctl's routes: a snapshot load whose later chunks/write
request is refused (an object of a group the server's model does not have, after a first request of 512
good objects) says what the requests before it wrote, which stays in L1, instead of the refusal alone."""

import io
import json
import os
import tarfile
import time

import pytest
from blake3 import blake3

from kvctl import __version__
from kvctl.clients.mp_server import MPServerClient
from kvctl.core.cache.snapshot import KEY_FIELDS
from kvctl.core.instance.opening import Selector, open_instance
from kvctl.core.lmcache.keys import ObjectKey, kv_rank
from tests.helpers import run_cli, stop_process
from tests.integration.test_mp_l1_lookup import CHUNK_BYTES, MODEL
from tests.integration.test_mp_snapshot import Holder, configure, launch, wait_serving

FIRST_REQUEST = 512  # kvctl's 64 MiB of chunk bytes per chunks/write request, in 128 KiB objects
GOOD = FIRST_REQUEST + 8


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "kvctl-cache"))


@pytest.fixture
def server(tmp_path):
    """A server with room for the whole snapshot in L1 (0.2 GB), its model registered by LMCache's MP client."""
    rpc, http = configure(tmp_path / "mp", "cpu:0.2")
    log = tmp_path / "server.log"
    proc = launch(tmp_path / "mp", log)
    holder = None
    try:
        wait_serving(proc, log, http)
        holder = Holder(rpc, http, tmp_path / "client.log")
        yield http
    finally:
        if holder is not None:
            holder.close()
        stop_process(proc)


def snapshot_with_a_later_stranger(server_url: str, path):
    """GOOD objects of group 0 (random bytes, as a whole-L1 save would hold them), then one of group 1,
    under a manifest of the server's own key facts (so every check before writing passes)."""
    facts = open_instance(Selector(instance=server_url)).key_facts()
    keys = [ObjectKey(os.urandom(32), MODEL, kv_rank(1, 0)).native_key() for _ in range(GOOD)]
    keys.append(ObjectKey(os.urandom(32), MODEL, kv_rank(1, 0), object_group_id=1).native_key())
    chunks = []
    with tarfile.open(path, "w") as archive:
        for number, key in enumerate(keys):
            data = os.urandom(CHUNK_BYTES)
            member = tarfile.TarInfo(f"chunks/{number:06d}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
            chunks.append({"key": key, "member": member.name, "size": len(data), "blake3": blake3(data).hexdigest(),
                           "metadata": None})
        manifest = json.dumps({
            "format": "kvctl-snapshot", "version": 1, "created": time.time(),
            "source": {"instance": server_url, "kind": "mp", "key_format": "mp-object"},
            "versions": {"kvctl": __version__, "lmcache": facts.lmcache_version},
            "keys": {name: getattr(facts, name) for name in KEY_FIELDS},
            "prompts": [], "chunks": chunks, "missing": []}).encode()
        member = tarfile.TarInfo("manifest.json")
        member.size = len(manifest)
        archive.addfile(member, io.BytesIO(manifest))
    return path


@pytest.mark.slow
def test_a_load_refused_by_a_later_request_says_what_the_earlier_ones_wrote(server, tmp_path):
    path = snapshot_with_a_later_stranger(server, tmp_path / "stranger.kvsnap")
    result = run_cli("snapshot", "load", path, "--instance", server)
    assert result.code == 4, result.stdout + result.stderr
    message = result.stderr.splitlines()[0]
    assert "is of object group 1" in message, message
    assert f"the requests before it wrote {FIRST_REQUEST} chunks to cpu, which stay written" in message, message
    with MPServerClient(server) as client:
        assert client.keys(limit=1)["total"] == FIRST_REQUEST  # what the message says is in L1
