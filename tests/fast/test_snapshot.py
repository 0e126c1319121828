"""`kvctl snapshot save|load|ls` in process, between in-memory instances: what a user checks. The file is a
tar any tool lists; a load writes exactly the saved chunks and says per prompt what is now cached; a
snapshot that was cut short, changed, or made with other keys is refused with nothing written."""

import io
import json
import os
import tarfile
from types import SimpleNamespace

import pytest

from kvctl.core.instance.protocol import ChunkKeyed
from kvctl.core.lmcache.key_facts import KeyFacts
from tests.fast.conftest import MODEL, OTHER_PROMPT, PROMPT, PROMPT_FILE, PROMPT_KEYS, contents
from tests.fast.memory import MemoryInstance, MemoryStore, chunk_bytes, memory_keys, remote_metadata


@pytest.fixture
def target(instances, monkeypatch):
    """Node B: an instance that never saw the prompt, opened by --instance node-b (else instances.one)."""
    node_b = MemoryInstance("node-b", [MemoryStore("cpu"), MemoryStore("disk")])
    monkeypatch.setattr("kvctl.core.instance.opening.open_instance",
                        lambda selector, address=None: node_b if selector.instance == "node-b" else instances.one)
    return node_b


def saved(kvctl, tmp_path, *selection, name="warm.kvsnap"):
    out = tmp_path / name
    result = kvctl("snapshot", "save", *selection, "-o", out, "--format", "json")
    return out, result


def refused(result, code: int, message: str) -> None:
    assert result.code == code, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and message in lines[0] and lines[1].startswith("hint: "), lines


def test_a_prompt_saved_on_one_node_is_cached_on_another_after_loading(instances, target, kvctl, tmp_path):
    out, result = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    assert result.code == 0, result.stderr
    assert result.json()["chunks"] == 4 and result.json()["prompts"][0]["saved"] == 4

    loaded = kvctl("snapshot", "load", out, "--instance", "node-b", "--format", "json")
    assert loaded.code == 0, loaded.stderr
    report = loaded.json()
    assert report["written"] == {"cpu": 4} and report["already"] == {"cpu": 0}
    assert report["prompts"] == [{"source": report["prompts"][0]["source"], "tokens": 16, "chunks": 4, "cached": 4,
                                  "hit_tokens": 16}]
    assert {key: target.data[key] for key in PROMPT_KEYS} == {key: chunk_bytes(key) for key in PROMPT_KEYS}
    assert contents(target) == {"cpu": set(PROMPT_KEYS), "disk": set()}

    again = kvctl("snapshot", "load", out, "--instance", "node-b", "--tier", "cpu", "--format", "json").json()
    assert again["written"] == {"cpu": 0} and again["already"] == {"cpu": 4}


def test_the_file_is_a_tar_with_the_chunks_and_a_manifest_of_what_made_the_keys(instances, kvctl, tmp_path):
    out, _ = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    with tarfile.open(out) as archive:
        names = archive.getnames()
        manifest = json.load(archive.extractfile("manifest.json"))
        first = archive.extractfile(names[0]).read()
    assert names[-1] == "manifest.json" and len(names) == 5
    assert manifest["keys"] == {"model": MODEL, "kv_dtype": "half", "world_size": 1, "chunk_size": 4,
                                "hash_algorithm": "crc32", "hash_seed": "0"}
    assert manifest["prompts"][0]["token_ids"] == PROMPT and manifest["prompts"][0]["keys"] == PROMPT_KEYS
    assert first == chunk_bytes(manifest["chunks"][0]["key"])
    assert bytes.fromhex(manifest["chunks"][0]["metadata"]) == remote_metadata(len(first))

    listed = kvctl("snapshot", "ls", out, "--format", "json").json()
    assert (listed["chunks"], listed["bytes"], listed["missing"]) == (4, 4 * 1024, 0)
    assert listed["prompts"][0]["tokens"] == 16
    table = kvctl("snapshot", "ls", out, "--format", "table")
    assert table.code == 0 and "hash_algorithm" in table.stdout and "crc32" in table.stdout


def test_a_whole_tier_can_be_saved(instances, target, kvctl, tmp_path):
    out, result = saved(kvctl, tmp_path, "--tier", "disk", "--all", "--model", MODEL)
    assert result.code == 0, result.stderr
    assert result.json()["chunks"] == 2  # the disk tier holds the prompt's first two llama chunks
    loaded = kvctl("snapshot", "load", out, "--instance", "node-b", "--tier", "disk", "--format", "json").json()
    assert loaded["written"] == {"disk": 2} and contents(target)["disk"] == set(PROMPT_KEYS[:2])


