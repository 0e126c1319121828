"""What a running instance says about itself: its key facts, environment, configuration and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvctl.core.errors import KvctlError
from kvctl.core.lmcache.key_facts import UNSET, KeyFacts

TIMEOUT_S = 10.0


# Per kind: what kvctl cannot do on a stock server (without its routes), and the one change that fixes it.
INPROCESS_WITHOUT_ROUTES = (
    "its CPU tier is not visible (ls and lookup show disk and Redis only; evict takes disk and Redis), and pins, "
    "prefetch, chunk bytes through the engine and the routes-token check do not work; stats, health, freeze, "
    "hot-cache, backends, conf and chunk-stats use LMCache's own routes and work",
    "load kvctl's plugins: \"kv_connector_module_path\": \"kvctl_plugins.vllm_connector\" in vLLM's "
    "--kv-transfer-config (kvctl plugins enable), or python -m kvctl_plugins.standalone")
MP_WITHOUT_ROUTES = (
    "its L1 (cpu) is not visible to ls and lookup, a prompt's L1 objects cannot be evicted and snapshots through "
    "the server do not work; stats, health, quota, reconfigure, checksums, pins through the coordinator and the "
    "L2 stores with --config work",
    "add --server-module '{\"module_path\": \"kvctl_plugins.mp_routes\"}' to its lmcache server command")


@dataclass
class Running:
    """What a running instance answered (None where it did not), and why not."""

    facts: KeyFacts
    without_routes: tuple[str, str]  # what kvctl loses on this kind without its routes, and the fix
    reads_lmcache_env: bool  # LMCACHE_* variables override its configuration file (in-process)
    counts_retrieves: bool  # its metrics count lookups and retrieves (in-process)
    env: dict[str, str] | None = None
    conf: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    routes: dict[str, Any] | None = None  # kvctl's /kvctl/v1/info, where its routes answer
    routes_absent: bool = False  # LMCache's own server without kvctl's plugins (a stock deployment)


def _routes(notes: list[str], server) -> tuple[dict[str, Any] | None, bool]:
    """(kvctl's /kvctl/v1/info, whether the server has no kvctl routes at all)."""
    from kvctl.core.errors import RoutesAbsent

    try:
        return server.info(), False
    except RoutesAbsent:
        return None, True
    except KvctlError as error:
        notes.append(f"kvctl's routes: {error.message}")
        return None, False


def _ask(notes: list[str], what: str, call):
    try:
        return call()
    except KvctlError as error:
        notes.append(f"{what}: {error.message}")
        return None


def read_running(address, timeout: float = TIMEOUT_S) -> Running:
    """The key facts, environment, configuration and metrics of a running instance (in-process: worker
    0's internal API server; MP: the lmcache server's HTTP API), plus vLLM's /version."""
    from kvctl.core.instance.addresses import identify
    from kvctl.core.lmcache.keys import dtype_name
    from kvctl.core.lmcache.metrics import lmcache_stats, merge_samples

    address = identify(address)
    notes: list[str] = []
    facts = KeyFacts()
    if address.mp_http:
        from kvctl.clients.mp_server import MPServerClient

        with MPServerClient(address.mp_http, timeout) as server:
            status = server.status()  # unreachable: the instance's failure
            facts.chunk_size, facts.hash_algorithm = status.get("chunk_size"), status.get("hash_algorithm")
            contexts = list((status.get("cache_context_meta") or {}).values())
            if contexts:
                facts.model, facts.world_size = contexts[0].get("model_name"), contexts[0].get("world_size")
            facts.lmcache_version = _ask(notes, "version", lambda: server.request("GET", "/lmc_version"))
            env = _ask(notes, "/env", lambda: server.request("GET", "/env"))
            routes, absent = _routes(notes, server)
            running = Running(facts, MP_WITHOUT_ROUTES, False, False, env if isinstance(env, dict) else None,
                              notes=notes, routes=routes, routes_absent=absent)
    else:
        from kvctl.clients.internal_api import InternalAPIClient

        if not address.worker:
            raise KvctlError(f"{address.name} names no internal API server", hint="give internal_api: URL")
        with InternalAPIClient(address.worker, timeout) as worker:
            facts.lmcache_version = worker.version()  # unreachable: the instance's failure
            conf = _ask(notes, "/conf", worker.conf) or {}
            meta = _ask(notes, "/meta", worker.meta) or {}
            env = _ask(notes, "/env", worker.env)
            metrics = _ask(notes, "/metrics", worker.metrics)
            routes, absent = _routes(notes, worker)
            if facts.vllm_version is None and not address.vllm:
                answer = _ask([], "/inference_version", lambda: worker.request("GET", "/inference_version"))
                facts.vllm_version = answer.get("vllm_version") if isinstance(answer, dict) else None
        facts.chunk_size, facts.hash_algorithm = conf.get("chunk_size"), conf.get("pre_caching_hash_algorithm")
        facts.model, facts.world_size = meta.get("model_name"), meta.get("world_size")
        if meta.get("kv_dtype"):
            try:
                facts.kv_dtype = dtype_name(str(meta["kv_dtype"]).removeprefix("torch."))
            except KvctlError:
                facts.kv_dtype = str(meta["kv_dtype"])
        stats = lmcache_stats(merge_samples([metrics]), None) if isinstance(metrics, str) else None
        running = Running(facts, INPROCESS_WITHOUT_ROUTES, True, True, env if isinstance(env, dict) else None,
                          conf or None, stats, notes, routes if isinstance(routes, dict) else None, absent)
    if running.env is not None:
        facts.hash_seed = running.env.get("PYTHONHASHSEED", UNSET)
    if address.vllm:
        from kvctl.clients.vllm import VLLMClient

        with VLLMClient(address.vllm, timeout) as vllm:
            answer = _ask(notes, "vLLM /version", lambda: vllm._call("GET", "/version"))
        facts.vllm_version = answer.get("version") if isinstance(answer, dict) else facts.vllm_version
    return running
