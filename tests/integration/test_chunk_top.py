"""`kvctl chunk-stats top --dir`: the hottest chunk prefixes and prompts from files LMCache's own file_hash
recorder wrote (its FileHashStrategy, as vLLM's scheduler runs it), next to a FIFO, a foreign file and a torn line."""

import json
import os

import pytest

from tests.helpers import run_cli

CHUNK = 4
SYSTEM = list(range(1000, 1008))  # two chunks every request shares
REQUESTS = [SYSTEM + [1, 2, 3, 4], SYSTEM + [5, 6, 7, 8], SYSTEM + [1, 2, 3, 4], list(range(50, 62))]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """LMCache's recorder writes one line per request; its hashes of the prompts, in order."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.lookup_client.record_strategies.file_hash import FileHashStrategy

    directory = tmp_path_factory.mktemp("chunk-hashes")
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK,
                                               extra_config={"chunk_statistics_file_output_dir": str(directory)})
    recorder = FileHashStrategy(config, CHUNK)
    hashes = []
    for number, tokens in enumerate(REQUESTS):
        hashes.append(recorder.preprocess(tokens))
        recorder.record(hashes[-1], f"request-{number}")
    recorder.current_file_handle.close()
    return directory, hashes


def test_the_shared_prefix_is_the_hottest_and_repeated_prompts_are_counted(recorded):
    directory, hashes = recorded
    result = run_cli("chunk-stats", "top", "--dir", directory, "--format", "json")
    assert result.code == 0, result.stderr
    top = result.json()
    assert (top["files"], top["requests"], top["chunk_refs"], top["skipped_lines"]) == (1, 4, 12, 0)
    assert [(hot["chunk_hash"], hot["chunks"], hot["requests"]) for hot in top["chunks"][:3]] == [
        (hashes[0][1], 2, 3), (hashes[0][0], 1, 3), (hashes[0][2], 3, 2)]
    assert [(hot["chunk_hash"], hot["chunks"], hot["requests"]) for hot in top["prompts"]] == [
        (hashes[0][2], 3, 2), (hashes[3][2], 3, 1), (hashes[1][2], 3, 1)]
    limited = run_cli("chunk-stats", "top", "--dir", directory, "--limit", "1", "--format", "json").json()
    assert len(limited["chunks"]) == len(limited["prompts"]) == 1


def test_what_is_not_lmcaches_is_skipped_and_counted(recorded, tmp_path):
    directory, hashes = recorded
    for path in directory.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes() + b'{"timestamp": 1, "chunk_hashes": [7]}\n{torn\n')
    os.mkfifo(tmp_path / "chunk_hashes_1_999999.jsonl")  # never opened: it would hang a reader
    (tmp_path / "notes.jsonl").write_text(json.dumps({"timestamp": 1, "chunk_hashes": ["0x1"]}) + "\n")
    top = run_cli("chunk-stats", "top", "--dir", tmp_path, "--format", "json").json()
    assert (top["files"], top["requests"], top["skipped_lines"]) == (1, 4, 2)
    table = run_cli("chunk-stats", "top", "--dir", tmp_path, "--format", "table")
    assert table.code == 0 and hashes[0][1] in table.stdout and "hottest prompts" in table.stdout


def test_hostile_lines_are_skipped_and_counted(recorded, tmp_path):
    """Lines Python's json cannot turn into a record (nesting past its recursion limit, a 400-digit
    timestamp no float holds) are counted as skipped like any torn line, never an abort."""
    directory, _ = recorded
    hostile = [b"[" * 100_000 + b"]" * 100_000, b'{"timestamp": ' + b"9" * 400 + b', "chunk_hashes": ["ab"]}',
               b'{"timestamp": 1, "chunk_hashes": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]
    for path in directory.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes() + b"\n".join(hostile) + b"\n")
    result = run_cli("chunk-stats", "top", "--dir", tmp_path, "--format", "json")
    assert result.code == 0, result.stderr
    assert (result.json()["requests"], result.json()["skipped_lines"]) == (4, 3)


def test_a_directory_without_statistics_is_one_line_and_a_hint(tmp_path):
    empty = run_cli("chunk-stats", "top", "--dir", tmp_path)
    assert empty.code == 1 and empty.stderr.startswith("error: ") and "hint: " in empty.stderr
    missing = run_cli("chunk-stats", "top", "--dir", tmp_path / "nowhere")
    assert missing.code == 2 and "no chunk statistics directory" in missing.stderr