def test_a_prompt_partly_cached_is_saved_with_what_is_there_and_exit_6(instances, kvctl, tokens_file, tmp_path):
    longer = tokens_file(PROMPT + OTHER_PROMPT, "longer.json")
    out, result = saved(kvctl, tmp_path, "--tokens-file", longer)
    assert result.code == 6
    assert result.json()["missing"] == 2 and result.json()["prompts"][0]["saved"] == 4
    assert "2 selected chunks are not cached" in result.stderr and out.exists()


def test_nothing_cached_leaves_no_file(instances, kvctl, tokens_file, tmp_path):
    out, result = saved(kvctl, tmp_path, "--tokens-file", tokens_file(OTHER_PROMPT, "cold.json"))
    refused(result, 1, "none of the 2 selected chunks is cached")
    assert not [name for name in os.listdir(tmp_path) if "kvsnap" in name]


def test_an_existing_file_is_replaced_only_with_force(instances, kvctl, tmp_path):
    (tmp_path / "warm.kvsnap").write_text("mine")
    _, result = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    refused(result, 2, "exists")
    assert (tmp_path / "warm.kvsnap").read_text() == "mine"
    os.mkfifo(tmp_path / "pipe")
    _, result = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE, "--force", name="pipe")
    refused(result, 1, "is a FIFO")
    _, result = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE, "--force")
    assert result.code == 0 and tarfile.is_tarfile(tmp_path / "warm.kvsnap")


def test_a_snapshot_is_readable_by_its_owner_only(instances, kvctl, tmp_path):
    """It holds the prompts' token ids: 0600 under any umask, also when --force replaces a 0644 file."""
    umask = os.umask(0o022)
    try:
        out, result = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
        assert result.code == 0 and out.stat().st_mode & 0o777 == 0o600
        out.chmod(0o644)
        _, result = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE, "--force")
        assert result.code == 0 and out.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(umask)


def test_save_needs_a_selection(instances, kvctl, tmp_path):
    refused(saved(kvctl, tmp_path)[1], 2, "say what to save")
    refused(saved(kvctl, tmp_path, "--all")[1], 2, "say what to save")


def tamper(path, offset_from_member: int, member: str = "chunks/000001") -> None:
    with tarfile.open(path) as archive:
        where = archive.getmember(member).offset_data + offset_from_member
    with open(path, "r+b") as file:
        file.seek(where)
        byte = file.read(1)
        file.seek(where)
        file.write(bytes([byte[0] ^ 1]))


def test_a_changed_snapshot_is_refused_with_nothing_written(instances, target, kvctl, tmp_path):
    out, _ = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    tamper(out, 100)
    result = kvctl("snapshot", "load", out, "--instance", "node-b")
    refused(result, 1, "the checksum of chunk")
    assert contents(target) == {"cpu": set(), "disk": set()}


@pytest.mark.parametrize("cut", [1, 700, 2000, 4700])
def test_a_truncated_snapshot_is_refused_with_nothing_written(instances, target, kvctl, tmp_path, cut):
    out, _ = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    size = out.stat().st_size
    os.truncate(out, size - cut)
    result = kvctl("snapshot", "load", out, "--instance", "node-b")
    refused(result, 1, "is not a usable snapshot")
    assert contents(target) == {"cpu": set(), "disk": set()}


