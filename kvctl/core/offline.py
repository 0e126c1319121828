"""A `kvctl config init` directory with no engine running: its stores read and written directly.

With no engine to ask, the stores the configuration names are read in LMCache's own layouts: the
in-process disk directory (`<key>.pt`) and Redis tier (`<key>kv_bytes` + `<key>metadata`), or the MP
server's fs (`<object key>.data`) and resp L2 adapters. Only names that parse as canonical chunk keys
count, so stray files and foreign Redis keys are never listed or removed. The CPU tier lives in an
engine's memory and pins in an engine or a coordinator: those need --instance.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.instance import EvictionPlan, Selection, Unsupported, plan_store_eviction
from kvctl.core.keys import (
    disk_file_name,
    given_chunk_keys,
    given_object_keys,
    parse_key,
    parse_object_key,
    prompt_chunk_keys,
)
from kvctl.core.listing import Listing, disk_chunks, list_stores, redis_tier_keys, stored_redis_keys, unlink_chunks
from kvctl.core.target import DISK_SUFFIXES, Deployment, Store, Target, read_deployment, target_from_config

PROBE_TIMEOUT_S = 1.0  # a running engine answers on loopback at once; a stopped one refuses at once
CPU_HINT = "the CPU tier lives in a running engine: use --instance"
NEEDS_ENGINE_HINT = "pins and prefetch need a running engine: pass --instance (a kvctl serve name or its URL)"


class DirectoryStore:
    """A disk tier's directories: LocalDiskBackend's `<key>.pt` files ("lmcache-disk", '/' in the model
    written as '-') or the fs L2 adapter's `<object key>.data` files ("mp-fs"). A chunk is the file
    its key names, in whichever directory holds it."""

    def __init__(self, store: Store) -> None:
        self.store, self.tier = store, store.tier

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
        from kvctl.clients.disk_tier import DiskTier

        names = DiskTier(self.store.directories, DISK_SUFFIXES[self.store.layout]).names()
        return [key for key in keys if self.file_name(key) in names]

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


class RedisStore:
    """The in-process Redis tier (two names per chunk, removed together) or the MP resp L2 adapter
    (one name per chunk), found by SCAN and checked by EXISTS; removed with UNLINK, counted by what
    Redis reports it removed."""

    def __init__(self, store: Store) -> None:
        self.store, self.tier = store, store.tier

    def chunk_keys(self, model: str | None) -> list[str]:
        return redis_tier_keys(self.store, model)

    def held(self, keys: Sequence[str]) -> list[str]:
        return stored_redis_keys(self.store, list(keys))

    def remove(self, keys: Sequence[str]) -> list[str]:
        return unlink_chunks(self.store, list(keys))


def chunk_store(store: Store) -> DirectoryStore | RedisStore:
    return DirectoryStore(store) if store.layout in DISK_SUFFIXES else RedisStore(store)


class OfflineInstance:
    """A configuration directory's stores, with no engine: lookup, list and evict; pins refused."""

    kind = "offline"
    pin_ids = False  # no pins without an engine
    settle_s = 0.0  # nothing here writes asynchronously: what the stores hold is current

    def __init__(self, config_dir: str | os.PathLike, model: str | None = None, kv_dtype: str | None = None,
                 world_size: int = 1, hash_seed: str | None = None, vllm_url: str | None = None) -> None:
        self.config_dir = Path(config_dir)
        self.name = str(config_dir)
        self.model, self.kv_dtype, self.world_size, self.hash_seed = model, kv_dtype, world_size, hash_seed
        self.vllm_url = vllm_url
        self.notes: list[str] = []  # what the last lookup did not check, and what it assumed

    @cached_property
    def deployment(self) -> Deployment:
        return read_deployment(self.config_dir)

    def _target(self, model: str | None) -> Target:
        """The key recipe and stores for `model` (else the constructor's, else env.sh's)."""
        return target_from_config(self.config_dir, model or self.model, self.kv_dtype, self.world_size,
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

    def tokenize(self, prompt: Any, model: str | None = None) -> list[int]:
        from kvctl.core.tokens import local_model_dir

        name = self._known_model(model)
        return prompt.token_ids(local_model_dir(name), self.vllm_url, name)

    def lookup(self, tokens: list[int], model: str | None = None) -> Any:
        from kvctl.core.lookup import read_tiers

        target = self._target(model)
        self.notes = list(target.notes)
        return read_tiers(tokens, target)

    def list(self, tiers: Sequence[str] | None, model: str | None, limit: int) -> Listing:
        return list_stores(self.deployment.stores, list(tiers) if tiers else None, limit, model)

    def plan_eviction(self, selection: Selection) -> EvictionPlan:
        """A prompt's chunks (on every rank), given keys (of any model: the user named them) or every
        chunk of the model, on the selected tiers. Refused while an engine of this configuration runs,
        unless `selection.force`: on every tier, not only on disk (where its index would point at
        deleted files), since an MP server also accounts for its L2 usage and nothing is lost by
        evicting through the engine instead. Checked again when the plan is executed."""
        stores = self._stores(selection)
        if not selection.force:
            self._refuse_if_running(selection.chosen([store.tier for store in stores]))
        wanted = self._wanted(selection)
        model = self.model_name(selection.model) if wanted is None else None

        def remove(store: DirectoryStore | RedisStore, keys: list[str]) -> list[str]:
            if not selection.force:
                self._refuse_if_running([store.tier])  # one may have started since the plan
            return store.remove(keys)

        return plan_store_eviction(stores, selection, model, wanted, remove=remove)

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
        return [chunk_store(store) for store in self.deployment.stores]

    def _wanted(self, selection: Selection) -> list[str] | None:
        """The selected chunk keys: a prompt's on every rank, or the given ones (canonical); None for
        whole tiers."""
        if selection.tokens is not None:
            recipe = self._target(selection.model).recipe
            return [key for chunk in prompt_chunk_keys(list(selection.tokens), recipe) for key in chunk["keys"]]
        if selection.keys is None:
            return None
        if self.deployment.mode == "mp":
            return [key.native_key() for key in given_object_keys(selection.keys)]
        return given_chunk_keys(selection.keys)

    # -- is an engine of this configuration running? ------------------------------------------------

    def _refuse_if_running(self, tiers: Sequence[str]) -> None:
        url = self.running_engine()
        if url:
            named = " and ".join(tiers)
            raise UsageError(f"an engine of this configuration is running at {url}: evicting its {named} "
                             f"tier{'s' if len(tiers) > 1 else ''} behind its back would leave its index pointing "
                             "at deleted files", hint=f"evict through it: kvctl evict --instance {url} …, or add "
                             "--force")

    def running_engine(self) -> str | None:
        """Where an engine of this configuration answers, if one runs: a `kvctl serve` of this directory
        whose processes are alive, or whatever answers the configuration's own API (started by hand)."""
        return self._served_by_kvctl() or self._answering_api()

    def _served_by_kvctl(self) -> str | None:
        from kvctl.core.instances import from_state
        from kvctl.core.launch import read_state
        from kvctl.core.paths import cache_dir

        mine = self.config_dir.expanduser().resolve()
        mine = mine if mine.is_dir() else mine.parent
        serve = cache_dir() / "serve"
        for path in [serve / "state.json", *sorted(serve.glob("*/state.json"))]:
            try:
                state = read_state(path)
                served = Path(state["config_dir"]).resolve() == mine
            except (KvctlError, OSError, KeyError, TypeError):
                continue  # not a state file, or one of something else
            pids = [state.get("kvctl_pid"), *(entry.get("pid") for entry in state.get("processes") or [])]
            if served and any(_alive(pid) for pid in pids):
                address = from_state(state)
                return (address.mp_http if address.mode == "mp" else address.worker) or address.vllm or str(path)
        return None

    def _answering_api(self) -> str | None:
        """The in-process worker 0's internal API (port_start + 1, or its Unix socket) or the MP server's
        HTTP port, from the configuration; what answers 2xx there counts as its engine."""
        from kvctl.clients.http import HTTPClient
        from kvctl.core.launch import reach_host, url_host
        from kvctl.core.lmcache_schema import mp_server_flags

        settings = self.deployment.settings
        if self.deployment.mode == "mp":
            flags = mp_server_flags()
            host = str(settings.get("http_host", flags["http_host"]["default"]))
            url = f"http://{url_host(reach_host(host))}:{settings.get('http_port', flags['http_port']['default'])}"
            path = "/healthcheck"
        elif settings["internal_api_server_enabled"]:
            port = int(settings["internal_api_server_port_start"]) + 1
            prefix = settings["internal_api_server_socket_path_prefix"]
            url = (f"unix:{prefix}_{port}" if prefix
                   else f"http://{url_host(reach_host(str(settings['internal_api_server_host'])))}:{port}")
            path = "/lmc_version"
        else:
            return None
        try:
            with HTTPClient(url, PROBE_TIMEOUT_S) as client:
                client.request("GET", path)
        except KvctlError:
            return None
        return url

    # -- what needs an engine ----------------------------------------------------------------------

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None, model: str | None = None):
        raise Unsupported("a configuration directory cannot pin: pins live in a running engine", hint=NEEDS_ENGINE_HINT)

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None):
        raise Unsupported("a configuration directory has no pins to release: pins live in a running engine",
                          hint=NEEDS_ENGINE_HINT)

    def pins(self, model: str | None = None):
        raise Unsupported("a configuration directory has no pins: pins live in a running engine",
                          hint=NEEDS_ENGINE_HINT)

    def prefetch(self, tokens: list[int]) -> dict[str, Any]:
        raise Unsupported("prefetch loads chunks into a running engine's CPU tier", hint=NEEDS_ENGINE_HINT)


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
