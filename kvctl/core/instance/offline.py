"""A `kvctl config init` directory with no engine running: its stores read and written directly.

With no engine to ask, the stores the configuration names are read in LMCache's own layouts: the
in-process disk directory (`<key>.pt`) and Redis tier (`<key>kv_bytes` + `<key>metadata`), or the MP
server's fs (`<object key>.data`) and resp L2 adapters. Only names that parse as canonical chunk keys
count, so stray files and foreign Redis keys are never listed or removed. The CPU tier lives in an
engine's memory and pins in an engine or a coordinator: those need --instance.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kvctl.clients.disk_tier import DiskTier, partial_name, staging, stale_partials
from kvctl.core.cache.listing import (
    Listing,
    disk_chunks,
    list_stores,
    redis_chunk_names,
    redis_tier_keys,
    stored_redis_keys,
    unlink_chunks,
)
from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.instance.protocol import (
    EvictionPlan,
    NoManagement,
    Pin,
    PinList,
    Selection,
    StoredChunk,
    TierRemover,
    Unpinned,
    Unsupported,
    execute_plan,
    plan_store_eviction,
    store_remover,
)
from kvctl.core.lmcache.deployment import (
    DISK_SUFFIXES,
    Deployment,
    Store,
    Target,
    inprocess_stores,
    read_deployment,
    target_from_deployment,
)
from kvctl.core.lmcache.keys import (
    disk_file_name,
    given_chunk_keys,
    given_object_keys,
    parse_key,
    parse_object_key,
    prompt_chunk_keys,
)

if TYPE_CHECKING:
    from kvctl.core.cache.lookup import LookupResult
    from kvctl.core.lmcache.key_facts import KeyFacts
    from kvctl.core.lmcache.tokens import PromptSource

READ_BATCH = 64  # disk chunks read (and held in memory) at a time to pair with their Redis metadata
PROBE_TIMEOUT_S = 1.0  # a running engine answers on loopback at once; a stopped one refuses at once
CPU_HINT = "the CPU tier lives in a running engine: use --instance"
L1_HINT = "the MP server's L1 (cpu) lives in a running server: load through it with --instance URL"
NEEDS_ENGINE_HINT = "pins and prefetch need a running engine: pass --instance (a kvctl serve name or its URL)"


class DirectoryStore:
    """A disk tier's directories: LocalDiskBackend's `<key>.pt` files ("lmcache-disk", '/' in the model
    written as '-') or the fs L2 adapter's `<object key>.data` files ("mp-fs"). A chunk is the file
    its key names, in whichever directory holds it. `budget_bytes`: max_local_disk_size (the fs
    adapter declares none)."""

    def __init__(self, store: Store, budget_bytes: int | None = None) -> None:
        self.store, self.tier = store, store.tier
        self.budget_bytes = budget_bytes

    def file_name(self, key: str) -> str | None:
        """The file LMCache writes a chunk's data to; None for what is no chunk key."""
        if self.store.layout == "mp-fs":
            parsed = parse_object_key(key)
            return parsed.fs_file_name() if parsed else None
        return disk_file_name(key) if parse_key(key) else None

    def chunk_keys(self, model: str | None) -> list[str]:
        found = list(disk_chunks(self.store, model))
        if model and self.store.layout == "lmcache-disk":  # the model's own keys, not the file names' spelling
            mangled = model.replace("/", "-")
            return [model + key[len(mangled):] for key in found]
        return found

    def held(self, keys: Sequence[str]) -> list[str]:
        """Read afresh each time: a plan's execute() sees what is there by then."""
        names = self._file_names()
        return [key for key in keys if self.file_name(key) in names]

    def _file_names(self) -> set[str]:
        return self._files().names()  # a set of its own

    def _files(self) -> DiskTier:
        return DiskTier(self.store.directories, DISK_SUFFIXES[self.store.layout])

    def remove(self, keys: Sequence[str]) -> list[str]:
        """Unlink each chunk's file by its name (a symlink goes, never what it points to); a key counts
        as removed when a file of it really was."""
        gone = []
        for key in self.held(keys):
            removed = False
            for directory in self.store.directories:
                path = os.path.join(directory, self.file_name(key))
                try:
                    os.unlink(path)
                    removed = True
                except (FileNotFoundError, IsADirectoryError):
                    continue  # not in this directory, or a directory that merely looks like a chunk
                except OSError as error:
                    raise KvctlError(f"cannot remove {path}: {error.strerror}",
                                     hint="run kvctl as a user that can write the disk tier directory") from None
            if removed:
                gone.append(key)
        return gone

    # -- chunk bytes (snapshots; LMCache's disk layout: a file is the chunk's data alone) ------------

    def read(self, keys: Sequence[str]) -> Iterator[StoredChunk]:
        """The held chunks' bytes; a name that is not a regular file (a symlink, a FIFO, a directory) is
        skipped, so its key counts as missing."""
        for key in keys:
            for directory in self.store.directories:
                data = _read_regular(os.path.join(directory, self.file_name(key)))
                if data is not None:
                    yield StoredChunk(key, data)
                    break

    def write(self, chunks: Iterable[StoredChunk]) -> tuple[int, int, int]:
        """(written, already there, dropped): every chunk to a hidden temporary file, all renamed to their
        names only once the chunks ran out without an error (a snapshot's checksums are checked as they
        come), so LMCache never indexes half a chunk nor one of a refused load; a chunk some directory
        already holds is left as it is. A chunk that would take the tier past its budget (the chunk files
        there counted) or its file system past its free space is dropped, never written: LMCache would not
        count it, and the disk would fill past what it was given. SIGTERM, like Ctrl-C, interrupts it
        with the temporary files removed (SIGKILL leaves them stale: see stale_partials)."""
        directory = self.store.directories[0]
        os.makedirs(directory, exist_ok=True)
        present = self._file_names()
        room = self._room(directory)
        staged: list[tuple[str, str]] = []  # (temporary file, chunk file)
        already = dropped = 0
        with staging(directory), _terminate_as_interrupt():
            try:
                for chunk in chunks:
                    name = self.file_name(chunk.key)
                    if name in present:
                        already += 1
                        continue
                    size = memoryview(chunk.data).nbytes
                    if size > room:
                        dropped += 1
                        continue
                    room -= size
                    present.add(name)
                    path = os.path.join(directory, name)
                    partial = os.path.join(directory, partial_name(name))
                    _write_new(path, partial, chunk.data, staged)
                for partial, path in staged:
                    _renamed(partial, path)
            except BaseException:
                for partial, _path in staged:
                    with contextlib.suppress(OSError):
                        os.unlink(partial)
                raise
        return len(staged), already, dropped

    def _room(self, directory: str) -> int:
        """Bytes a load may add: the file system's free space, and at most what the budget leaves beside
        the chunk files the tier holds."""
        usage = os.statvfs(directory)
        free = usage.f_bavail * usage.f_frsize
        return free if self.budget_bytes is None else min(free, self.budget_bytes - self._files().usage())

    def stale_partial_files(self, notes: list[str]) -> list[str]:
        """The partial files interrupted kvctl loads left in the directories; where a load is writing
        now (or the directory cannot be locked), a note says so and none of its files is taken."""
        found = []
        for directory in self.store.directories:
            with stale_partials(directory) as stale:
                if stale is None:
                    notes.append(f"a kvctl load is writing into {directory} now (or it cannot be locked): its "
                                 "partial files stay")
                found += [str(path) for path in stale or []]
        return found


