"""LMCache's, its MP server's and vLLM's Prometheus metrics, read into kvctl's stats shape."""

from __future__ import annotations

from typing import Any

METRICS_EXPORT_S = 10  # LMCache's stats logger folds its counters into /metrics this often (0.5.6: fixed)


Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Samples:
    """Prometheus text → sample name (counters without `_total`) → [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket")):
                continue
            name = sample.name.removesuffix("_total") if family.type == "counter" else sample.name
            samples.setdefault(name, []).append((sample.labels, sample.value))
    return samples


def metric(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum over the label sets that match (None when the server does not export it)."""
    values = [value for found, value in samples.get(name, []) if all(found.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def ratio(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 4) if part is not None and whole else None


def merge_samples(texts: list[str]) -> Samples:
    merged: Samples = {}
    for text in texts:
        for name, values in parse_metrics(text).items():
            merged.setdefault(name, []).extend(values)
    return merged


def lmcache_stats(samples: Samples, info: dict[str, Any] | None, live: dict[str, int] | None = None) -> dict[str, Any]:
    """Hit rates (lookup vs retrieve), usage vs capacity per tier, evictions and pins of an engine. The
    counters come from `live` (kvctl's stats route: as of now) when given, else from /metrics, which can
    miss the last METRICS_EXPORT_S of traffic; each group of counters says which (source, max_age_s)."""
    m = lambda name: metric(samples, f"lmcache:{name}")  # noqa: E731
    c = m if live is None else live.get
    origin = ({"source": "metrics", "max_age_s": METRICS_EXPORT_S} if live is None
              else {"source": "live", "max_age_s": 0})
    lookup_tokens, lookup_hits = c("num_lookup_tokens"), c("num_lookup_hits")
    requested, hit = c("num_requested_tokens"), c("num_hit_tokens")
    tiers = []
    usage_metric = {"cpu": "local_cache_usage", "disk": "local_storage_usage", "redis": "remote_cache_usage"}
    for entry in (info or {}).get("tiers", []):
        used = entry.get("used_bytes", m(usage_metric.get(entry["tier"], "")))
        capacity = entry.get("capacity_bytes")
        tiers.append({"tier": entry["tier"], "chunks": entry.get("keys"), "used_bytes": used,
                      "capacity_bytes": capacity, "usage": ratio(used, capacity)})
    return {
        "lookup": {"requests": c("num_lookup_requests"), "tokens": lookup_tokens, "hit_tokens": lookup_hits,
                   "hit_rate": ratio(lookup_hits, lookup_tokens), **origin},
        "retrieve": {"requests": c("num_retrieve_requests"), "tokens": requested, "hit_tokens": hit,
                     "hit_rate": ratio(hit, requested), **origin},
        "store": {"requests": c("num_store_requests"), "tokens": c("num_stored_tokens"), **origin},
        "tiers": tiers,
        "evictions": {"cpu": c("local_cpu_evict_count"), "cpu_failed": c("local_cpu_evict_failed_count"), **origin},
        "remote": {"read_requests": c("num_remote_read_requests"), "read_bytes": c("num_remote_read_bytes"),
                   "write_requests": c("num_remote_write_requests"), "write_bytes": c("num_remote_write_bytes"),
                   **origin},
        "pins": {"kvctl": (info or {}).get("pins"), "pinned_objects": m("pinned_memory_objs_count"),
                 "pin_monitor": m("pin_monitor_pinned_objects_count"), "forced_unpins": m("forced_unpin_count")},
        "healthy": m("lmcache_is_healthy"),
    }


def mp_server_stats(samples: Samples, info: dict[str, Any]) -> dict[str, Any]:
    """The MP server's view in the same shape as an engine's: its lookups carry the hits (per tier),
    L1 is the cpu tier. Counter names are OpenTelemetry's, exported with their unit."""
    m = lambda name, **labels: metric(samples, f"lmcache_mp_{name}", **labels)  # noqa: E731
    requested, hit = m("lookup_requested_tokens"), m("lookup_hit_tokens")
    tiers = [{"tier": "cpu" if tag == "_default" else f"cpu:{tag}", "chunks": l1.get("total_object_count"),
              "used_bytes": l1.get("memory_used_bytes"), "capacity_bytes": l1.get("memory_total_bytes"),
              "usage": l1.get("memory_usage_ratio")} for tag, l1 in (info.get("l1") or {}).items()]
    tiers += [{"tier": f"l2:{labels.get('l2_name')}", "chunks": None, "used_bytes": value, "capacity_bytes": None,
               "usage": None} for labels, value in samples.get("lmcache_mp_l2_usage_bytes", [])]
    return {
        "lookup": {"requests": m("lookups_requests"), "tokens": requested, "hit_tokens": hit,
                   "hit_rate": ratio(hit, requested), "hit_tokens_by_tier": {
                       "cpu": m("lookup_hit_l1_tokens"), "l2": m("lookup_hit_l2_tokens")}},
        "retrieve": {"requests": m("num_finished_retrieves"), "tokens": None, "hit_tokens": None, "hit_rate": None},
        "store": {"requests": m("num_finished_stores"), "tokens": None},
        "tiers": tiers,
        "evictions": {"cpu": m("l1_evicted_chunks"), "cpu_failed": None, "l2": m("l2_evicted_objects_chunks")},
        "remote": None,
        "pins": None,
        "healthy": None,
    }


def vllm_stats(samples: Samples) -> dict[str, Any]:
    """vLLM's own prefix cache and what the connector (LMCache) brought in."""
    v = lambda name, **labels: metric(samples, f"vllm:{name}", **labels)  # noqa: E731
    by_source = {labels.get("source", "?"): value for labels, value in samples.get("vllm:prompt_tokens_by_source", [])}
    return {
        "prefix_cache": {"queries": v("prefix_cache_queries"), "hits": v("prefix_cache_hits"),
                         "hit_rate": ratio(v("prefix_cache_hits"), v("prefix_cache_queries"))},
        "external_cache": {"queries": v("external_prefix_cache_queries"), "hits": v("external_prefix_cache_hits"),
                           "hit_rate": ratio(v("external_prefix_cache_hits"), v("external_prefix_cache_queries"))},
        "prompt_tokens": v("prompt_tokens"),
        "prompt_tokens_by_source": by_source,
        "kv_cache_usage": v("kv_cache_usage_perc"),
        "requests_running": v("num_requests_running"),
        "requests_waiting": v("num_requests_waiting"),
    }
