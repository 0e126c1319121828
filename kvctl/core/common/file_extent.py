"""Chunk bytes moved file to file through a few reused buffers.

A snapshot save or load moves chunks between files (a disk tier's chunk files, the snapshot) and hashes
each one. Read into a fresh bytes object per chunk, every chunk lands in freshly faulted pages, and a
mapped file is hashed at half the speed of a buffer in cache; a ring of buffers, each read with one
pread and hashed while it is in cache, keeps a save or load near the speed of `cp`.
"""

from __future__ import annotations

import os

from kvctl.core.errors import KvctlError


class FileExtent:
    """`size` bytes at `offset` of the open file `fd`. An extent a tier hands out is valid until it
    closes the file (close()): reading it after that raises, never reads a file that took the
    descriptor's number."""

    def __init__(self, fd: int, offset: int, size: int) -> None:
        self.fd, self.offset, self.size = fd, offset, size

    def close(self) -> None:
        self.fd = -1

    def read(self) -> memoryview:
        return self.read_into(memoryview(bytearray(self.size)))

    def read_into(self, buffer: memoryview) -> memoryview:
        """The bytes, read into the first `size` bytes of `buffer`."""
        if self.fd < 0:
            raise ValueError("a chunk's file was read after its tier closed it")
        view, done = buffer[:self.size], 0
        while done < self.size:
            got = os.preadv(self.fd, [view[done:]], self.offset + done)
            if got == 0:
                raise KvctlError(f"a chunk file ended after {done} of its {self.size} bytes: it changed while kvctl "
                                 "read it", hint="an engine may have rewritten or evicted it; run the command again")
            done += got
        return view


class BufferRing:
    """`count` buffers taken in turn, each as large as the largest chunk it held: chunk n's buffer is
    overwritten by chunk n + count."""

    def __init__(self, count: int) -> None:
        self.buffers = [bytearray() for _ in range(count)]

    def __len__(self) -> int:
        return len(self.buffers)

    def slot(self, number: int, size: int) -> memoryview:
        index = number % len(self.buffers)
        if len(self.buffers[index]) < size:  # a new one: a view of the old may still be held
            self.buffers[index] = bytearray(size)
        return memoryview(self.buffers[index])[:size]