class RedisStore:
    """The in-process Redis tier (two names per chunk, removed together) or the MP resp L2 adapter
    (one name per chunk), found by SCAN and checked by EXISTS; removed with UNLINK, counted by what
    Redis reports it removed."""

    def __init__(self, store: Store) -> None:
        self.store, self.tier = store, store.tier
        self.headers = store.layout == "lmcache-redis"  # the resp adapter SETs the object's bytes alone

    def chunk_keys(self, model: str | None) -> list[str]:
        return redis_tier_keys(self.store, model)

    def held(self, keys: Sequence[str]) -> list[str]:
        return stored_redis_keys(self.store, list(keys))

    def remove(self, keys: Sequence[str]) -> list[str]:
        return unlink_chunks(self.store, list(keys))

    # -- chunk bytes (snapshots; in-process: `<key>kv_bytes` then `<key>metadata`; MP: `<key>`) ------

    def read(self, keys: Sequence[str]) -> Iterator[StoredChunk]:
        from kvctl.clients.redis_tier import RedisTier

        keys = list(keys)
        with RedisTier(self.store.redis) as redis:
            values = redis.get_values([name for key in keys for name in redis_chunk_names(key, self.store.layout)])
            for key in keys:
                data, metadata = next(values), next(values) if self.headers else None
                if data is not None and (metadata is not None or not self.headers):
                    yield StoredChunk(key, data, metadata)

    def with_metadata(self, chunks: list[StoredChunk]) -> list[StoredChunk]:
        """The chunks, each with the metadata header Redis holds for it (where it does; MP keeps none)."""
        from kvctl.clients.redis_tier import RedisTier

        if not self.headers:
            return chunks
        names = [redis_chunk_names(chunk.key, self.store.layout)[-1] for chunk in chunks]
        with RedisTier(self.store.redis) as redis:
            headers = list(redis.get_values(names))
        return [StoredChunk(chunk.key, chunk.data, header) if header else chunk
                for chunk, header in zip(chunks, headers)]

    def write(self, chunks: Iterable[StoredChunk]) -> tuple[int, int, int]:
        """(written, already there, dropped: none, Redis keeps its own memory budget): the data name first and
        the metadata name last, as LMCache writes them, so a reader that sees the metadata finds the data
        (MP: the one name, the object's bytes)."""
        from kvctl.clients.redis_tier import RedisTier

        chunks = list(chunks)
        held = set(self.held([chunk.key for chunk in chunks]))
        going = [chunk for chunk in chunks if chunk.key not in held]
        bare = next((chunk.key for chunk in going if not chunk.metadata), None) if self.headers else None
        if bare is not None:
            raise UsageError(f"chunk {bare} has no LMCache metadata header (it was saved from a disk tier), which "
                             "the Redis tier needs", hint="load it into a disk tier, or through a running engine "
                             "(--instance), which makes the header")
        with RedisTier(self.store.redis) as redis:
            redis.set_values((name, value) for chunk in going
                             for name, value in zip(redis_chunk_names(chunk.key, self.store.layout),
                                                    (chunk.data, chunk.metadata)))
        return len(going), len(held), 0


