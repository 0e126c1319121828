"""What a lookup is about: the key recipe of one LMCache deployment and where its tiers keep data.

Every part of a key comes from somewhere definite: chunk size, hash algorithm and unfull-chunk
rule from the LMCache configuration; the hash seed from the PYTHONHASHSEED in `env.sh`; the model
name as given to vLLM's --model; the KV dtype by vLLM's `--dtype auto` rule for the model unless
given.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.lmcache.config import (
    detect_mode,
    effective_config,
    load_mapping,
    locate,
    parse_env_file,
    read_text,
)
from kvctl.core.lmcache.key_facts import KeyFacts
from kvctl.core.lmcache.keys import KeyRecipe, MPKeyRecipe, dtype_name
from kvctl.core.lmcache.schema import mp_server_flags
from kvctl.core.lmcache.tiers import RedisURL, parse_redis_url

# What the stored names of each layout look like: file suffix, Redis SCAN pattern, and what LMCache
# appends to a chunk key to name it in Redis.
DISK_SUFFIXES = {"lmcache-disk": ".pt", "mp-fs": ".data"}
REDIS_PATTERNS = {"lmcache-redis": "*@*@*@*@*metadata", "mp-resp": "*@*@*@*"}
REDIS_SUFFIXES = {"lmcache-redis": "metadata", "mp-resp": ""}


MP_L1_UNCHECKED = ("the MP server's L1 (cpu) tier is seen only through the running server (kvctl's routes, "
                   "--instance); it is not checked")


@dataclass(frozen=True)
class Store:
    """One place chunks live: `tier` as users say it, `layout` as LMCache writes it."""

    tier: str  # "cpu", "disk", "redis"
    layout: str  # "lmcache-disk", "lmcache-redis", "mp-fs", "mp-resp"
    directories: tuple[str, ...] = ()
    redis: RedisURL | None = None


@dataclass
class Target:
    mode: str
    recipe: KeyRecipe | MPKeyRecipe
    stores: list[Store]
    model_dir: str | None = None
    notes: list[str] = field(default_factory=list)


def kv_dtype_for_model(model_dir: str | os.PathLike, platform: str = "cpu") -> str:
    """vLLM's `--dtype auto` for a model directory: its config dtype, float32 downcast to bfloat16."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        raise KvctlError(f"cannot read {config_path} to find the model's dtype",
                         hint="pass --kv-dtype (e.g. bfloat16) or a model directory with config.json") from None
    declared = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    if declared in ("float32", "float"):
        return "bfloat16"  # vLLM's preferred dtype on CPU and on GPUs with bfloat16 support
    return dtype_name(declared)


@dataclass
class Deployment:
    """What a `kvctl config init` directory (or an lmcache.yaml) says about a deployment; one subclass
    per LMCache mode, chosen once by read_deployment (or engine_deployment), says what differs."""

    mode: ClassVar[str]
    env: dict[str, str]
    values: dict[str, Any]  # lmcache.yaml as written (MP: the server's settings)
    settings: dict[str, Any]  # in-process: LMCache's effective configuration; MP: the values
    stores: list[Store]
    notes: list[str]
    kv_transfer: dict[str, Any] = field(default_factory=dict)  # vLLM's --kv-transfer-config, where written

    @property
    def exposed(self) -> dict[str, Any]:
        """The settings that decide what the deployment's servers bind and allow."""
        raise NotImplementedError

    def key_facts(self, seed: str | None) -> KeyFacts:
        """What makes this deployment's chunk keys, as its files say."""
        raise NotImplementedError

    def recipe(self, model: str, kv_dtype: str | None, model_dir: str | None, seed: str | None,
               world_size: int) -> KeyRecipe | MPKeyRecipe:
        raise NotImplementedError


@dataclass
class InProcessDeployment(Deployment):
    """LMCacheConnectorV1 inside vLLM: keys name the KV dtype; LMCACHE_* variables and defaults apply."""

    mode: ClassVar[str] = "inprocess"

    @property
    def exposed(self) -> dict[str, Any]:
        return self.settings

    def key_facts(self, seed: str | None) -> KeyFacts:
        dtype = self.env.get("KVCTL_KV_DTYPE")
        return KeyFacts(self.settings["chunk_size"], self.settings["pre_caching_hash_algorithm"], seed,
                        self.env.get("KVCTL_MODEL"), dtype_name(dtype) if dtype else None)

    def recipe(self, model: str, kv_dtype: str | None, model_dir: str | None, seed: str | None,
               world_size: int) -> KeyRecipe:
        if kv_dtype:
            dtype = dtype_name(kv_dtype)
        elif model_dir:
            dtype = kv_dtype_for_model(model_dir)
        else:
            raise UsageError(f"cannot tell the KV dtype of {model!r} (not a local directory)", hint="pass --kv-dtype")
        return KeyRecipe(model, self.settings["chunk_size"], self.settings["pre_caching_hash_algorithm"], seed, True,
                         self.settings["save_unfull_chunk"], world_size, 0, dtype)


