"""Chunk bytes read from a file into reused buffers (snapshot save and load): what a reader gets when the
file is shorter than it was, when its tier already closed it, and which buffer a chunk lands in."""

import os

import pytest

from kvctl.core.common.file_extent import BufferRing, FileExtent
from kvctl.core.errors import KvctlError


def test_an_extent_reads_its_bytes_and_only_those(tmp_path):
    path = tmp_path / "chunk"
    path.write_bytes(b"header" + bytes(range(256)) * 4 + b"trailer")
    fd = os.open(path, os.O_RDONLY)
    try:
        extent = FileExtent(fd, 6, 1024)
        assert bytes(extent.read()) == bytes(range(256)) * 4
        buffer = memoryview(bytearray(2048))
        assert bytes(extent.read_into(buffer)) == bytes(range(256)) * 4 and len(extent.read_into(buffer)) == 1024
    finally:
        os.close(fd)


def test_a_file_that_shrank_since_it_was_measured_is_one_clear_error(tmp_path):
    path = tmp_path / "chunk"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        extent = FileExtent(fd, 0, 4096)
        os.truncate(path, 1000)  # an engine rewriting the chunk while kvctl reads it
        with pytest.raises(KvctlError, match="ended after 1000 of its 4096 bytes") as raised:
            extent.read()
        assert "run the command again" in raised.value.hint
    finally:
        os.close(fd)


def test_an_extent_read_after_its_tier_closed_it_raises_rather_than_read_another_file(tmp_path):
    path = tmp_path / "chunk"
    path.write_bytes(b"x" * 64)
    fd = os.open(path, os.O_RDONLY)
    extent = FileExtent(fd, 0, 64)
    extent.close()
    other = tmp_path / "other"
    other.write_bytes(b"y" * 64)
    os.close(fd)
    reused = os.open(other, os.O_RDONLY)  # likely the same number
    try:
        with pytest.raises(ValueError, match="after its tier closed it"):
            extent.read()
    finally:
        os.close(reused)


def test_a_ring_hands_out_its_buffers_in_turn_and_grows_one_for_a_larger_chunk():
    ring = BufferRing(3)
    first = ring.slot(0, 100)
    first[:] = b"a" * 100
    assert bytes(ring.slot(3, 100)) == b"a" * 100  # chunk 3 reuses chunk 0's buffer
    assert bytes(ring.slot(1, 100)) == bytes(100)
    larger = ring.slot(6, 500)  # a new buffer: the view of the old one is still held
    assert len(larger) == 500 and bytes(first) == b"a" * 100