HOSTILE = {
    "not json": b"{",
    "not a snapshot": json.dumps({"format": "zip"}).encode(),
    "a future version": json.dumps({"format": "kvctl-snapshot", "version": 99}).encode(),
    "nested past Python's stack": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("manifest", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_manifest_gets_one_line(target, kvctl, tmp_path, manifest):
    path = tmp_path / "hostile.kvsnap"
    with tarfile.open(path, "w") as archive:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        archive.addfile(info, io.BytesIO(manifest))
    refused(kvctl("snapshot", "ls", path), 1, "is not a usable snapshot")
    refused(kvctl("snapshot", "load", path, "--instance", "node-b"), 1, "is not a usable snapshot")


def test_a_manifest_naming_no_chunk_key_or_a_missing_member_is_refused(instances, target, kvctl, tmp_path):
    out, _ = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    for change, message in ((lambda m: m["chunks"][0].update(key="../../etc/passwd"), "is not an LMCache chunk key"),
                            (lambda m: m["chunks"][0].update(member="chunks/999999"), "data is missing"),
                            (lambda m: m["chunks"][0].update(member=["chunks/000000"]), "data is missing"),
                            (lambda m: m["source"].update(key_format="mp-object"), "is not an MP object key"),
                            (lambda m: m["source"].update(key_format="zip"), "format 'zip'"),
                            (lambda m: m["source"].update(key_format=["chunk"]), "hold other than plain values"),
                            (lambda m: m["keys"].update(model=[["llama"]]), "hold other than plain values"),
                            (lambda m: m["versions"].update(kvctl={"a": 1}), "hold other than plain values"),
                            (lambda m: m["missing"].extend(["x" * 1000] * (17 << 10)), "more than the 16 MiB")):
        path = rewritten(out, change, tmp_path / "changed.kvsnap")
        refused(kvctl("snapshot", "load", path, "--instance", "node-b"), 1, message)
    assert contents(target) == {"cpu": set(), "disk": set()}


def test_a_manifest_too_large_to_load_is_never_saved(instances, kvctl, tmp_path, monkeypatch):
    monkeypatch.setattr("kvctl.core.cache.snapshot.MAX_MANIFEST_BYTES", 1000)
    out, result = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    refused(result, 1, "more than the")
    assert not [name for name in os.listdir(tmp_path) if "kvsnap" in name]


def rewritten(out, change, path):
    """A copy of the snapshot `out` at `path` whose manifest change(manifest) edited."""
    with tarfile.open(out) as archive:
        manifest = json.load(archive.extractfile("manifest.json"))
    change(manifest)
    body = json.dumps(manifest).encode()
    with tarfile.open(out) as source, tarfile.open(path, "w") as archive:
        for member in source.getmembers()[:-1]:
            archive.addfile(member, source.extractfile(member))
        info = tarfile.TarInfo("manifest.json")
        info.size = len(body)
        archive.addfile(info, io.BytesIO(body))
    return path


class MPMemoryInstance(MemoryInstance):
    """An in-memory instance that, like an LMCache MP server, keys chunks by MP object keys."""

    kind = "mp"
    key_format = "mp-object"


def test_a_snapshot_is_loaded_only_where_chunks_are_keyed_the_same_way(instances, kvctl, tmp_path, monkeypatch):
    out, _ = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    mp_node = MPMemoryInstance("mp-node", [MemoryStore("cpu")])
    monkeypatch.setattr("kvctl.core.instance.opening.open_instance", lambda selector, address=None: mp_node)
    refused(kvctl("snapshot", "load", out, "--instance", "mp-node"), 2,
            "is keyed by an LMCache chunk key; mp-node (mp) keys chunks by an MP object key")
    assert contents(mp_node) == {"cpu": set()}

    plain = MemoryInstance("node-c", [MemoryStore("cpu")])
    monkeypatch.setattr("kvctl.core.instance.opening.open_instance", lambda selector, address=None: plain)
    older = rewritten(out, lambda manifest: manifest["source"].pop("key_format"), tmp_path / "older.kvsnap")
    loaded = kvctl("snapshot", "load", older, "--instance", "node-c", "--format", "json")  # before key formats
    assert loaded.code == 0 and loaded.json()["written"] == {"cpu": 4}, loaded.stderr


def test_a_target_that_makes_other_keys_is_refused_naming_the_difference(instances, target, kvctl, tmp_path):
    out, _ = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    target.hash_seed = "42"
    refused(kvctl("snapshot", "load", out, "--instance", "node-b"), 2,
            "was saved with PYTHONHASHSEED 0; node-b makes keys with 42")
    target.hash_seed, target.model = "0", "mistral"
    refused(kvctl("snapshot", "load", out, "--instance", "node-b"), 2, "was saved with model name llama")
    assert contents(target) == {"cpu": set(), "disk": set()}


def test_keys_the_target_makes_otherwise_are_refused_even_when_the_facts_agree(instances, target, kvctl, tmp_path):
    out, _ = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    target.key_facts = lambda model=None: KeyFacts()  # a target that does not say what makes its keys
    target.lookup = lambda tokens, model=None: MemoryInstance.lookup(target, [t + 1 for t in tokens], model)
    refused(kvctl("snapshot", "load", out, "--instance", "node-b"), 2, "makes other chunk keys")
    assert contents(target) == {"cpu": set(), "disk": set()}


def test_load_to_tier_all_is_a_usage_error(target, kvctl, tmp_path):
    refused(kvctl("snapshot", "load", tmp_path / "x.kvsnap", "--instance", "node-b", "--tier", "all"), 2,
            "--tier all does not say where")
    refused(kvctl("snapshot", "load", tmp_path / "x.kvsnap", "--instance", "node-b"), 2, "no snapshot at")


def test_prompt_keys_cover_every_rank():
    keys = [key.replace("@1@0@", "@2@0@") for key in memory_keys(PROMPT, MODEL)]

    class TwoRanks(ChunkKeyed):
        def lookup(self, tokens, model=None):
            return SimpleNamespace(chunks=[SimpleNamespace(key=key) for key in keys])

    assert TwoRanks().prompt_keys(PROMPT) == [key for k in keys for key in (k, k.replace("@2@0@", "@2@1@"))]
