"""#20 item 6: a snapshot's chunks are keyed as its own manifest says (model, world size, KV dtype) and each
metadata header sizes exactly its chunk, or nothing of it is written; a whole tier's snapshot is of one model."""

import json
import struct
import tarfile

import pytest

from tests.fast.conftest import LLAMA_V2, MODEL, OTHER_LLAMA, PROMPT_FILE, PROMPT_KEYS, contents
from tests.fast.test_snapshot import refused, rewritten, saved, target  # noqa: F401 - target is a fixture


def test_a_whole_tier_without_model_is_the_instance_models_only(instances, kvctl, tmp_path):
    """The cpu tier also holds a chunk of llama@v2: the snapshot says llama, so it holds llama's alone."""
    out, result = saved(kvctl, tmp_path, "--tier", "cpu", "--all")
    assert result.code == 0, result.stderr
    with tarfile.open(out) as archive:
        manifest = json.load(archive.extractfile("manifest.json"))
    assert manifest["keys"]["model"] == MODEL
    assert sorted(chunk["key"] for chunk in manifest["chunks"]) == sorted(PROMPT_KEYS + OTHER_LLAMA)
    assert LLAMA_V2[0] not in {chunk["key"] for chunk in manifest["chunks"]}


def _header(size: int, dtype_code: int = 2, elements: int | None = None) -> str:
    return struct.pack("=7i", size, 1, dtype_code, size // 2 if elements is None else elements, 0, 0, 0).hex()


STRANGERS = {
    "another model": (lambda chunk: chunk.update(key=chunk["key"].replace("llama@", "mistral@")),
                      "is keyed for model mistral, not llama"),
    "another world size": (lambda chunk: chunk.update(key=chunk["key"].replace("@1@0@", "@2@0@")),
                           "is keyed for world size 2, not 1"),
    "another KV dtype": (lambda chunk: chunk.update(key=chunk["key"].replace("@half", "@bfloat16"), metadata=None),
                         "is keyed for KV dtype bfloat16, not half"),
    "a header of another length": (lambda chunk: chunk.update(metadata=_header(chunk["size"] * 2, elements=512)),
                                   "its metadata header says 2048 bytes"),
    "a header of fewer elements": (lambda chunk: chunk.update(metadata=_header(chunk["size"], elements=100)),
                                   "of shapes holding 200"),
    "a header of another dtype": (lambda chunk: chunk.update(metadata=_header(chunk["size"], dtype_code=3)),
                                  "metadata header says KV dtype bfloat16; its key says half"),
    "no header at all": (lambda chunk: chunk.update(metadata="6d6574613a"), "metadata header is not LMCache's"),
}


@pytest.mark.parametrize("change", STRANGERS.values(), ids=STRANGERS.keys())
def test_a_chunk_its_manifest_does_not_describe_is_refused_with_nothing_written(instances, target, kvctl,  # noqa: F811
                                                                                tmp_path, change):
    out, result = saved(kvctl, tmp_path, "--tokens-file", PROMPT_FILE)
    assert result.code == 0, result.stderr
    edit, message = change
    path = rewritten(out, lambda manifest: edit(manifest["chunks"][3]), tmp_path / "stranger.kvsnap")
    refused(kvctl("snapshot", "load", path, "--instance", "node-b"), 1, message)
    assert contents(target) == {"cpu": set(), "disk": set()}

