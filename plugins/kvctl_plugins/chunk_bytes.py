"""Chunk bytes in and out of a live LMCacheEngine (kvctl snapshots): read each chunk from the first
tier that holds it without changing what LMCache keeps, and write checked frames into chosen tiers
through LMCache's own allocator and puts, so its index and accounting stay exact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from kvctl_plugins import protocol, wire
from kvctl_plugins.disk_index import chunk_tokens, token_bytes
from kvctl_plugins.engine_ops import backends, select_backends
from kvctl_plugins.protocol import BadRequest

SETTLE_S = 30.0  # how long a write waits for the disk and remote tiers' asynchronous puts to land


def read_chunks(engine, texts: Any, tiers: list[str] | None) -> tuple[Iterator[bytes], int | None]:
    """The frames (wire.py) of those of the named keys a selected tier holds, in the order asked, each from
    the first tier in lookup order that holds it, as an iterator that reads one chunk at a time; and the
    index into `texts` of the first key left out because its chunk would take the answer over
    wire.MAX_CHUNKS_BODY (None: all were answered; the first chunk always goes, so a client that asks again
    from there gets on).

    What goes is settled before a byte is read, from the sizes the tiers know without copying (the CPU
    tier's objects, the disk tier's index; a whole chunk for any other tier, which cannot say), so the
    answer streams instead of being built whole in the worker's memory; a chunk gone by the time its turn
    comes is simply not held. Reading changes nothing LMCache keeps: no pin, no write-back into the CPU tier
    (which StorageManager.get adds for a disk or remote hit), no move in the disk tier's LRU order."""
    names = protocol.strings(texts, "keys", protocol.MAX_KEYS)
    chosen = select_backends(engine, tiers)
    planned: dict[str, Any] = {}
    total, next_index = 0, None
    for index, name in enumerate(names):
        if name in planned:
            continue
        key = _chunk_key(name)
        size = _held_size(engine, chosen, key)
        if size is None:
            continue
        if planned and total + size > wire.MAX_CHUNKS_BODY:
            next_index = index
            break
        planned[name] = key
        total += size
    return _frames(engine, chosen, planned), next_index


def _held_size(engine, chosen: list[tuple[str, str, Any]], key) -> int | None:
    """The bytes of the chunk the first chosen tier that holds it keeps (at most, for a remote tier)."""
    for _, name, backend in chosen:
        if name == "LocalDiskBackend":
            with backend.disk_lock:
                entry = backend.dict.get(key)
            if entry is not None:
                return entry.shape.numel() * entry.dtype.itemsize
        elif name == "LocalCPUBackend":
            memory_obj = backend.get_blocking(key)  # a reference only: no LRU move
            if memory_obj is not None:
                try:
                    return memoryview(memory_obj.byte_array).nbytes
                finally:
                    memory_obj.ref_count_down()
        elif backend.contains(key, False):
            return token_bytes(engine.metadata, engine.config.chunk_size) * engine.config.chunk_size
    return None


def _frames(engine, chosen: list[tuple[str, str, Any]], planned: dict[str, Any]) -> Iterator[bytes]:
    for name, key in planned.items():
        found = _first_copy(engine, chosen, key)
        if found is not None:
            data, metadata = found
            yield wire.frame_header(name, len(data), metadata)
            yield data


def _chunk_key(text: str):
    """The CacheEngineKey a text names; it must be LMCache's own spelling of that key."""
    from lmcache.utils import CacheEngineKey

    try:
        key = CacheEngineKey.from_string(text)
    except Exception:  # noqa: BLE001 - any parse failure is the client's
        key = None
    if key is None or key.to_string() != text:
        raise BadRequest(f"not an LMCache chunk key: {text[:300]!r}")
    return key


def _first_copy(engine, chosen: list[tuple[str, str, Any]], key) -> tuple[bytes, bytes] | None:
    for _, name, backend in chosen:
        found = _read(engine, name, backend, key)
        if found is not None:
            return found
    return None


def _read(engine, name: str, backend, key) -> tuple[bytes, bytes] | None:
    """(data, RemoteMetadata header) of a chunk this backend holds. The CPU tier's get_blocking only
    takes a reference (no LRU move); a remote's allocates a CPU buffer for the copy (LMCache's
    allocate may evict CPU chunks to find one, as every remote read does). Either way the reference
    is given back here."""
    if name == "LocalDiskBackend":
        return _read_disk_file(engine, backend, key)
    memory_obj = backend.get_blocking(key)
    if memory_obj is None:
        return None
    try:
        data = bytes(memory_obj.byte_array)
        return data, remote_metadata(engine, len(data), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                     memory_obj.get_memory_format())
    finally:
        memory_obj.ref_count_down()


