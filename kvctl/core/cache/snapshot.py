"""Snapshots: a warm cache moved between nodes as one self-describing file.

A snapshot is an uncompressed POSIX tar (any `tar tf` lists it): one member per chunk
(`chunks/NNNNNN`, LMCache's own data bytes) and `manifest.json` last, written once every checksum is
known. The manifest says what makes the keys (model, KV dtype, world size, chunk size, hash algorithm,
hash seed), the versions, each chunk's key, size, BLAKE3 checksum and LMCache metadata header (where
the source tier keeps one), and the token ids of each saved prompt. BLAKE3 (LMCache's own dependency)
is cryptographic and hashes at twice SHA-256's speed here, which is what keeps a save or load near
the speed of copying the bytes.

Saving reads the chunks through the instance (a live engine's routes, or a configuration's disk
directory and Redis) into a temporary file that becomes the snapshot only when complete. Loading
refuses a target that would make other keys, writes through the instance only what matched its
checksum (every checksum first, or, where the instance stages its writes as a disk directory does,
while it writes, made visible only once all matched) and reports per prompt what is now cached.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import struct
import tarfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvctl.core.errors import ExitCode, KvctlError, UsageError
from kvctl.core.instance.protocol import StoredChunk

FORMAT = "kvctl-snapshot"
VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # ~50,000 chunks (about 300 bytes each); parsed, it takes about 5 times this
BLOCK = tarfile.BLOCKSIZE
KEY_FIELDS = ("model", "kv_dtype", "world_size", "chunk_size", "hash_algorithm", "hash_seed")
KEY_FORMAT = "key_format"  # in the manifest's source: which kind of key the chunks are stored under
KEY_FORMATS = {  # an instance's `key_format` -> one key of it, for messages (a manifest without one: "chunk")
    "chunk": "an LMCache chunk key",  # in process: model@world_size@worker@hash@dtype
    "mp-object": "an MP object key",  # an LMCache MP server's: model@kv_rank@group@hash[@salt]
}
CHECKSUM = re.compile(r"[0-9a-f]{64}").fullmatch  # a BLAKE3 digest, hex
VERIFYING_THREADS = 2  # blake3 lets go of the GIL: a load checks chunks on both cores (ahead of staged writes)
IN_FLIGHT = 16  # chunks held in memory while their checksums are computed
LS_HINT = "kvctl snapshot ls FILE shows what it holds and what made its keys"
_OVER_CAP = f"more than the {MAX_MANIFEST_BYTES >> 20} MiB kvctl loads"
# LMCache's RemoteMetadata header (lmcache/v1/protocol.py): native int32s length, fmt, then per group a dtype
# code (DTYPE_TO_INT, here as LMCache's key spelling) and a shape zero-padded to 4-D
HEADER_DTYPES = {1: "half", 2: "half", 3: "bfloat16", 4: "float", 5: "double", 6: "uint8", 7: "fp8_e4m3fn",
                 8: "fp8_e5m2"}
ITEM_BYTES = {"half": 2, "bfloat16": 2, "float": 4, "double": 8, "uint8": 1, "fp8_e4m3fn": 1, "fp8_e5m2": 1}
MEMORY_FORMATS = range(9)  # MemoryFormat: UNDEFINED=0 … HS_TD=8
FACT_LABELS = {"model": "model", "world_size": "world size", "kv_dtype": "KV dtype"}


@dataclass
class SavedPrompt:
    source: str  # the file as the user named it
    tokens: list[int]
    keys: list[str]  # its chunk keys, every rank's
    saved: int = 0  # of those, how many the snapshot holds

    def as_dict(self, with_tokens: bool = False) -> dict[str, Any]:
        shown = {"source": self.source, "tokens": len(self.tokens), "chunks": len(self.keys), "saved": self.saved}
        return {**shown, "token_ids": self.tokens, "keys": self.keys} if with_tokens else shown


@dataclass(frozen=True)
class ChunkEntry:
    key: str
    member: str
    size: int
    blake3: str
    metadata: str | None  # hex of LMCache's RemoteMetadata header, where the source tier kept one


@dataclass
class Manifest:
    keys: dict[str, Any]  # KEY_FIELDS: what made the chunk keys (None: the source did not say)
    versions: dict[str, str | None]
    source: dict[str, str]
    created: float
    prompts: list[SavedPrompt] = field(default_factory=list)
    chunks: list[ChunkEntry] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # selected keys no tier held when saving

    @property
    def total_bytes(self) -> int:
        return sum(chunk.size for chunk in self.chunks)

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "created": self.created, "source": self.source,
                "versions": self.versions, "keys": self.keys,
                "prompts": [prompt.as_dict(with_tokens=True) for prompt in self.prompts],
                "chunks": [asdict(chunk) for chunk in self.chunks], "missing": self.missing}

    def summary(self) -> dict[str, Any]:
        """What `snapshot ls` shows: everything but the token ids and per-chunk entries."""
        return {"created": self.created, "source": self.source, "versions": self.versions, "keys": self.keys,
                "chunks": len(self.chunks), "bytes": self.total_bytes, "missing": len(self.missing),
                "prompts": [prompt.as_dict() for prompt in self.prompts]}


# -- saving --------------------------------------------------------------------------------------


@dataclass
class SaveReport:
    path: str
    manifest: Manifest

    @property
    def exit_code(self) -> int:
        return ExitCode.PARTIAL if self.manifest.missing else ExitCode.OK

    def as_dict(self) -> dict[str, Any]:
        return {"snapshot": self.path, "chunks": len(self.manifest.chunks), "bytes": self.manifest.total_bytes,
                "missing": len(self.manifest.missing), "prompts": [p.as_dict() for p in self.manifest.prompts]}


def parses(form: str):
    """The parser of keys of a format: None for what is no key of it."""
    from kvctl.core.lmcache.keys import parse_key, parse_object_key

    return {"chunk": parse_key, "mp-object": parse_object_key}[form]


def select_prompts(instance, sources: Sequence[tuple[str, Any]], model: str | None) -> list[SavedPrompt]:
    """Each (label, PromptSource) tokenized and keyed as the instance would."""
    prompts = []
    for label, source in sources:
        tokens = instance.tokenize(source, model)
        prompts.append(SavedPrompt(label, tokens, instance.prompt_keys(tokens, model)))
    return prompts


def tier_keys(instance, tier: str, model: str | None) -> list[str]:
    """Every chunk key one tier holds that the instance makes: of `model` (else the model it serves), its
    world size and KV dtype. A snapshot is of one model: other chunks sharing the tier (another
    deployment's on a shared Redis) would be keys its manifest does not describe."""
    facts = instance.key_facts(model)
    if facts.model is None:
        raise UsageError(f"{instance.name} does not say which model it serves: a whole tier's snapshot is of one",
                         hint="name it: --model NAME")
    listing = instance.list([tier], facts.model, 2**31 - 1)
    if listing.errors:
        tier_name, why = next(iter(listing.errors.items()))
        raise KvctlError(f"cannot list the {tier_name} tier: {why}", hint="check the tier (kvctl health) and retry")
    keys = [chunk.key for listed in listing.tiers for chunk in listed.chunks]
    made = {name: getattr(facts, name) for name in KEY_FIELDS}
    return [key for key in keys if key_disagreement(key, made, instance.key_format) is None]


def save(instance, out: Path, prompts: list[SavedPrompt], keys: Sequence[str] = (), model: str | None = None,
         overwrite: bool = False) -> SaveReport:
    """Write the prompts' chunks (and `keys`) that some tier holds into `out`, atomically: a temporary
    file next to it becomes the snapshot only once complete, so a failure leaves no half file. It is
    created 0600 (it holds the prompts' token ids), and the rename keeps that over any file it replaces."""
    from kvctl import __version__
    from kvctl.core.common.safe_files import require_regular

    out = Path(out)
    if out.exists():
        require_regular(out, hint="write the snapshot to a file: -o NAME.kvsnap")
        if not overwrite:
            raise UsageError(f"{out} exists", hint="choose another -o, or add --force to replace it")
    wanted = list(dict.fromkeys([key for prompt in prompts for key in prompt.keys] + list(keys)))
    if not wanted:
        raise UsageError("nothing selected to save", hint="give --prompt-file, --pin-set, or --tier T --all")
    facts = instance.key_facts(model)
    manifest = Manifest({name: getattr(facts, name) for name in KEY_FIELDS},
                        {"kvctl": __version__, "lmcache": facts.lmcache_version},
                        {"instance": instance.name, "kind": instance.kind, KEY_FORMAT: instance.key_format},
                        time.time(), prompts)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as sink, ThreadPoolExecutor(1) as hashing:  # the other core copies
            pending: deque = deque()
            for number, chunk in enumerate(instance.read_chunks(wanted)):
                member = f"chunks/{number:06d}"
                size = memoryview(chunk.data).nbytes
                pending.append((chunk, member, size, hashing.submit(checksum, chunk.data)))
                sink.write(_member_header(member, size))
                sink.write(chunk.data)
                sink.write(bytes(-size % BLOCK))
                while pending and (len(pending) > IN_FLIGHT or pending[0][3].done()):
                    manifest.chunks.append(_entry(*pending.popleft()))
            manifest.chunks.extend(_entry(*waiting) for waiting in pending)
            saved = {chunk.key for chunk in manifest.chunks}
            if not saved:
                raise KvctlError(f"none of the {len(wanted)} selected chunks is cached on {instance.name}",
                                 hint="prewarm the prompt first (kvctl prewarm), then save")
            _refuse_strangers(manifest, lambda why: KvctlError(
                f"{instance.name} holds a chunk its key facts do not describe: {why}",
                hint="save one model at a time (--model NAME) from an instance serving it"))
            manifest.missing = [key for key in wanted if key not in saved]
            for prompt in prompts:
                prompt.saved = sum(key in saved for key in prompt.keys)
            body = json.dumps(manifest.as_dict(), separators=(",", ":")).encode()
            if len(body) > MAX_MANIFEST_BYTES:  # a snapshot no kvctl would load
                raise KvctlError(f"the snapshot's manifest would be {len(body)} bytes, {_OVER_CAP}",
                                 hint="save fewer chunks into each snapshot (fewer prompts, or one tier at a time)")
            sink.write(_member_header(MANIFEST, len(body)) + body + bytes(-len(body) % BLOCK) + bytes(2 * BLOCK))
        os.replace(temporary, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return SaveReport(str(out), manifest)


def checksum(data: bytes | memoryview) -> str:
    from blake3 import blake3

    return blake3(data).hexdigest()


def _entry(chunk: StoredChunk, member: str, size: int, digest) -> ChunkEntry:
    return ChunkEntry(chunk.key, member, size, digest.result(), chunk.metadata.hex() if chunk.metadata else None)


def _member_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, int(time.time())
    return info.tobuf(tarfile.USTAR_FORMAT)


# -- reading -------------------------------------------------------------------------------------


class Snapshot:
    """An open snapshot: its manifest, and its chunks' bytes as views into the mapped file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = None
        self._map: mmap.mmap | None = None
        self.manifest, self._extents = self._read()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: the map goes with it
                self._map.close()
        if self._file is not None:
            self._file.close()

    def bad(self, why: str) -> KvctlError:
        return KvctlError(f"{self.path} is not a usable snapshot: {why}",
                          hint="save it again (kvctl snapshot save); nothing was written")

    def _read(self) -> tuple[Manifest, dict[str, tuple[int, int]]]:
        from kvctl.core.common.safe_files import require_regular

        if not self.path.exists():
            raise UsageError(f"no snapshot at {self.path}", hint="give the .kvsnap file kvctl snapshot save wrote")
        require_regular(self.path, hint="give the .kvsnap file kvctl snapshot save wrote")
        size = self.path.stat().st_size
        extents: dict[str, tuple[int, int]] = {}
        try:
            with tarfile.open(self.path, "r:") as archive:
                for member in archive:
                    if member.offset_data + member.size > size:
                        raise self.bad(f"{member.name} is cut short (the file is truncated)")
                    if member.isfile():
                        extents[member.name] = (member.offset_data, member.size)
        except (tarfile.TarError, OSError) as error:
            raise self.bad(f"not a readable tar file ({error})") from None
        if MANIFEST not in extents:
            raise self.bad("it has no manifest.json (cut short while saving, or not a snapshot)")
        manifest_end = sum(extents[MANIFEST]) + -extents[MANIFEST][1] % BLOCK
        if size < manifest_end + 2 * BLOCK:
            raise self.bad("it ends without tar's end-of-archive marker (the file is truncated)")
        offset, length = extents[MANIFEST]
        if length > MAX_MANIFEST_BYTES:
            raise self.bad(f"its manifest is {length} bytes, {_OVER_CAP}")
        self._file = open(self.path, "rb")  # noqa: SIM115 - held open for the mapped views
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        try:
            data = json.loads(self._map[offset:offset + length])
        except ValueError:
            raise self.bad("its manifest is not JSON") from None
        except RecursionError:
            raise self.bad("its manifest nests deeper than Python parses") from None
        return parse_manifest(data, extents, self.bad), extents

    def view(self, entry: ChunkEntry) -> memoryview:
        offset, size = self._extents[entry.member]
        return memoryview(self._map)[offset:offset + size]

    def verified_chunks(self) -> Iterator[StoredChunk]:
        """The chunks in order, each yielded once its checksum matched the manifest's (computed ahead on
        other threads); the first that does not raises, and none after it is yielded."""
        def digest(entry: ChunkEntry) -> tuple[ChunkEntry, str]:
            return entry, checksum(self.view(entry))

        with ThreadPoolExecutor(VERIFYING_THREADS) as pool:
            for entry, found in pool.map(digest, self.manifest.chunks):
                if found != entry.blake3:
                    raise self.bad(f"the checksum of chunk {entry.key} does not match (the file was changed)")
                metadata = bytes.fromhex(entry.metadata) if entry.metadata else None
                yield StoredChunk(entry.key, self.view(entry), metadata)


def parse_manifest(data: Any, extents: dict[str, tuple[int, int]], bad) -> Manifest:
    """The manifest, every field checked: a hostile file gets one line, never a traceback."""
    def need(condition: bool, why: str) -> None:
        if not condition:
            raise bad(why)

    need(isinstance(data, dict) and data.get("format") == FORMAT, "its manifest is not a kvctl snapshot's")
    need(data.get("version") == VERSION, f"it is format version {data.get('version')!r}; this kvctl reads "
         f"version {VERSION}")
    keys, versions, source = data.get("keys"), data.get("versions"), data.get("source")
    need(isinstance(keys, dict) and set(KEY_FIELDS) <= set(keys), "its manifest does not say what made its keys")
    need(isinstance(versions, dict) and isinstance(source, dict), "its manifest has no versions or source")
    need(all(isinstance(value, (str, int, float, bool, type(None))) for part in (keys, versions, source)
             for value in part.values()), "its manifest's keys, versions or source hold other than plain values")
    need(isinstance(data.get("created"), (int, float)), "its manifest has no creation time")
    form = source.get(KEY_FORMAT, "chunk")
    need(form in KEY_FORMATS, f"its keys are of format {str(form)[:40]!r}, which this kvctl does not know")
    parse_key = parses(form)
    chunks, seen = [], set()
    for raw in data.get("chunks") if isinstance(data.get("chunks"), list) else [None]:
        need(isinstance(raw, dict), "a chunk entry is not a mapping")
        try:
            entry = ChunkEntry(**raw)
        except TypeError:
            raise bad("a chunk entry has unknown or missing fields") from None
        need(isinstance(entry.key, str) and parse_key(entry.key) is not None and entry.key not in seen,
             f"chunk key {str(entry.key)[:80]!r} is not {KEY_FORMATS[form]}, or repeats")
        need(isinstance(entry.blake3, str) and CHECKSUM(entry.blake3) is not None, f"chunk {entry.key} has no checksum")
        need(isinstance(entry.member, str) and entry.member in extents and extents[entry.member][1] == entry.size,
             f"chunk {entry.key}'s data is missing or of the wrong size (the file is truncated or changed)")
        need(entry.metadata is None or (isinstance(entry.metadata, str) and _is_hex(entry.metadata)),
             f"chunk {entry.key}'s metadata is not hex")
        seen.add(entry.key)
        chunks.append(entry)
    prompts = []
    for raw in data.get("prompts") if isinstance(data.get("prompts"), list) else [None]:
        need(isinstance(raw, dict) and isinstance(raw.get("source"), str)
             and _ints(raw.get("token_ids")) and isinstance(raw.get("keys"), list)
             and all(isinstance(key, str) for key in raw["keys"]), "a prompt entry is malformed")
        prompts.append(SavedPrompt(raw["source"], raw["token_ids"], raw["keys"], sum(k in seen for k in raw["keys"])))
    missing = data.get("missing")
    need(isinstance(missing, list), "its manifest has no list of missing chunks")
    return Manifest(keys, versions, source, data["created"], prompts, chunks, missing)


def key_disagreement(key: str, facts: dict[str, Any], form: str) -> str | None:
    """How a chunk key (of format `form`) differs from what made the snapshot's keys: its model, world
    size, rank within it or KV dtype (in-process keys only: no MP key names one); None when it agrees.
    A fact that is None (the source did not say) is not compared; an in-process key of world size 1 is
    one an engine of any world size makes where it saves the first rank's chunks only (MLA)."""
    parsed = parses(form)(key)
    if form == "chunk":
        found = {"model": parsed.model_name, "world_size": parsed.world_size, "kv_dtype": parsed.kv_dtype}
        rank = parsed.worker_id
    else:
        found = {"model": parsed.model_name, "world_size": parsed.kv_rank >> 24}
        rank = (parsed.kv_rank >> 16) & 0xFF
    expected = {name: facts.get(name) for name in found}
    if form == "chunk" and parsed.world_size == 1:
        expected["world_size"] = None
    if expected.get("kv_dtype") is not None:
        expected["kv_dtype"] = _key_dtype(str(expected["kv_dtype"]))
    for name, value in found.items():
        if expected[name] is not None and str(value) != str(expected[name]):
            return f"chunk {key} is keyed for {FACT_LABELS[name]} {value}, not {expected[name]}"
    if rank >= found["world_size"]:
        return f"chunk {key} is keyed for rank {rank} of a world of size {found['world_size']}"
    return None


def chunk_disagreement(entry: ChunkEntry, facts: dict[str, Any], form: str) -> str | None:
    """key_disagreement, then the chunk's metadata header: MP objects carry none; an in-process chunk's,
    where kept, must be LMCache's RemoteMetadata for exactly the chunk's bytes in its key's dtype (what
    LMCache reads back from a Redis tier is sized by the header, not by the bytes)."""
    why = key_disagreement(entry.key, facts, form)
    if why or entry.metadata is None:
        return why
    if form != "chunk":
        return f"chunk {entry.key} carries a metadata header; MP objects have none"
    header = _header_facts(bytes.fromhex(entry.metadata))
    if header is None:
        return f"chunk {entry.key}'s metadata header is not LMCache's (length, format, dtype and shape per group)"
    length, dtypes, shaped = header
    if length != entry.size or shaped != entry.size:
        return (f"chunk {entry.key} is {entry.size} bytes; its metadata header says {length} bytes of shapes "
                f"holding {shaped}")
    dtype = parses(form)(entry.key).kv_dtype
    if any(found != dtype for found in dtypes):
        return f"chunk {entry.key}'s metadata header says KV dtype {'+'.join(dtypes)}; its key says {dtype}"
    return None


def _refuse_strangers(manifest: Manifest, error) -> None:
    """error(why) for the first chunk the manifest's own key facts do not describe."""
    form = manifest.source.get(KEY_FORMAT, "chunk")
    for entry in manifest.chunks:
        why = chunk_disagreement(entry, manifest.keys, form)
        if why:
            raise error(why)


def _key_dtype(name: str) -> str:
    """A dtype as in-process keys spell it (`torch.float16` and `float16` read `half`)."""
    from kvctl.core.lmcache.keys import DTYPE_NAMES

    bare = name.removeprefix("torch.")
    return DTYPE_NAMES.get(bare, bare)


def _header_facts(header: bytes) -> tuple[int, list[str], int] | None:
    """(length, dtype per group, bytes its shapes hold) of a RemoteMetadata header; None for what is none."""
    if len(header) < 28 or (len(header) - 8) % 20:
        return None
    length, fmt, *groups = struct.unpack(f"={len(header) // 4}i", header)
    if fmt not in MEMORY_FORMATS:
        return None
    dtypes, shaped = [], 0
    for start in range(0, len(groups), 5):
        code, *dims = groups[start:start + 5]
        if code not in HEADER_DTYPES or any(dim < 0 for dim in dims):
            return None
        dims = dims[:dims.index(0)] if 0 in dims else dims  # the zero padding to 4-D
        dtypes.append(HEADER_DTYPES[code])
        shaped += math.prod(dims) * ITEM_BYTES[HEADER_DTYPES[code]]
    return length, dtypes, shaped


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


# -- loading -------------------------------------------------------------------------------------


@dataclass
class LoadedPrompt:
    source: str
    tokens: int
    chunks: int
    cached: int  # chunks the target now holds on some tier
    hit_tokens: int  # what a request for the prompt would be served from the cache

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadReport:
    path: str
    instance: str
    tier: str | None
    chunks: int
    bytes: int
    written: dict[str, int]  # per tier
    already: dict[str, int]  # per tier: chunks it held before, left as they were
    dropped: dict[str, int]  # per tier: chunks it did not keep (a full disk tier, a failed remote write)
    prompts: list[LoadedPrompt]

    def as_dict(self) -> dict[str, Any]:
        return {"snapshot": self.path, "instance": self.instance, "tier": self.tier, "chunks": self.chunks,
                "bytes": self.bytes, "written": self.written, "already": self.already, "dropped": self.dropped,
                "prompts": [p.as_dict() for p in self.prompts]}


def check_compatible(snapshot: Snapshot, instance, model: str | None) -> None:
    """Refuse a target that would make other keys: by what made the keys, then (what settles it) by the
    keys the target itself makes for each saved prompt."""
    from kvctl.core.diagnose.doctor import key_differences
    from kvctl.core.lmcache.key_facts import KEY_FIELDS as LABELS
    from kvctl.core.lmcache.key_facts import KeyFacts

    manifest = snapshot.manifest
    saved = KeyFacts(**{name: manifest.keys[name] for name in KEY_FIELDS})
    facts = instance.key_facts(model)  # first: an instance that cannot take snapshots at all says so
    _refuse_strangers(manifest, lambda why: snapshot.bad(f"its manifest's key facts do not describe it: {why}"))
    theirs, mine = manifest.source.get(KEY_FORMAT, "chunk"), instance.key_format
    if theirs != mine:
        raise UsageError(f"each chunk of {snapshot.path} is keyed by {KEY_FORMATS[theirs]}; {instance.name} "
                         f"({instance.kind}) keys chunks by {KEY_FORMATS[mine]}: they cannot be loaded there",
                         hint=f"load it into an instance of the kind it was saved from "
                         f"({manifest.source.get('kind', 'see its source')}); {LS_HINT}")
    found = key_differences(saved, facts, KEY_FIELDS)
    if found:
        name, mine, theirs = found[0]
        label, hint = LABELS[name]
        raise UsageError(f"{snapshot.path} was saved with {label} {mine}; {instance.name} makes keys with {theirs}: "
                         "its chunks would never be hit there", hint=hint)
    for prompt in manifest.prompts:
        made = instance.prompt_keys(prompt.tokens, model)
        if made != prompt.keys:
            raise UsageError(f"{instance.name} makes other chunk keys for {prompt.source} than {snapshot.path} holds "
                             "(model name, hashing or seed differ): its chunks would never be hit there",
                             hint=f"serve the same --model with the same LMCache settings; {LS_HINT}")


def load(path: Path, instance, tier: str | None = None, model: str | None = None) -> LoadReport:
    """Check, verify, then write the snapshot's chunks; nothing becomes visible unless every check passes."""
    with Snapshot(path) as snapshot:
        check_compatible(snapshot, instance, model)
        manifest = snapshot.manifest
        chunks = snapshot.verified_chunks()
        if not instance.stages_writes(tier):
            chunks = list(chunks)  # every checksum checked before the first chunk leaves
        written = instance.write_chunks(chunks, tier)
    if instance.settle_s and manifest.prompts:
        time.sleep(instance.settle_s)
    prompts = []
    for prompt in manifest.prompts:
        result = instance.lookup(prompt.tokens, model)
        prompts.append(LoadedPrompt(prompt.source, len(prompt.tokens), len(result.chunks),
                                    sum(bool(chunk.tiers) for chunk in result.chunks),
                                    int(result.hit_tokens.get("total", 0))))
    return LoadReport(str(path), instance.name, tier, len(manifest.chunks), manifest.total_bytes, written["written"],
                      written["already"], written.get("dropped", {}), prompts)


# -- copying between live instances ---------------------------------------------------------------


@dataclass
class CopyReport:
    """A copy from one live instance to another: what was saved, what the target took, and how many of
    the chunks the target then gave back byte for byte (BLAKE3 against the source's)."""

    source: str
    saved: SaveReport
    loaded: LoadReport
    mismatched: list[str]  # keys the target does not give back as the source had them

    @property
    def exit_code(self) -> int:
        whole = not (self.saved.manifest.missing or self.mismatched or any(self.loaded.dropped.values()))
        return ExitCode.OK if whole else ExitCode.PARTIAL

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.loaded.instance, "tier": self.loaded.tier,
                "chunks": self.loaded.chunks, "bytes": self.loaded.bytes,
                "missing": len(self.saved.manifest.missing), "written": self.loaded.written,
                "already": self.loaded.already, "dropped": self.loaded.dropped,
                "verified": self.loaded.chunks - len(self.mismatched), "mismatched": self.mismatched,
                "prompts": [prompt.as_dict() for prompt in self.loaded.prompts]}


def copy(source, target, prompts: list[SavedPrompt], model: str | None = None, tier: str | None = None) -> CopyReport:
    """A warm prompt moved between live instances by kvctl's verified path, never LMCache's unverified
    /move: read from the source (its own routes or stores) and checksummed, written through the target
    (which first refuses other keys and checks every checksum, as any load), then read back from the
    target and compared chunk by chunk. The bytes pass through a private temporary snapshot (a 0700
    directory, removed afterwards)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvctl-copy-") as directory:
        path = Path(directory) / "copy.kvsnap"
        saved = save(source, path, prompts, (), model)
        loaded = load(path, target, tier, model)
    expected = {entry.key: entry.blake3 for entry in saved.manifest.chunks}
    given_back = {chunk.key: checksum(chunk.data) for chunk in target.read_chunks(list(expected))}
    return CopyReport(source.name, saved, loaded, [key for key, digest in expected.items()
                                                   if given_back.get(key) != digest])


def listing(path: Path) -> dict[str, Any]:
    with Snapshot(path) as snapshot:
        return {"snapshot": str(path), **snapshot.manifest.summary()}
