"""`kvctl stats`, `health` and `top`: whether every component of an instance answers (and how fast),
and what its servers' Prometheus metrics say about hits, usage, evictions and pins.

LMCache exports `lmcache:*` metrics from each process that runs an engine (worker r's internal API
server), its counters only every METRICS_EXPORT_S: kvctl's stats route reads them as of now, and /metrics
are the fallback, marked as such. vLLM exports `vllm:*` metrics on its OpenAI server. Both are parsed
with prometheus_client.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvctl.core.errors import ExitCode, KvctlError, RoutesAbsent, UnreachableError
from kvctl.core.lmcache.metrics import (
    METRICS_EXPORT_S,
    lmcache_stats,
    merge_samples,
    mp_server_stats,
    parse_metrics,
    ratio,
    vllm_stats,
)

HEALTH_TIMEOUT_S = 5.0


@dataclass
class Check:
    component: str  # "vllm", "internal_api[1]", "offload", "mp_server", "coordinator", "redis", "disk"
    target: str  # URL, socket or path
    ok: bool
    latency_ms: float | None
    detail: str


def probe(component: str, target: str, check: Callable[[], Any]) -> Check:
    """Run one check: what it returns, if text, is the detail; its exception (a kvctl error or an OS
    error) is the failure's."""
    start = time.perf_counter()
    try:
        answer = check()
    except (KvctlError, OSError) as error:
        return Check(component, target, False, None, getattr(error, "message", None) or str(error))
    latency_ms = round((time.perf_counter() - start) * 1000, 2)
    return Check(component, target, True, latency_ms, answer if isinstance(answer, str) else "ok")


def health_exit_code(checks: list[Check]) -> ExitCode:
    """0 when every component answers, 3 when none does, 6 when some do: usable as a probe."""
    failed = sum(not check.ok for check in checks)
    if not failed:
        return ExitCode.OK
    return ExitCode.UNREACHABLE if failed == len(checks) else ExitCode.PARTIAL


def disk_writable(directory: str) -> str:
    """Create and remove a file of kvctl's own in the tier's directory (nothing else is touched)."""
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvctl-health-"):
        pass
    usage = os.statvfs(directory)
    return f"writable, {usage.f_bavail * usage.f_frsize / 1024**3:.1f} GiB free"


def redis_ping(url) -> str:
    """Every server holding chunks answers (each primary of a cluster); the detail warns when the
    eviction policy can drop one of a chunk's two names and keep the other."""
    from kvctl.clients.redis_tier import RedisTier

    with RedisTier(url) as redis:
        detail = redis.ping()
        try:
            risk = redis.eviction_risk()
        except KvctlError:  # INFO may be renamed away; the server still answered
            risk = None
    return f"{detail}; warning: {risk}" if risk else detail


def redis_usage(store, model: str) -> dict[str, Any]:
    """A Redis tier as `stats` shows it: the chunks and bytes of `model` there (SCAN + STRLEN, no value
    read), against the server's maxmemory and its eviction policy."""
    from kvctl.clients.redis_tier import RedisTier
    from kvctl.core.cache.listing import EVERYTHING, redis_chunk_names, scan_chunks

    with RedisTier(store.redis) as redis:
        keys, total = scan_chunks(redis, store.layout, model, EVERYTHING)
        used = sum(redis.value_sizes([name for key in keys for name in redis_chunk_names(key, store.layout)]))
        memory = redis.memory()
    capacity = int(memory.get("maxmemory") or 0) or None
    return {"chunks": total, "used_bytes": used, "capacity_bytes": capacity, "usage": ratio(used, capacity),
            "server_used_bytes": memory.get("used_memory"), "maxmemory_policy": memory.get("maxmemory_policy")}


# -- metrics -----------------------------------------------------------------------------------------


def checks_as_dicts(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(check) for check in checks]


# -- one instance ----------------------------------------------------------------------------------