def _read_disk_file(engine, backend, key) -> tuple[bytes, bytes] | None:
    """The chunk's file, read directly. LocalDiskBackend.get_blocking would move the chunk to the LRU's
    recent end, stage it in a CPU buffer (evicting CPU chunks to make room) and raise KeyError when the
    file has gone; a file evicted or rewritten meanwhile is simply not held."""
    with backend.disk_lock:
        entry = backend.dict.get(key)
        if entry is None:
            return None
        path, shape, dtype, fmt = entry.path, entry.shape, entry.dtype, entry.fmt
    size = shape.numel() * dtype.itemsize
    try:
        with open(path, "rb") as file:
            data = file.read(size + 1)
    except FileNotFoundError:
        return None
    if len(data) != size:
        return None
    return data, remote_metadata(engine, size, [shape], [dtype], fmt)


def remote_metadata(engine, length: int, shapes, dtypes, fmt) -> bytes:
    """LMCache's RemoteMetadata header, exactly as its Redis connector stores it beside a chunk."""
    from lmcache.v1 import protocol as lmcache_protocol

    if lmcache_protocol.REMOTE_METADATA_FMT is None:  # set up by a remote connector, and this engine has none
        lmcache_protocol.init_remote_metadata_info(engine.metadata.get_num_groups())
    return lmcache_protocol.RemoteMetadata(length, list(shapes), list(dtypes), fmt).serialize()


def write_chunks(engine, raw: bytes, tiers: list[str] | None) -> dict[str, Any]:
    """Store a body of frames on the chosen tiers (default: the first that keeps chunks, the CPU tier).
    Every frame is checked before anything is written (_checked_frames). Per tier, a chunk the tier
    holds or is writing already is counted under "already"; the others are copied into memory objects
    from LMCache's allocator and handed to StorageManager.batched_put for that backend alone, which
    keeps the references the backend takes and drops ours. "written" counts what the tier then holds,
    once its asynchronous puts are done; "dropped" what it did not take (a full disk tier refuses)."""
    from lmcache.v1.memory_management import MemoryFormat

    manager = engine.storage_manager
    chosen = select_backends(engine, tiers) if tiers else [entry for entry in backends(engine)
                                                           if _keeps_chunks(entry[2], entry[1])][:1]
    if not chosen:
        raise BadRequest("this engine has no tier that keeps chunks")
    for tier, name, backend in chosen:
        if manager.is_backend_bypassed(name):
            raise BadRequest(f"the {tier} tier is bypassed (kvctl backends unbypass {tier})")
        if not _keeps_chunks(backend, name):
            raise BadRequest("the cpu tier keeps no chunks here (local_cpu is off or the hot cache is disabled)")
    fmt = MemoryFormat.KV_MLA_FMT if engine.metadata.use_mla else MemoryFormat.KV_2LTD
    chunks = _checked_frames(engine, raw, fmt)
    dtypes = engine.metadata.get_dtypes()
    result: dict[str, Any] = {"written": {}, "already": {}, "dropped": {}}
    for tier, name, backend in chosen:
        new = [chunk for chunk in chunks
               if not backend.exists_in_put_tasks(chunk[0]) and not backend.contains(chunk[0], False)]
        memory_objs = _filled(manager, new, dtypes, fmt)
        if new:
            manager.batched_put([key for key, _, _ in new], memory_objs, location=name)
        written = _landed(name, backend, [key for key, _, _ in new])
        result["written"][tier] = written
        result["already"][tier] = len(chunks) - len(new)
        result["dropped"][tier] = len(new) - written
    return result


def _keeps_chunks(backend, name: str) -> bool:
    return name != "LocalCPUBackend" or bool(getattr(backend, "use_hot", True))