def chunk_store(store: Store, settings: dict[str, Any]) -> DirectoryStore | RedisStore:
    """The store; a disk directory with its budget (max_local_disk_size GB, as LMCache counts it)."""
    if store.layout not in DISK_SUFFIXES:
        return RedisStore(store)
    budget = settings.get("max_local_disk_size") if store.layout == "lmcache-disk" else None
    return DirectoryStore(store, int(float(budget) * 1024**3) if budget else None)


def remove_partial_files(paths: Sequence[str]) -> list[str]:
    """Those of `paths` (planned stale partial files) still stale now, removed."""
    by_directory: dict[str, list[str]] = {}
    for path in paths:
        by_directory.setdefault(os.path.dirname(path), []).append(path)
    gone = []
    for directory, planned in by_directory.items():
        with stale_partials(directory) as stale:
            for path in set(planned) & {str(found) for found in stale or []}:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as error:
                    raise KvctlError(f"cannot remove {path}: {error.strerror}",
                                     hint="run kvctl as a user that can write the disk tier directory") from None
                gone.append(path)
    return sorted(gone)


@dataclass(frozen=True)
class OfflineEvictionPlan(EvictionPlan):
    """An eviction with no engine, and the stale partial files that interrupted kvctl loads left in the
    selected disk directories (`partial_files`: never chunks, never read by LMCache), removed with it."""

    partial_files: tuple[str, ...] = ()

    @classmethod
    def of(cls, plan: EvictionPlan, partial_files: Sequence[str]) -> OfflineEvictionPlan:
        """`plan`'s tiers with these partial files."""
        return cls(**{part.name: getattr(plan, part.name) for part in fields(EvictionPlan)},
                   partial_files=tuple(partial_files))

    def as_dict(self) -> dict[str, Any]:
        answer = super().as_dict()
        return {**answer, "partial_files": list(self.partial_files)} if self.partial_files else answer


