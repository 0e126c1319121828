"""Every parser of what a user (or an attacker) hands kvctl: it answers, or refuses in one line with a
hint. Never a traceback, never a crash of another kind, whatever the bytes."""

from __future__ import annotations

import io
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.core.admin import chunk_top
from kvctl.core.admin.mp_admin import parse_size
from kvctl.core.cache import prewarm, snapshot
from kvctl.core.config import validate
from kvctl.core.errors import KvctlError
from kvctl.core.instance import addresses
from kvctl.core.lmcache import tokens
from kvctl.core.lmcache.config import (
    ConversionError,
    convert_value,
    env_value,
    parse_env_file,
    parse_kv_transfer_config,
)
from kvctl.core.pins import pinsets
from kvctl.core.pins.durations import parse_duration
from plugins.kvctl_plugins.wire import FRAME_LENGTH, read_frames
from tests.property.strategies import JSON_VALUES, hostile_bytes, json_bytes, refused_in_one_line


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


def written(scratch: Path, name: str, content: bytes) -> Path:
    path = scratch / name
    path.write_bytes(content)
    return path


SIZES_AND_DURATIONS = st.one_of(st.text(max_size=30), st.from_regex(r"-?[0-9]{0,500}(\.[0-9]{0,40})?[a-zA-Z]{0,4}",
                                                                      fullmatch=True))


@given(SIZES_AND_DURATIONS)
def test_sizes_and_durations(text):
    answer = refused_in_one_line(lambda: parse_size(text))
    assert isinstance(answer, KvctlError) or answer > 0
    answer = refused_in_one_line(lambda: parse_duration(text))
    assert isinstance(answer, KvctlError) or answer > 0


TOKEN_LISTS = json_bytes(st.lists(st.integers(-5, 2**80), max_size=20))
CHATS = json_bytes(st.lists(st.fixed_dictionaries({"role": st.text(max_size=8)}, optional={"content": JSON_VALUES}),
                            max_size=4))


@given(hostile_bytes(TOKEN_LISTS, CHATS))
def test_token_and_chat_files(scratch, content):
    path = str(written(scratch, "input.json", content))
    ids = refused_in_one_line(lambda: tokens.read_token_ids(path))
    assert isinstance(ids, KvctlError) or all(isinstance(token, int) and token >= 0 for token in ids)
    refused_in_one_line(lambda: tokens.read_chat(path))


JSONL_LINES = st.lists(json_bytes(st.one_of(JSON_VALUES, st.fixed_dictionaries({"prompt": JSON_VALUES}),
                                            st.fixed_dictionaries({"messages": JSON_VALUES}))),
                       max_size=5).map(b"\n".join)


@given(hostile_bytes(JSONL_LINES))
def test_prewarm_prompt_files(scratch, content):
    path = str(written(scratch, "prompts.jsonl", content))
    refused_in_one_line(lambda: prewarm.load_prompts([path], chat=False))


PIN_SETS = st.fixed_dictionaries({"name": st.one_of(st.text(max_size=70), JSON_VALUES)},
                                 optional={"pins": st.one_of(JSON_VALUES, st.lists(st.dictionaries(
                                     st.sampled_from(["prompt_file", "tokens_file", "ttl", "tiers", "glob", "x"]),
                                     JSON_VALUES, max_size=3), max_size=4))})


@given(hostile_bytes(json_bytes(PIN_SETS)))
def test_pin_set_files(scratch, content):
    refused_in_one_line(lambda: pinsets.load(written(scratch, "pins.yaml", content)))


INVENTORIES = st.fixed_dictionaries({"instances": st.dictionaries(st.text(max_size=12), st.one_of(
    JSON_VALUES, st.fixed_dictionaries({}, optional={"url": st.text(max_size=40), "token_file": st.text(max_size=20),
                                                     "env_file": st.text(max_size=20), "state": JSON_VALUES})),
    max_size=3)})


@given(hostile_bytes(json_bytes(INVENTORIES)))
def test_inventories(scratch, content):
    path = written(scratch, "kvctl.yaml", content)
    if not isinstance(refused_in_one_line(lambda: addresses.read_inventory(path)), KvctlError):
        refused_in_one_line(lambda: addresses.resolve("all", inventory=path))


STATS_LINES = st.lists(st.one_of(json_bytes(), json_bytes(st.fixed_dictionaries(
    {"timestamp": JSON_VALUES, "hashes": st.one_of(JSON_VALUES, st.lists(st.text(max_size=8), max_size=4))})),
    st.binary(max_size=60)), max_size=8).map(b"\n".join)