@dataclass
class MPDeployment(Deployment):
    """An `lmcache server` and LMCacheMPConnector: its settings are the server's flags, defaults from
    LMCache's own parser; keys do not name the KV dtype."""

    mode: ClassVar[str] = "mp"

    @property
    def exposed(self) -> dict[str, Any]:
        return self.values

    def _setting(self, name: str) -> Any:
        return self.settings.get(name, mp_server_flags()[name]["default"])

    def key_facts(self, seed: str | None) -> KeyFacts:
        return KeyFacts(self._setting("chunk_size"), self._setting("hash_algorithm"), seed, self.env.get("KVCTL_MODEL"))

    def recipe(self, model: str, kv_dtype: str | None, model_dir: str | None, seed: str | None,
               world_size: int) -> MPKeyRecipe:
        return MPKeyRecipe(model, self._setting("chunk_size"), self._setting("hash_algorithm"), seed, world_size)


def read_deployment(config: str | os.PathLike) -> Deployment:
    from kvctl.core.lmcache.config import parse_kv_transfer_config

    files = locate(config)
    env = parse_env_file(read_text(files.env_path)) if files.env_path else {}
    kv_transfer = (parse_kv_transfer_config(read_text(files.kv_transfer_path), str(files.kv_transfer_path))
                   if files.kv_transfer_path else {})
    values = load_mapping(files.yaml_path) if files.yaml_path else {}
    if detect_mode(kv_transfer or None, values or None) == "mp":
        stores, notes = _mp_stores(values)
        return MPDeployment(env, values, values, stores, notes, kv_transfer)
    settings = effective_config(values, "file", {}, kv_transfer.get("kv_connector_extra_config") or {}, "vllm").values
    stores, notes = inprocess_stores(settings)
    return InProcessDeployment(env, values, settings, stores, notes, kv_transfer)


def inprocess_stores(settings: dict[str, Any]) -> tuple[list[Store], list[str]]:
    """The disk and Redis stores an in-process engine's effective settings name (its file's, or what
    a running engine's GET /conf answers), and a note for a remote tier kvctl does not read."""
    stores, notes = [], []
    if settings.get("local_disk") and settings.get("max_local_disk_size"):
        directories = [part.strip().removeprefix("file://") for part in str(settings["local_disk"]).split(",")]
        stores.append(Store("disk", "lmcache-disk", tuple(directories)))
    remote = str(settings.get("remote_url") or "")
    if remote.split("://")[0] in ("redis", "rediss", "redis-sentinel", "redis-cluster"):
        stores.append(Store("redis", "lmcache-redis", redis=parse_redis_url(remote)))
    elif remote:
        notes.append(f"the remote tier {remote.split('://')[0]}:// is not one kvctl reads directly")
    return stores, notes


def engine_deployment(conf: dict[str, Any], meta: dict[str, Any], env: dict[str, str] | None) -> Deployment:
    """What a running in-process engine says of itself through LMCache's own routes (GET /conf: every
    effective setting; /meta: model, KV dtype, world size; /env: PYTHONHASHSEED), as a configuration
    directory would say it: a stock engine needs no --config for its disk and Redis tiers."""
    stores, notes = inprocess_stores(conf)
    facts = {"KVCTL_MODEL": meta.get("model_name"),
             "KVCTL_KV_DTYPE": str(meta.get("kv_dtype") or "").removeprefix("torch.") or None,
             "PYTHONHASHSEED": (env or {}).get("PYTHONHASHSEED")}
    if env is None:
        notes.append("the engine's /env did not answer: its PYTHONHASHSEED is unknown")
    return InProcessDeployment({name: value for name, value in facts.items() if value}, conf, conf, stores, notes)


def target_from_config(config: str | os.PathLike, model: str | None, kv_dtype: str | None = None,
                       world_size: int = 1, hash_seed: str | None = None) -> Target:
    """The target described by a `kvctl config init` directory (or an lmcache.yaml)."""
    return target_from_deployment(read_deployment(config), model, kv_dtype, world_size, hash_seed)


def target_from_deployment(deployment: Deployment, model: str | None, kv_dtype: str | None = None,
                           world_size: int = 1, hash_seed: str | None = None) -> Target:
    """The key recipe and stores of a deployment, for `model` (else the one its env names)."""
    model = model or deployment.env.get("KVCTL_MODEL")
    if not model:
        raise UsageError("which model? chunk keys contain the model name vLLM was given",
                         hint="pass --model with the value of vLLM's --model (a directory or a hub id)")
    seed = hash_seed if hash_seed is not None else deployment.env.get("PYTHONHASHSEED")
    model_dir = model if Path(model).is_dir() else None
    notes = list(deployment.notes)
    if seed is None:
        notes.append("no PYTHONHASHSEED known for the serving process (env.sh sets none); assuming it was unset")
    recipe = deployment.recipe(model, kv_dtype or deployment.env.get("KVCTL_KV_DTYPE"), model_dir, seed, world_size)
    return Target(deployment.mode, recipe, deployment.stores, model_dir, notes)


def _mp_stores(values: dict[str, Any]) -> tuple[list[Store], list[str]]:
    stores, notes = [], []
    for adapter in values.get("l2_adapter") or []:
        adapter = json.loads(adapter) if isinstance(adapter, str) else adapter
        if adapter.get("type") == "fs":
            stores.append(Store("disk", "mp-fs", (adapter["base_path"],)))
        elif adapter.get("type") == "resp":
            stores.append(Store("redis", "mp-resp", redis=RedisURL(
                "redis", ((adapter["host"], int(adapter["port"])),), adapter.get("username") or None,
                adapter.get("password") or None)))
        else:
            notes.append(f"the {adapter.get('type')} L2 adapter is not one kvctl reads directly")
    notes.append(MP_L1_UNCHECKED)
    return stores, notes