class RunningEngine(NamedTuple):
    """An engine that uses a configuration's stores: where it runs, how it uses them, its URL if known."""

    where: str
    whose: str  # "of this configuration", "using the disk directory …", "using the same Redis …"
    url: str | None


class OfflineInstance(NoManagement):
    """A configuration directory's stores, with no engine: lookup, list, evict, snapshots; pins refused.
    Its keys are the deployment's: chunk keys in process, object keys for an MP server's L2."""

    kind = "offline"
    pin_ids = False  # no pins without an engine
    settle_s = 0.0  # nothing here writes asynchronously: what the stores hold is current

    def __init__(self, config_dir: str | os.PathLike, model: str | None = None, kv_dtype: str | None = None,
                 world_size: int = 1, hash_seed: str | None = None, vllm_url: str | None = None) -> None:
        self.config_dir = Path(config_dir) if config_dir is not None else None  # None: a subclass's own deployment
        self.name = str(config_dir)
        self.model, self.kv_dtype, self.world_size, self.hash_seed = model, kv_dtype, world_size, hash_seed
        self.vllm_url = vllm_url
        self.notes: list[str] = []  # what the last lookup did not check, and what it assumed

    @cached_property
    def deployment(self) -> Deployment:
        return read_deployment(self.config_dir)

    @property
    def key_format(self) -> str:
        """An MP configuration's stores hold objects under their object keys, an in-process one's chunks."""
        return "mp-object" if self.deployment.mode == "mp" else "chunk"

    def prompt_keys(self, tokens: list[int], model: str | None = None) -> list[str]:
        """The recipe's keys, chunk by chunk, every rank's (MP: object keys, object group 0: the only one
        a configuration can name), without reading a store."""
        recipe = self._target(model).recipe
        return [key for chunk in prompt_chunk_keys(list(tokens), recipe) for key in chunk["keys"]]

    def _target(self, model: str | None) -> Target:
        """The key recipe and stores for `model` (else the constructor's, else env.sh's)."""
        return target_from_deployment(self.deployment, model or self.model, self.kv_dtype, self.world_size,
                                      self.hash_seed)

    def _known_model(self, model: str | None = None) -> str | None:
        return model or self.model or self.deployment.env.get("KVCTL_MODEL")

    def model_name(self, model: str | None = None) -> str:
        name = self._known_model(model)
        if not name:
            raise UsageError("which model? chunk keys contain the model name vLLM was given",
                             hint="pass --model with the value of vLLM's --model ('kvctl config init --model' "
                             "writes it to env.sh)")
        return name

    def tokenize(self, prompt: PromptSource, model: str | None = None) -> list[int]:
        from kvctl.core.lmcache.tokens import local_model_dir

        name = self._known_model(model)
        return prompt.token_ids(local_model_dir(name), self.vllm_url, name)

    def lookup(self, tokens: list[int], model: str | None = None) -> LookupResult:
        from kvctl.core.cache.lookup import read_tiers

        target = self._target(model)
        self.notes = list(target.notes)
        return read_tiers(tokens, target)

    def list(self, tiers: Sequence[str] | None, model: str | None, limit: int) -> Listing:
        return list_stores(self.deployment.stores, list(tiers) if tiers else None, limit, model)

    def plan_eviction(self, selection: Selection) -> EvictionPlan:
        """A prompt's chunks (on every rank), given keys (of any model: the user named them) or every
        chunk of the model, on the selected tiers. Refused while an engine that uses these stores runs,
        unless `selection.force`: on every tier, not only on disk (where its index would point at
        deleted files), since an MP server also accounts for its L2 usage and nothing is lost by
        evicting through the engine instead. Checked again when the plan is executed. The stale
        partial files of interrupted kvctl loads in a selected disk directory go with it (listed)."""
        stores = self._stores(selection)
        chosen = selection.chosen([store.tier for store in stores])
        if not selection.force:
            self._refuse_if_running(chosen, selection.model)
        wanted = self._wanted(selection)
        model = self.model_name(selection.model) if wanted is None else None
        plan = plan_store_eviction(stores, selection, model, wanted)
        partials = [path for store in stores if isinstance(store, DirectoryStore) and store.tier in chosen
                    for path in store.stale_partial_files(self.notes)]
        if partials:
            self.notes.append(f"{len(partials)} stale partial file(s) of interrupted kvctl loads (no chunks: LMCache "
                              f"never reads them) go with this eviction: {', '.join(partials[:5])}"
                              + (" …" if len(partials) > 5 else ""))
        return OfflineEvictionPlan.of(plan, partials)

    def execute_eviction(self, plan: EvictionPlan) -> OfflineEvictionPlan:
        """The planned chunks, each tier refused (unless forced) while an engine that uses it runs (one may
        have started since the plan), and the planned partial files."""
        done = execute_plan(plan, self._tier_remover(plan.selection or Selection()))
        partials = plan.partial_files if isinstance(plan, OfflineEvictionPlan) else ()
        return OfflineEvictionPlan.of(done, remove_partial_files(partials))

    def _tier_remover(self, selection: Selection) -> TierRemover:
        def remove(store: DirectoryStore | RedisStore, keys: list[str]) -> list[str]:
            if not selection.force:
                self._refuse_if_running([store.tier], selection.model)
            return store.remove(keys)

        return store_remover(self._chunk_stores(), remove)

    def _chunk_stores(self) -> list[DirectoryStore | RedisStore]:
        return [chunk_store(store, self.deployment.settings) for store in self.deployment.stores]

    def _stores(self, selection: Selection) -> list[DirectoryStore | RedisStore]:
        present = [store.tier for store in self.deployment.stores]
        if "cpu" in (selection.tiers or ()):
            raise UsageError(f"{self.name} is a configuration, not a running engine: it has no CPU tier to evict "
                             "from", hint=CPU_HINT)
        missing = selection.missing(present)
        if missing:
            raise UsageError(f"this configuration has no {', '.join(missing)} tier (it has "
                             f"{', '.join(present) or 'none kvctl reads directly'})",
                             hint=f"choose among its tiers: {', '.join(present)}" if present else CPU_HINT)
        if not present:
            raise UsageError("this configuration names no disk, Redis, fs or resp tier kvctl can evict from",
                             hint=CPU_HINT)
        return self._chunk_stores()

    def _wanted(self, selection: Selection) -> list[str] | None:
        """The selected chunk keys: a prompt's on every rank, or the given ones (canonical); None for
        whole tiers."""
        if selection.tokens is not None:
            return self.prompt_keys(list(selection.tokens), selection.model)
        if selection.keys is None:
            return None
        if self.deployment.mode == "mp":
            return [key.native_key() for key in given_object_keys(selection.keys)]
        return given_chunk_keys(selection.keys)

    # -- is an engine that uses these stores running? ----------------------------------------------

    def _refuse_if_running(self, tiers: Sequence[str], model: str | None = None) -> None:
        found = self.running_engine(model)
        if found:
            named = " and ".join(tiers)
            raise UsageError(f"an engine {found.whose} is running at {found.where}: evicting its {named} "
                             f"tier{'s' if len(tiers) > 1 else ''} behind its back would leave its index pointing "
                             "at deleted files", hint=f"evict through it: kvctl evict --instance {found.url or 'URL'}"
                             " …, or add --force")

    def running_engine(self, model: str | None = None) -> RunningEngine | None:
        """An engine that uses this configuration's stores, if one runs: a `kvctl serve` whose processes
        are alive, of this directory or of one naming the same disk directory (or the same Redis, for
        the same model); whatever answers this configuration's own API (started by hand); or an LMCache
        process of this user on this host whose settings name one of them (see _lmcache_processes)."""
        return self._served_by_kvctl(model) or self._answering_api() or self._sharing_process(model)

    def _served_by_kvctl(self, model: str | None) -> RunningEngine | None:
        from kvctl.core.common.paths import cache_dir
        from kvctl.core.instance.addresses import from_state
        from kvctl.core.serve.state import read_state

        mine = self.config_dir.expanduser().resolve()
        mine = mine if mine.is_dir() else mine.parent
        serve = cache_dir() / "serve"
        for path in [serve / "state.json", *sorted(serve.glob("*/state.json"))]:
            try:
                state = read_state(path)
                served = Path(state["config_dir"]).resolve()
            except (KvctlError, OSError, KeyError, TypeError):
                continue  # not a state file, or one of something else
            pids = [state.get("kvctl_pid"), *(entry.get("pid") for entry in state.get("processes") or [])]
            if not any(_alive(pid) for pid in pids):
                continue
            whose = "of this configuration" if served == mine else self._shared(_stores_of(served), state.get("model"),
                                                                                 model)
            if whose:
                address = from_state(state)
                url = (address.mp_http if address.mode == "mp" else address.worker) or address.vllm
                return RunningEngine(url or str(path), whose, url)
        return None

    def _answering_api(self) -> RunningEngine | None:
        """The in-process worker 0's internal API (port_start + 1, or its Unix socket) or the MP server's
        HTTP port, from the configuration; what answers 2xx there counts as its engine."""
        from kvctl.clients.http import HTTPClient
        from kvctl.core.lmcache.schema import mp_server_flags
        from kvctl.core.serve.launch import reach_host, url_host

        settings = self.deployment.settings
        if self.deployment.mode == "mp":
            flags = mp_server_flags()
            host = str(settings.get("http_host", flags["http_host"]["default"]))
            url = f"http://{url_host(reach_host(host))}:{settings.get('http_port', flags['http_port']['default'])}"
            path = "/healthcheck"
        else:
            url, path = _worker_api(settings), "/lmc_version"
        if url is None:
            return None
        try:
            with HTTPClient(url, PROBE_TIMEOUT_S) as client:
                client.request("GET", path)
        except KvctlError:
            return None
        return RunningEngine(url, "of this configuration", url)

    def _sharing_process(self, model: str | None) -> RunningEngine | None:
        for pid, settings, their_model, cwd in _lmcache_processes():
            stores, _ = inprocess_stores(settings)
            whose = self._shared(stores, their_model, model, cwd)
            if whose:
                url = _worker_api(settings)
                return RunningEngine(f"{url} (pid {pid})" if url else f"pid {pid}", whose, url)
        return None

    def _shared(self, stores: Sequence[Store], their_model: str | None, model: str | None,
                cwd: str = "") -> str | None:
        """How an engine's stores (relative directories from its working directory) meet this
        configuration's: a disk directory both name, or the same Redis where both serve the same model
        (another model's chunks are not in its way); None where they do not."""
        directories = {os.path.realpath(directory) for store in self.deployment.stores
                       for directory in store.directories}
        for store in stores:
            for directory in store.directories:
                if os.path.realpath(os.path.join(cwd, directory)) in directories:
                    return f"using the disk directory {directory}"
        ours = self._known_model(model)
        places = {_redis_place(store.redis) for store in self.deployment.stores if store.redis}
        for store in stores:
            if ours and their_model == ours and store.redis and _redis_place(store.redis) in places:
                return f"using the same Redis ({store.redis.url(redact=True)}) for {ours}"
        return None

    # -- snapshots ----------------------------------------------------------------------------------

    def key_facts(self, model: str | None = None) -> KeyFacts:
        """The recipe's: model and world size from the flags or env.sh; KV dtype None for MP (in no MP key)."""
        from kvctl.core.lmcache.key_facts import UNSET, KeyFacts
        from kvctl.core.lmcache.versions import installed

        self._snapshot_stores()
        recipe = self._target(model).recipe
        seed = UNSET if recipe.hash_seed is None else recipe.hash_seed
        return KeyFacts(recipe.chunk_size, recipe.hash_algorithm, seed, recipe.model_name,
                        getattr(recipe, "kv_dtype", None), recipe.world_size, installed("lmcache"))

    def read_chunks(self, keys: Sequence[str]) -> Iterator[StoredChunk]:
        """From the disk directory first, then Redis (LMCache's lookup order). A chunk read from disk
        takes its metadata header from Redis where Redis holds it too, so it can be loaded into any tier."""
        remaining = list(dict.fromkeys(keys))
        stores = self._snapshot_stores()
        redis = next((store for store in stores if isinstance(store, RedisStore)), None)
        for store in stores:
            held = store.held(remaining)
            if redis is None or store is redis:
                yield from store.read(held)  # one chunk at a time: a batch held in memory made a save twice as slow
            else:
                for start in range(0, len(held), READ_BATCH):
                    yield from redis.with_metadata(list(store.read(held[start:start + READ_BATCH])))
            taken = set(held)
            remaining = [key for key in remaining if key not in taken]

    def write_chunks(self, chunks: Iterable[StoredChunk], tier: str | None = None) -> dict[str, dict[str, int]]:
        """Into the disk directory (refused while an engine of this configuration runs: it would not see
        them until restarted) or Redis (which a running in-process engine reads afresh; an MP server's
        L2 accounting would not count them, so refused there too). MP: the fs directory's `.data`
        files and the resp adapter's keys, each the object's bytes as the server's L1 holds them."""
        stores = {store.tier: store for store in self._snapshot_stores()}
        mp = self.deployment.mode == "mp"
        tier = tier or next(iter(stores))
        if tier not in stores:
            present = ", ".join(stores)
            raise UsageError(f"this configuration has no {tier} tier kvctl writes directly (it has {present})",
                             hint=(L1_HINT if mp else CPU_HINT) if tier == "cpu" else f"choose among {present}")
        if tier == "disk" or mp:
            found = self.running_engine()
            if found:
                why = ("its L2 accounting would not count chunks written behind its back" if mp
                       else "it would not see chunks written behind its back until restarted")
                raise UsageError(f"an engine {found.whose} is running at {found.where}: {why}",
                                 hint=f"load through it: --instance {found.url or 'URL'}")
        written, already, dropped = stores[tier].write(chunks)
        return {"written": {tier: written}, "already": {tier: already}, "dropped": {tier: dropped}}

    def stages_writes(self, tier: str | None = None) -> bool:
        """A disk directory's are (DirectoryStore.write); Redis's are not."""
        chosen = next((store for store in self._snapshot_stores() if tier in (None, store.tier)), None)
        return isinstance(chosen, DirectoryStore)

    def _snapshot_stores(self) -> list[DirectoryStore | RedisStore]:
        stores = self._chunk_stores()
        if not stores:
            mp = self.deployment.mode == "mp"
            raise UsageError(f"this configuration names no {'fs or resp L2' if mp else 'disk or Redis'} tier kvctl "
                             "reads directly", hint=L1_HINT if mp else CPU_HINT)
        return stores

    # -- what needs an engine ----------------------------------------------------------------------

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None,
            model: str | None = None) -> Pin:
        raise Unsupported("a configuration directory cannot pin: pins live in a running engine", hint=NEEDS_ENGINE_HINT)

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None) -> Unpinned:
        raise Unsupported("a configuration directory has no pins to release: pins live in a running engine",
                          hint=NEEDS_ENGINE_HINT)

    def pins(self, model: str | None = None) -> PinList:
        raise _no_pins()

    def pin_scope(self) -> str:
        raise _no_pins()  # so a pin set keeps no ledger for a configuration either

    def prefetch(self, tokens: list[int]) -> dict[str, int]:
        raise Unsupported("prefetch loads chunks into a running engine's CPU tier", hint=NEEDS_ENGINE_HINT)