def _checked_frames(engine, raw: bytes, fmt) -> list[tuple[Any, memoryview, list]]:
    """(key, data, shapes) of every frame; BadRequest naming the first one this engine cannot take: a
    malformed or cut-short body, a key of another engine (model, world size, worker id, KV dtype), a
    size that is no whole chunk of this engine, a metadata header other than the one this engine
    makes for that many tokens."""
    from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE

    config, metadata = engine.config, engine.metadata
    if getattr(config, "use_layerwise", False):
        raise BadRequest("this engine stores chunks layer by layer, under per-layer keys: chunk frames cannot be "
                         "loaded into it")
    frames = protocol.frames(raw)
    chunk_size, dtypes = config.chunk_size, metadata.get_dtypes()
    per_token = token_bytes(metadata, chunk_size)
    world_size = 1 if getattr(engine.token_database, "save_only_first_rank", False) else metadata.world_size
    ours = {"model": metadata.model_name, "world size": world_size, "worker id": metadata.worker_id,
            "KV dtype": TORCH_DTYPE_TO_STR_DTYPE[metadata.kv_dtype]}
    checked = []
    for text, data, header in frames:
        key = _chunk_key(text)
        theirs = {"model": key.model_name, "world size": key.world_size, "worker id": key.worker_id,
                  "KV dtype": TORCH_DTYPE_TO_STR_DTYPE[key.dtype]}
        for what, value in ours.items():
            if theirs[what] != value:
                raise BadRequest(f"{text!r} is a chunk of {what} {theirs[what]!r}; this engine's {what} is {value!r}")
        tokens = chunk_tokens(len(data), per_token, config)
        if tokens is None:
            raise BadRequest(f"{text!r} has {len(data)} bytes: not a chunk of this engine (a whole chunk is "
                             f"{per_token * chunk_size} bytes, {per_token} a token"
                             f"{'' if config.save_unfull_chunk else '; save_unfull_chunk is off'})")
        shapes = metadata.get_shapes(tokens)
        if header is not None and header != remote_metadata(engine, len(data), shapes, dtypes, fmt):
            raise BadRequest(f"the metadata of {text!r} ({_described(header)}) is not what this engine makes for "
                             f"{tokens} tokens ({_described(remote_metadata(engine, len(data), shapes, dtypes, fmt))})")
        checked.append((key, data, shapes))
    return checked


def _described(header: bytes) -> str:
    from lmcache.v1 import protocol as lmcache_protocol

    try:
        if len(header) != lmcache_protocol.get_remote_metadata_bytes():
            raise ValueError
        parsed = lmcache_protocol.RemoteMetadata.deserialize(header)
    except Exception:  # noqa: BLE001 - whatever it is, it is not a header of this engine
        return f"{len(header)} bytes that are no RemoteMetadata header here"
    shapes = ", ".join(str(list(shape)) for shape in parsed.shapes)
    dtypes = ", ".join(str(dtype).removeprefix("torch.") for dtype in parsed.dtypes)
    return f"length {parsed.length}, shape {shapes}, dtype {dtypes}, format {parsed.fmt.name}"


def _filled(manager, chunks: list[tuple[Any, memoryview, list]], dtypes, fmt) -> list[Any]:
    """A memory object from LMCache's allocator per chunk, holding its bytes (allocating may evict CPU
    chunks, as a store does; it never waits). NoRoom, with nothing kept, when LMCache has no room."""
    memory_objs: list[Any] = []
    try:
        for _key, data, shapes in chunks:
            memory_obj = manager.allocate(shapes, dtypes, fmt, busy_loop=False)
            if memory_obj is None:
                raise protocol.NoRoom(f"LMCache's CPU memory has no room for {len(chunks)} chunks at once "
                                      f"({sum(len(chunk[1]) for chunk in chunks)} bytes; what is pinned or in use "
                                      "cannot be evicted); send fewer per request")
            view = memory_obj.byte_array
            view = view.cast("B") if view.format != "B" else view
            memory_objs.append(memory_obj)
            view[:] = data
    except BaseException:
        for memory_obj in memory_objs:
            memory_obj.ref_count_down()
        raise
    return memory_objs


def _landed(name: str, backend, keys: list[Any]) -> int:
    """How many of `keys` the backend holds once its puts are done: the CPU tier's at once, the disk
    tier's when its writer leaves the put tasks (it indexes a file before that), a remote's when the
    remote has it, for at most SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    pending, landed = list(keys), 0
    while True:
        waiting = []
        for key in pending:
            in_flight = name != "LocalCPUBackend" and (name != "LocalDiskBackend" or backend.exists_in_put_tasks(key))
            if backend.contains(key, False):
                landed += 1
            elif in_flight:
                waiting.append(key)
        pending = waiting
        if not pending or time.monotonic() >= deadline:
            return landed
        time.sleep(0.05)