@given(hostile_bytes(STATS_LINES))
def test_chunk_statistics_files(scratch, content):
    directory = scratch / "stats"
    directory.mkdir(exist_ok=True)
    written(directory, "chunk_statistics_0.jsonl", content)
    found = refused_in_one_line(lambda: chunk_top.top(directory, 5))
    assert isinstance(found, KvctlError) or found.files == 1


CONFIGS = st.dictionaries(st.sampled_from(["chunk_size", "local_cpu", "max_local_cpu_size", "local_disk",
                                           "max_local_disk_size", "remote_url", "extra_config", "save_unfull_chunk",
                                           "internal_api_server_port_start", "enable_controller", "unknown_key"]),
                          JSON_VALUES, max_size=6)


@given(yaml_file=hostile_bytes(json_bytes(CONFIGS)), connector=hostile_bytes(json_bytes(
    st.fixed_dictionaries({"kv_connector": st.sampled_from(["LMCacheConnectorV1", "LMCacheMPConnector", "x"])},
                          optional={"kv_connector_extra_config": JSON_VALUES, "kv_role": JSON_VALUES}))),
       env_file=hostile_bytes())
def test_configuration_directories(scratch, yaml_file, connector, env_file):
    directory = scratch / "config"
    directory.mkdir(exist_ok=True)
    written(directory, "lmcache.yaml", yaml_file)
    written(directory, "kv-transfer-config.json", connector)
    written(directory, "lmcache.env", env_file)
    refused_in_one_line(lambda: validate.validate(directory, block_size=16, environ={}, use_lmcache=False))
    refused_in_one_line(lambda: parse_kv_transfer_config(connector.decode(errors="replace"), "the connector"))
    refused_in_one_line(lambda: parse_env_file(env_file.decode(errors="replace")))


@given(key=st.sampled_from(["chunk_size", "max_local_cpu_size", "local_cpu", "extra_config", "lmcache_worker_ports",
                            "blocking_timeout_secs", "remote_serde", "pre_caching_hash_algorithm"]),
       value=st.one_of(st.text(max_size=60), hostile_bytes().map(lambda raw: raw.decode(errors="replace"))))
def test_lmcache_settings_from_the_environment(key, value):
    try:
        convert_value(key, env_value(value))
    except ConversionError:
        pass  # what LMCache itself would warn about and skip; kvctl reports it as a finding


def snapshot_bytes(manifest: bytes, members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in [("manifest.json", manifest), *members]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


MANIFESTS = json_bytes(st.fixed_dictionaries({}, optional={
    "version": JSON_VALUES, "kvctl_version": JSON_VALUES, "key_format": st.sampled_from(["inprocess", "mp", ["x"]]),
    "model": JSON_VALUES, "source": JSON_VALUES, "prompts": JSON_VALUES,
    "chunks": st.lists(st.fixed_dictionaries({"key": st.text(max_size=30), "member": st.sampled_from(
        ["chunks/0", "manifest.json", "../x", 3]), "size": JSON_VALUES, "blake3": st.text(max_size=64)}), max_size=3)}))


@given(manifest=hostile_bytes(MANIFESTS), members=st.lists(st.tuples(st.sampled_from(["chunks/0", "chunks/1", "x"]),
                                                                      st.binary(max_size=64)), max_size=2),
       cut=st.integers(0, 4096))
def test_snapshot_files(scratch, manifest, members, cut):
    whole = snapshot_bytes(manifest, members)
    for content in (whole, whole[:-cut or None]):
        path = written(scratch, "x.kvsnap", content)
        refused_in_one_line(lambda path=path: snapshot.listing(path))


HEADERS = json_bytes(st.fixed_dictionaries({}, optional={"key": JSON_VALUES, "size": JSON_VALUES,
                                                         "metadata": JSON_VALUES}))


@given(st.lists(st.tuples(st.one_of(HEADERS, hostile_bytes()), st.integers(0, 2**32 - 1), st.binary(max_size=40)),
                max_size=4), st.binary(max_size=8))
def test_wire_frames(frames, tail):
    """A body of frames parses into (key, bytes, metadata) or raises ValueError (the routes' 400)."""
    body = b"".join(FRAME_LENGTH.pack(min(length, len(header)) if length % 2 else len(header)) + header + data
                    for header, length, data in frames) + tail
    try:
        for key, data, metadata in read_frames(body):
            assert isinstance(key, str) and isinstance(data, memoryview)
            assert metadata is None or isinstance(metadata, bytes)
    except ValueError as error:
        assert "\n" not in str(error) and len(str(error)) < 600
