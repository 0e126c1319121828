"""`kvctl snapshot copy`: a warm prompt moved between two live engines by kvctl's verified path (read
through the source's routes, written through the target's, read back and compared), real standalone
engines with kvctl's plugins."""

from __future__ import annotations

import json

import pytest

from tests.helpers import http_client, run_kvctl, standalone_engine

pytestmark = pytest.mark.slow
CHUNK = 256


def test_a_copy_lands_byte_equal_and_hits_on_the_target(tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(list(range(3 * CHUNK))))
    with standalone_engine(tmp_path / "a", "--tier", "cpu:0.05") as source, \
            standalone_engine(tmp_path / "b", "--tier", "cpu:0.05") as target:

        assert http_client().post(f"{source}/cache/store?tokens_mock=0,{3 * CHUNK}", timeout=30).status_code == 200
        before = json.loads(run_kvctl("lookup", "--tokens-file", tokens, "--instance", target, "--format",
                                      "json").stdout)
        assert before["hit_tokens"]["total"] == 0
        copied = run_kvctl("snapshot", "copy", "--from", source, "--to", target, "--tokens-file", tokens,
                           "--format", "json")
        assert copied.code == 0, copied.stderr
        report = json.loads(copied.stdout)
        assert report["verified"] == report["chunks"] == 3 and report["mismatched"] == []
        assert report["prompts"][0]["hit_tokens"] == 3 * CHUNK
        after = json.loads(run_kvctl("lookup", "--tokens-file", tokens, "--instance", target, "--format",
                                     "json").stdout)
        assert after["hit_tokens"]["cpu"] == 3 * CHUNK
        a = run_kvctl("snapshot", "save", "--tokens-file", tokens, "--instance", source, "-o", tmp_path / "a.kvsnap")
        b = run_kvctl("snapshot", "save", "--tokens-file", tokens, "--instance", target, "-o", tmp_path / "b.kvsnap")
        assert a.code == b.code == 0
        sums = [checksums(tmp_path / name) for name in ("a.kvsnap", "b.kvsnap")]
        assert len(sums[0]) == 3 and sums[0] == sums[1]  # the target gives back the source's bytes


def checksums(path) -> list[tuple[str, str]]:
    """(key, BLAKE3) of every chunk a snapshot file holds, from its manifest."""
    import tarfile

    with tarfile.open(path) as archive:
        manifest = json.load(archive.extractfile("manifest.json"))
    return sorted((chunk["key"], chunk["blake3"]) for chunk in manifest["chunks"])


def test_a_copy_into_an_engine_that_makes_other_keys_is_refused_with_nothing_written(tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(list(range(2 * CHUNK))))
    with standalone_engine(tmp_path / "a", "--tier", "cpu:0.05") as source, \
            standalone_engine(tmp_path / "b", "--tier", "cpu:0.05", "--hash-algorithm", "builtin") as target:

        assert http_client().post(f"{source}/cache/store?tokens_mock=0,{2 * CHUNK}", timeout=30).status_code == 200
        refused = run_kvctl("snapshot", "copy", "--from", source, "--to", target, "--tokens-file", tokens)
        assert refused.code == 2 and "hash" in refused.stderr
        listed = json.loads(run_kvctl("ls", "--instance", target, "--format", "json").stdout)
        assert sum(tier["total"] for tier in listed["tiers"]) == 0