def instance_health(instance, shared_redis: str | None = None) -> list[Check]:
    """One check per component of an instance: vLLM, each internal API server, the offload socket,
    the MP server and its coordinator, and the disk and Redis tiers of its configuration."""
    from kvctl.clients.coordinator import CoordinatorClient
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.clients.mp_server import MPServerClient
    from kvctl.clients.offload import OffloadClient
    from kvctl.clients.vllm import VLLMClient
    from kvctl.core.instance.addresses import identify

    if instance.controller_only:
        from kvctl.core.instance.controller_only import controller_health

        return [probe("controller", f"{instance.controller} ({instance.name})",
                      lambda: controller_health(instance, HEALTH_TIMEOUT_S))]
    instance = identify(instance)
    checks = []
    if instance.vllm:
        checks.append(probe("vllm", instance.vllm, lambda: _call(VLLMClient(instance.vllm, HEALTH_TIMEOUT_S),
                                                                  VLLMClient.health)))
    for index, url in enumerate(instance.internal_api):
        role = "scheduler" if index == 0 and len(instance.internal_api) > 1 else f"worker {max(0, index - 1)}"
        checks.append(probe(f"internal_api ({role})", url, lambda url=url: _call(
            InternalAPIClient(url, HEALTH_TIMEOUT_S), lambda c: f"LMCache {c.version()}")))
    if instance.offload_socket:
        checks.append(probe("offload", instance.offload_socket,
                            OffloadClient(instance.offload_socket, HEALTH_TIMEOUT_S).health))
    if instance.mp_http:
        checks.append(probe("mp_server", instance.mp_http, lambda: _call(
            MPServerClient(instance.mp_http, HEALTH_TIMEOUT_S), MPServerClient.healthcheck)))
    coordinator = _coordinator(instance)
    if coordinator:
        checks.append(probe("coordinator", coordinator, lambda: _call(
            CoordinatorClient(coordinator, HEALTH_TIMEOUT_S), CoordinatorClient.healthz)))
    for store in _stores(instance, shared_redis):
        if store.tier == "disk":
            for directory in store.directories:
                checks.append(probe("disk", directory, lambda directory=directory: disk_writable(directory)))
        elif store.redis is not None:
            checks.append(probe("redis", store.redis.url(redact=True), lambda store=store: redis_ping(store.redis)))
    return checks


def _coordinator(instance) -> str | None:
    """The coordinator an MP instance's pins go to, as `kvctl pin` finds it (None: it has none)."""
    from kvctl.core.instance.mp import coordinator_url

    if not instance.mp_http:  # an in-process instance pins through its engine
        return None
    try:
        return coordinator_url(None, instance.config_dir, instance.coordinator)
    except KvctlError:
        return None  # an unreadable configuration is the disk check's to report


def _call(client, use):
    with client:
        return use(client)


def _stores(instance, shared_redis: str | None) -> list:
    """The disk and Redis stores of an instance: from its configuration directory, else from the engine."""
    from kvctl.core.cache.listing import config_stores, engine_redis_store
    from kvctl.core.lmcache.deployment import Store
    from kvctl.core.lmcache.tiers import parse_redis_url

    stores = config_stores(instance.config_dir)
    if not instance.config_dir and instance.worker:
        from kvctl.clients.internal_api import InternalAPIClient
        from kvctl.core.lmcache.deployment import inprocess_stores

        try:
            with InternalAPIClient(instance.worker, HEALTH_TIMEOUT_S) as worker:
                try:
                    tiers = {entry["tier"]: entry for entry in worker.info()["tiers"]}
                except RoutesAbsent:  # a stock engine: the stores its own /conf names
                    stores += inprocess_stores(worker.conf(["local_disk", "max_local_disk_size", "remote_url"]))[0]
                else:
                    if "disk" in tiers:
                        stores.append(Store("disk", "lmcache-disk", (tiers["disk"]["path"],)))
                    if "redis" in tiers:
                        stores.append(engine_redis_store(worker))
        except KvctlError:
            return []  # the worker's own check reports it
    if shared_redis and not any(store.tier == "redis" for store in stores):
        stores.append(Store("redis", "lmcache-redis", redis=parse_redis_url(shared_redis)))
    return stores


STOCK_FIGURES = ("kvctl's routes are absent: {what} from LMCache's own {source}; its /metrics are exported "
                 f"every {METRICS_EXPORT_S} s, so they can miss traffic that just happened")


def _engine_tiers(worker, notes: list[str]) -> dict[str, Any]:
    """Worker 0's tiers as kvctl's routes count them (chunks, bytes, capacity); on a stock engine, which
    has none, the tiers and capacities of its own /conf, whose usage then comes from /metrics."""
    try:
        return worker.info()
    except RoutesAbsent:
        pass
    conf = worker.conf(["max_local_cpu_size", "local_disk", "max_local_disk_size", "remote_url"])
    meta = worker.meta()
    gib = lambda value: int(float(value) * 1024**3)  # noqa: E731 - LMCache's sizes are in GB
    tiers = [{"tier": "cpu", "capacity_bytes": gib(conf.get("max_local_cpu_size") or 0)}]
    if conf.get("local_disk") and conf.get("max_local_disk_size"):
        tiers.append({"tier": "disk", "capacity_bytes": gib(conf["max_local_disk_size"])})
    if str(conf.get("remote_url") or "").split("://")[0] in ("redis", "rediss", "redis-sentinel", "redis-cluster"):
        tiers.append({"tier": "redis"})
    notes.append(STOCK_FIGURES.format(what="tier usage", source="/conf and /metrics"))
    return {"tiers": tiers, "model": meta.get("model_name"), "pins": None}