def _read_regular(path: str) -> bytes | None:
    """A regular file's bytes; None when there is none: a FIFO is never waited on, and a symlink is no
    chunk (never followed: it could point at any file this user may read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, IsADirectoryError):
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:  # the name is a symlink
            return None
        raise KvctlError(f"cannot read {path}: {error.strerror}", hint="run kvctl as a user that can read the "
                         "disk tier directory") from None
    with os.fdopen(fd, "rb") as file:
        return file.read() if stat.S_ISREG(os.fstat(fd).st_mode) else None


def _write_new(path: str, partial: str, data: bytes | memoryview, staged: list[tuple[str, str]]) -> None:
    """Write `path`'s bytes to `partial`, created afresh (never through a link). It is staged before it
    is created, so an interrupt (SIGTERM) that lands just after the creation still finds it to remove,
    and unstaged when the creation fails: a file already at that name is not this load's to remove."""
    staged.append((partial, path))
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        staged.pop()
        raise _write_error(path, error) from None
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
    except OSError as error:
        raise _write_error(path, error) from None


def _renamed(partial: str, path: str) -> None:
    try:
        os.rename(partial, path)
    except OSError as error:
        raise _write_error(path, error) from None


def _write_error(path: str, error: OSError) -> KvctlError:
    return KvctlError(f"cannot write {path}: {error.strerror}",
                      hint="check the disk tier directory's free space and permissions")


