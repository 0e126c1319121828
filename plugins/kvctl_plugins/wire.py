"""The contract between kvctl and its routes (routes.py, mp_routes.py), in one place both sides import.

Standard library only, and nothing at all at import time: kvctl's client imports this module, and
`kvctl --help` must stay fast (protocol.py, which imports starlette, is for the servers).

* where the routes live (PREFIX), their largest page (MAX_PAGE), the environment variables that hold
  their bearer token or name its file (TOKEN_VARIABLE, TOKEN_FILE_VARIABLE), and the probes of
  LMCache's that stay open without it (OPEN_PROBES);
* the body of a refusal: {ERROR_CODE: "not_found", ERROR_MESSAGE: "no pin 'x'"};
* the tier names the routes answer with, in LMCache's lookup order, and LMCache's hit rule over
  them (StorageManager.batched_contains): each tier in order serves a prefix of what is still missing;
* how chunk bytes travel (snapshots): a body of frames, each a 4-byte big-endian header length, a
  JSON header {"key", "size", "metadata"} and `size` bytes of LMCache's chunk data. `metadata` is the
  hex of LMCache's RemoteMetadata header (shape, dtype, format) where the sender knows it, else null.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence

PREFIX = "/kvctl/v1"
MAX_PAGE = 10_000  # the most keys one GET {PREFIX}/keys answers (in-process and MP routes alike)
TOKEN_VARIABLE = "KVCTL_ROUTES_TOKEN"  # the token itself, where a deployment's environment carries it
TOKEN_FILE_VARIABLE = "KVCTL_ROUTES_TOKEN_FILE"  # a 0600 file holding it (`kvctl config init` writes one)
# LMCache's own routes a server bound beyond loopback still answers without the token: read-only probes
# that reveal no prompt, secret or setting (monitoring scrapes them); everything else needs the token there
OPEN_PROBES = frozenset({"/metrics", "/lmc_version", "/version", "/commit_id", "/periodic-threads-health"})

ERROR_CODE = "error"  # a refusal's machine-readable code: bad_request, not_found, unauthorized, ...
ERROR_MESSAGE = "message"  # what a person reads
BUSY = "busy"  # the code of a 503 for a request refused while the server serves its most at once: retry later

# kvctl's tier names in LMCache's lookup order (LocalCPUBackend, LocalDiskBackend, a RemoteBackend on
# Redis). An engine's routes answer its own backends' order, which may name "remote" or a backend.
TIER_ORDER = ("cpu", "disk", "redis")
# An MP object key's chunk hash: 8-byte integer hashes (builtin), 16-byte (xxhash), 32-byte (sha256, blake3)
MP_HASH_BYTES = (8, 16, 32)


FRAME_LENGTH = struct.Struct(">I")
MAX_FRAME_HEADER = 8192  # a chunk key is at most a few hundred bytes
MAX_CHUNKS_BODY = 256 * 1024 * 1024  # the most chunk bytes one request or answer carries
FRAMES_TYPE = "application/octet-stream"  # the media type of a body of frames, asked and answered
NEXT_HEADER = "X-Kvctl-Next"  # a cut-short chunks/read answer: the index of the first key to ask for again


def frame_header(key: str, size: int, metadata: bytes | None) -> bytes:
    """What precedes a chunk's `size` bytes of data in a body of frames."""
    header = json.dumps({"key": key, "size": size, "metadata": metadata.hex() if metadata else None},
                        separators=(",", ":")).encode()
    return FRAME_LENGTH.pack(len(header)) + header


def read_frames(body: bytes | bytearray | memoryview) -> Iterator[tuple[str, memoryview, bytes | None]]:
    """(key, data, metadata) of each frame, data a view into `body`; ValueError on anything malformed."""
    view = memoryview(body)
    offset = 0
    while offset < len(view):
        if offset + FRAME_LENGTH.size > len(view):
            raise ValueError(f"a frame at byte {offset} is cut short")
        (length,) = FRAME_LENGTH.unpack_from(view, offset)
        offset += FRAME_LENGTH.size
        if length > MAX_FRAME_HEADER or offset + length > len(view):
            raise ValueError(f"a frame header at byte {offset} is {length} bytes: malformed or cut short")
        try:
            header = json.loads(bytes(view[offset:offset + length]))
            key, size, metadata = header["key"], header["size"], header["metadata"]
            metadata = None if metadata is None else bytes.fromhex(metadata)
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: `[` nested past the stack
            raise ValueError(f"a frame header at byte {offset} is not {{key, size, metadata}}") from None
        if not isinstance(key, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"a frame header at byte {offset} has a bad key or size")
        offset += length
        if offset + size > len(view):
            raise ValueError(f"the data of {key!r} is cut short")
        yield key, view[offset:offset + size], metadata
        offset += size


def error_body(code: str, message: str) -> dict[str, str]:
    """What a route answers when it refuses a request (with a 4xx) or fails (with a 5xx)."""
    return {ERROR_CODE: code, ERROR_MESSAGE: message}


def prefix_chunks(flags: Sequence[bool]) -> int:
    """How many chunks from the first one are present: what one tier alone serves."""
    count = 0
    while count < len(flags) and flags[count]:
        count += 1
    return count


def lmcache_hit_chunks(presence: Mapping[str, Sequence[bool]], order: Sequence[str] = TIER_ORDER) -> int:
    """StorageManager.batched_contains: each tier in order serves a prefix of what is still missing.
    `presence` maps a tier to its per-chunk flags; tiers missing from it serve nothing, tiers missing
    from `order` are not asked."""
    total = 0
    for tier in order:
        flags = presence.get(tier)
        if flags is None:
            continue
        while total < len(flags) and flags[total]:
            total += 1
    return total


def hit_tokens(presence: Mapping[str, Sequence[bool]], sizes: Sequence[int],
               order: Sequence[str] = TIER_ORDER) -> dict[str, int]:
    """Tokens served per tier of `order` on its own (0 for a tier not in `presence`), and "total": what
    LMCache serves walking the tiers in that order. `sizes` are the chunks' token counts."""
    hits = {tier: sum(sizes[:prefix_chunks(presence[tier])]) if tier in presence else 0 for tier in order}
    hits["total"] = sum(sizes[:lmcache_hit_chunks(presence, order)])
    return hits