def _mp_l1(server, notes: list[str]) -> dict[str, Any]:
    """The MP server's L1 usage: kvctl's routes, else LMCache's own /status (the same figures)."""
    try:
        return server.info()
    except RoutesAbsent:
        pass
    managers = (server.status().get("storage_manager") or {}).get("l1_managers") or {}
    notes.append("kvctl's routes are absent: L1 usage from LMCache's own /status")
    return {"l1": managers}


def _live_counters(worker) -> dict[str, int] | None:
    """The engine's counters as of now from kvctl's stats route (None: an engine without it)."""
    try:
        return worker.live_counters()
    except RoutesAbsent:
        return None


def _sum_live(counters: list[dict[str, int] | None], notes: list[str]) -> dict[str, int] | None:
    """The live counters of every worker that answered, summed; /metrics' (None) unless all have them."""
    if counters and None not in counters:
        return {name: sum(each.get(name, 0) for each in counters) for name in counters[0]}
    if counters:
        notes.append(STOCK_FIGURES.format(what="lookup, retrieve, store, eviction and remote counts",
                                          source="/metrics"))
    return None


def _redis_tier_usage(worker, info: dict[str, Any], errors: dict[str, str]) -> dict[str, Any] | None:
    """The usage of a live engine's Redis tier, read from Redis itself; when Redis does not answer,
    `errors["redis"]` says so (LMCache's own remote metrics would go on showing old figures)."""
    from kvctl.core.cache.listing import engine_redis_store

    if not any(entry["tier"] == "redis" for entry in info.get("tiers", [])):
        return None
    try:
        return redis_usage(engine_redis_store(worker), info["model"])
    except KvctlError as error:
        errors["redis"] = error.message
        return None


def instance_stats(instance) -> dict[str, Any]:
    """Stats of one instance; a server that does not answer is named in `errors`, the rest still count."""
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.clients.vllm import VLLMClient
    from kvctl.core.instance.addresses import identify

    if instance.controller_only:
        from kvctl.core.instance.controller_only import controller_stats

        return controller_stats(instance)
    instance = identify(instance)
    errors: dict[str, str] = {}
    notes: list[str] = []
    texts, counters, info, redis = [], [], None, None
    for index, url in enumerate(instance.internal_api[1:] or instance.internal_api):
        try:
            with InternalAPIClient(url) as worker:
                texts.append(worker.metrics())
                counters.append(_live_counters(worker))
                if index == 0:
                    info = _engine_tiers(worker, notes)
                    redis = _redis_tier_usage(worker, info, errors)
        except KvctlError as error:
            errors[f"internal_api_worker_{index}"] = error.message
    stats: dict[str, Any] = {"instance": instance.name, "mode": instance.mode}
    if texts:
        stats["lmcache"] = lmcache_stats(merge_samples(texts), info, _sum_live(counters, notes))
        for tier in stats["lmcache"]["tiers"]:
            if tier["tier"] == "redis":
                tier.update(redis or {"chunks": None, "used_bytes": None})
    if instance.mp_http:
        from kvctl.clients.mp_server import MPServerClient

        try:
            with MPServerClient(instance.mp_http) as server:
                samples = parse_metrics(server.request("GET", "/metrics"))
                stats["lmcache"] = mp_server_stats(samples, _mp_l1(server, notes))
        except KvctlError as error:
            errors["mp_server"] = error.message
    if instance.vllm:
        try:
            with VLLMClient(instance.vllm) as vllm:
                stats["vllm"] = vllm_stats(parse_metrics(vllm.request("GET", "/metrics")))
        except KvctlError as error:
            errors["vllm"] = error.message
    stats["errors"] = errors
    stats["notes"] = notes
    if errors and "lmcache" not in stats and "vllm" not in stats:
        raise UnreachableError("nothing answered: " + "; ".join(errors.values()),
                               hint="check that the instance runs: kvctl health")
    return stats
