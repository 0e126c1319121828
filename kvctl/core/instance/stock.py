"""A running in-process engine without kvctl's routes: a stock LMCache engine (someone else's image, a
Helm chart, `python -m lmcache.v1.standalone`).

What LMCache's own routes serve goes through them (stats, freeze, hot cache, backends, conf, chunk
statistics: kvctl.core.admin.manage and kvctl.core.diagnose.observe ask the same worker URLs). Its disk and Redis
tiers are read and written directly, as a configuration's are; the configuration is --config, or else
what the engine says of itself (GET /conf, /meta, /env). The CPU tier lives in the engine's memory,
which only kvctl's routes can see: a lookup or a listing reports it as not visible (never as 0), and
what needs it (pins, prefetch, chunk bytes through the engine, evicting from it) is refused, naming
the route that is missing and the one line that adds it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from kvctl.core.errors import ExitCode
from kvctl.core.instance.offline import OfflineEvictionPlan, OfflineInstance, RunningEngine
from kvctl.core.instance.protocol import (
    EvictionPlan,
    Pin,
    PinList,
    Selection,
    StoredChunk,
    TierRemover,
    Unpinned,
    Unsupported,
)
from kvctl.core.lmcache.deployment import Deployment, read_deployment

if TYPE_CHECKING:
    from kvctl.core.cache.listing import Listing
    from kvctl.core.cache.lookup import LookupResult
    from kvctl.core.instance.address import Address

ROUTES_HINT = ("load kvctl's plugins into it: \"kv_connector_module_path\": \"kvctl_plugins.vllm_connector\" in "
               "vLLM's --kv-transfer-config (kvctl plugins enable), or python -m kvctl_plugins.standalone")


def not_visible(route: str) -> str:
    return f"not visible without kvctl's routes ({route} is missing on this engine); {ROUTES_HINT}"


def needs_routes(what: str, route: str) -> Unsupported:
    return Unsupported(f"{what} needs kvctl's routes, and this LMCache engine has none ({route} is missing)",
                       hint=ROUTES_HINT)


class StockEngineInstance(OfflineInstance):
    """A stock in-process engine: its stores read directly, its CPU tier not visible."""

    kind = "stock"

    def __init__(self, address, config_dir: str | os.PathLike | None = None, model: str | None = None,
                 kv_dtype: str | None = None, hash_seed: str | None = None, vllm_url: str | None = None) -> None:
        super().__init__(config_dir or address.config_dir, model, kv_dtype, 1, hash_seed, vllm_url or address.vllm)
        self.address, self.worker0, self.name = address, address.worker, address.name

    def engine_address(self, feature: str) -> Address:
        return self.address  # LMCache's own management routes serve a stock engine too

    @cached_property
    def _described(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, str] | None]:
        """(GET /conf, /meta, /env) of worker 0: what the engine says of itself (/env may be refused)."""
        from kvctl.clients.internal_api import InternalAPIClient
        from kvctl.core.errors import KvctlError

        with InternalAPIClient(self.worker0) as worker:
            conf, meta = worker.conf(), worker.meta()
            try:
                env = worker.env()
            except KvctlError:
                env = None
        return conf, meta, env if isinstance(env, dict) else None

    @cached_property
    def deployment(self) -> Deployment:
        from kvctl.core.lmcache.deployment import engine_deployment

        if self.config_dir is not None:
            return read_deployment(self.config_dir)
        return engine_deployment(*self._described)

    def _target(self, model: str | None):
        """The engine's own recipe: its model, KV dtype and world size (/meta) and hash seed (/env)
        unless given; chunk size, hashing and stores from --config or its /conf."""
        from kvctl.core.lmcache.deployment import target_from_deployment

        _conf, meta, env = self._described
        dtype = self.kv_dtype or str(meta.get("kv_dtype") or "").removeprefix("torch.") or None
        seed = self.hash_seed if self.hash_seed is not None else (env or {}).get("PYTHONHASHSEED")
        return target_from_deployment(self.deployment, self._known_model(model), dtype,
                                      int(meta.get("world_size") or 1), seed)

    def _known_model(self, model: str | None = None) -> str | None:
        return model or self.model or self._described[1].get("model_name")

    def lookup(self, tokens: list[int], model: str | None = None) -> LookupResult:
        result = super().lookup(tokens, model)
        result.errors["cpu"] = not_visible("POST /kvctl/v1/lookup")
        return result

    def list(self, tiers: Sequence[str] | None, model: str | None, limit: int) -> Listing:
        wanted = None if not tiers or "all" in tiers else [tier for tier in tiers if tier != "cpu"]
        listing = super().list(wanted, model, limit) if wanted != [] else _empty_listing()
        if not tiers or "all" in tiers or "cpu" in tiers:
            listing.errors["cpu"] = not_visible("GET /kvctl/v1/keys")
            listing.failure_code = ExitCode.REJECTED  # what the engine lacks, as RoutesAbsent is
        return listing

    def plan_eviction(self, selection: Selection) -> EvictionPlan:
        """The disk and Redis tiers, removed directly; the CPU tier, only whole, through LMCache's own
        DELETE /cache/clear (which counts what it removed only after, and skips pinned chunks). The
        engine's disk index still names an evicted file until it next reads it (LMCache 0.5.6 then
        drops the key and recomputes), so that is said."""
        from dataclasses import replace

        cpu = bool(selection.chosen(["cpu"]))
        if cpu and not selection.whole_tiers and "cpu" in (selection.tiers or ()):
            raise needs_routes("evicting a prompt's or given chunks from the CPU tier", "POST /kvctl/v1/evict")
        others = tuple(tier for tier in selection.tiers or ("all",) if tier != "cpu")
        nothing_else = not others or (others == ("all",) and not self.deployment.stores)  # a CPU-only engine
        plan = OfflineEvictionPlan() if nothing_else else super().plan_eviction(replace(selection, tiers=others))
        plan = replace(plan, selection=selection)
        if cpu and selection.whole_tiers:
            plan = replace(plan, cleared_whole=(*plan.cleared_whole, "cpu"))
            self.notes.append("the CPU tier is cleared whole through LMCache's DELETE /cache/clear (every model's "
                              "chunks on it; pinned ones stay): counted only after")
        elif cpu:
            self.notes.append("the CPU tier was not evicted: " + not_visible("POST /kvctl/v1/evict"))
        if "disk" in plan.removed:
            self.notes.append("the engine's disk index names an evicted file until it next reads it (LMCache then "
                              "drops the key): a lookup through it may count it until then")
        return plan

    def _tier_remover(self, selection: Selection) -> TierRemover:
        """The stores' removal, with the CPU tier cleared by the engine itself (tokens -> chunks)."""
        from kvctl.clients.internal_api import InternalAPIClient

        remove_stored = super()._tier_remover(selection)

        def remove(tier: str, keys: list[str]) -> EvictionPlan:
            if tier != "cpu":
                return remove_stored(tier, keys)
            with InternalAPIClient(self.worker0) as worker:
                removed = int(worker.clear(["LocalCPUBackend"]).get("num_removed") or 0)
            chunk = int(self.deployment.settings.get("chunk_size") or 256)
            return EvictionPlan({"cpu": -(-removed // chunk)}, {"cpu": 0}, dry_run=False)

        return remove

    def running_engine(self, model: str | None = None) -> RunningEngine:
        return RunningEngine(self.worker0, "of this configuration", self.worker0)

    def _refuse_if_running(self, tiers: Sequence[str], model: str | None = None) -> None:
        """The engine that runs is this one, and it has no route to evict through: its stores are
        evicted directly (plan_eviction says what that leaves in its disk index)."""

    def write_chunks(self, chunks: Iterable[StoredChunk], tier: str | None = None) -> dict[str, dict[str, int]]:
        """Into its Redis tier, which the engine reads afresh; its disk directory is indexed in its
        memory (a file written behind its back is never seen) and its CPU tier only kvctl's routes reach."""
        stores = [store.tier for store in self._snapshot_stores()]
        chosen = tier or stores[0]
        if chosen in ("cpu", "disk"):
            raise needs_routes(f"loading chunks into a running engine's {chosen} tier", "POST /kvctl/v1/chunks/write")
        return super().write_chunks(chunks, chosen)

    # -- what only kvctl's routes can do --------------------------------------------------------------

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None,
            model: str | None = None) -> Pin:
        raise needs_routes("pinning", "POST /kvctl/v1/pin")

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None) -> Unpinned:
        raise needs_routes("unpinning", "POST /kvctl/v1/unpin")

    def pins(self, model: str | None = None) -> PinList:
        raise needs_routes("listing pins", "GET /kvctl/v1/pins")

    def prefetch(self, tokens: list[int]) -> dict[str, int]:
        raise needs_routes("prefetching into the CPU tier", "POST /kvctl/v1/prefetch")


def _empty_listing() -> Listing:
    from kvctl.core.cache.listing import Listing

    return Listing([])