def _worker_api(settings: dict[str, Any]) -> str | None:
    """An in-process worker 0's internal API (port_start + 1, or its Unix socket), where enabled."""
    from kvctl.core.serve.launch import reach_host, url_host

    if not settings.get("internal_api_server_enabled"):
        return None
    port = int(settings["internal_api_server_port_start"]) + 1
    prefix = settings["internal_api_server_socket_path_prefix"]
    return (f"unix:{prefix}_{port}" if prefix
            else f"http://{url_host(reach_host(str(settings['internal_api_server_host'])))}:{port}")


def _stores_of(config_dir: Path) -> list[Store]:
    """A configuration's stores; none where it cannot be read."""
    try:
        return read_deployment(config_dir).stores
    except (KvctlError, OSError):
        return []


def _redis_place(url) -> tuple:
    return frozenset(url.hosts), url.db, url.service_name


STANDALONE = ("lmcache.v1.standalone", "kvctl_plugins.standalone")  # LMCache's standalone engine: --config FILE


def _lmcache_processes() -> Iterator[tuple[int, dict[str, Any], str | None, str]]:
    """This user's processes on this host that loaded LMCache (its extension modules are mapped) and
    say how it is configured, but kvctl itself: (pid, the LMCache settings of their configuration file
    (LMCACHE_CONFIG_FILE, a standalone engine's --config), LMCACHE_* variables and vLLM's
    --kv-transfer-config extra config; the model they serve, where the command line names it; their
    working directory). Another user's processes, a container's or another host's are not seen."""
    from kvctl.core.diagnose.local_process import command_line
    from kvctl.core.lmcache.config import effective_config, load_mapping
    from kvctl.core.serve.launch import flag_value

    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            environ = dict(part.decode(errors="replace").partition("=")[::2] for part in raw if b"=" in part)
            argv = command_line(pid)
            config = environ.get("LMCACHE_CONFIG_FILE")
            if any(module in argv for module in STANDALONE):
                config = flag_value(argv, "--config") or config
            if not (config or any(name.startswith("LMCACHE_") for name in environ)):
                continue
            if "/lmcache/" not in Path(f"/proc/{pid}/maps").read_text():
                continue  # a shell that sourced env.sh, not an engine
            cwd = os.readlink(f"/proc/{pid}/cwd")
            values = load_mapping(Path(cwd, config)) if config else {}
        except (OSError, KvctlError):
            continue  # gone meanwhile, or its configuration file is not readable
        extra = _extra_config(flag_value(argv, "--kv-transfer-config"))
        settings = effective_config(values, "file", environ, extra, "vllm").values
        model = flag_value(argv, "--model", "--model-name") or _served_model(argv)
        yield pid, settings, model, cwd


def _extra_config(text: str | None) -> dict[str, Any]:
    try:
        extra = json.loads(text).get("kv_connector_extra_config") if text else None
    except (ValueError, AttributeError, RecursionError):
        return {}
    return extra if isinstance(extra, dict) else {}


def _served_model(argv: list[str]) -> str | None:
    """`vllm serve MODEL`'s model."""
    if "serve" in argv[:-1] and not argv[argv.index("serve") + 1].startswith("-"):
        return argv[argv.index("serve") + 1]
    return None


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """While held (in the main thread), SIGTERM interrupts as Ctrl-C does (exit 130), and only the first
    of them does: the cleanup it sets off is never itself cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def interrupt(_signum, _frame) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, alive
    return True


def _no_pins() -> Unsupported:
    return Unsupported("a configuration directory has no pins: pins live in a running engine", hint=NEEDS_ENGINE_HINT)
