"""`kvctl evict` and `kvctl pin/unpin/pins` for an MP instance (`lmcache server`).

L1 (cpu) is listed through kvctl's MP routes (with each object's reader lock) and emptied with the
server's DELETE /cache/objects, which reports what it deleted and what it kept locked (/cache/clear
reports no counts and would take every model). L2 (fs, resp) is planned from what the stores
actually hold (only chunk files and chunk keys: stray files and foreign Redis keys never match)
and deleted through the server's own adapter, so its usage accounting stays right; what is gone is
checked afterwards. Pins live in the LMCache coordinator: they hold chunks in L2 only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvctl.core.cache.listing import disk_chunks, l1_entries, redis_tier_keys, stored_redis_keys
from kvctl.core.errors import ServerError, UsageError
from kvctl.core.instance.addresses import coordinator_url
from kvctl.core.instance.protocol import NoManagement
from kvctl.core.lmcache.deployment import Store
from kvctl.core.lmcache.keys import ObjectKey, given_object_keys, parse_object_key

if TYPE_CHECKING:
    from kvctl.core.cache.listing import Listing
    from kvctl.core.cache.lookup import LookupResult
    from kvctl.core.instance.protocol import CoordinatorPin, EvictionPlan, PinList, Selection, StoredChunk
    from kvctl.core.lmcache.key_facts import KeyFacts
    from kvctl.core.lmcache.tokens import PromptSource

ADAPTER_TYPES = {"mp-fs": "fs", "mp-resp": "resp"}
DELETE_BATCH = 10_000  # the most keys DELETE /cache/objects takes at once
UNLISTED_L2 = ("the MP server's L2 tiers were not {what}: its configuration is unknown (pass --config with its "
               "'kvctl config init' directory)")
NO_COORDINATOR = "pins are not supported in MP mode without an LMCache coordinator"
COORDINATOR_HINT = ("start 'lmcache coordinator' and pass --coordinator URL, or set 'coordinator: URL' in "
                    "kvctl.yaml")


@dataclass
class MPTarget:
    url: str  # the MP server's HTTP API
    stores: list[Store]  # its L2 stores, from its configuration
    model: str | None  # the model whose chunks a whole-tier eviction takes (None: the one registered)
    coordinator: str | None = None


def registered_model(server, model: str | None) -> tuple[str, int]:
    """(model, world size): the given model, or the only one vLLM has registered with the server."""
    models = {entry["model"]: entry["world_size"] for entry in server.info()["models"]}
    if model:
        return model, models.get(model, 1)
    if len(models) != 1:
        raise UsageError("which model? the server has "
                         f"{'registered ' + ', '.join(models) if models else 'no model registered'}",
                         hint="pass --model with the value of vLLM's --model")
    return next(iter(models.items()))


def coordinator_pins(url: str, model: str | None = None) -> list[dict[str, Any]]:
    """The coordinator's pinned keys ({"key": native key, "pin_count"}), of `model` or all."""
    from kvctl.clients.coordinator import CoordinatorClient

    with CoordinatorClient(url) as coordinator:
        return [{"key": ObjectKey.from_encoded(pin["key"]).native_key(), "pin_count": pin["pin_count"]}
                for pin in coordinator.pins(model)]


def evict(target: MPTarget, *, tiers: list[str] | None, dry_run: bool, force: bool = False,
          tokens: list[int] | None = None, keys: list[str] | None = None) -> dict[str, Any]:
    """Evict a prompt's chunks, given keys, or (neither) every chunk of the target's model, from the
    chosen tiers. Locked L1 objects and coordinator-pinned L2 chunks stay unless `force`."""
    from kvctl.clients.mp_server import MPServerClient

    present = ["cpu"] + [store.tier for store in target.stores]
    chosen = present if not tiers or "all" in tiers else tiers
    missing = [tier for tier in chosen if tier not in present]
    if missing:
        raise UsageError(f"this MP instance has no {', '.join(missing)} tier (it has {', '.join(present)})",
                         hint="kvctl ls shows its tiers")
    result: dict[str, Any] = {"dry_run": dry_run, "removed": {}, "skipped_pinned": {}, "chunks": []}
    with MPServerClient(target.url) as server:
        model = target.model if keys is not None else registered_model(server, target.model)[0]  # keys name theirs
        wanted = _wanted(server, model, tokens, keys)
        if "cpu" in chosen:
            _evict_l1(server, wanted, model, dry_run, force, result)
        pinned = {pin["key"] for pin in coordinator_pins(target.coordinator, None if keys is not None else model)} \
            if target.coordinator and not force else set()  # given keys may be of any model
        for store in target.stores:
            if store.tier in chosen:
                _evict_l2(server, store, wanted, model, pinned, dry_run, result)
    return result


def _wanted(server, model: str | None, tokens: list[int] | None, keys: list[str] | None) -> list[ObjectKey] | None:
    """The keys selected: a prompt's (the server's own keys, every object group and rank), given
    ones, or None for whole tiers."""
    if tokens is not None:
        answer = server.lookup(tokens, model)
        return [ObjectKey.from_encoded(key) for chunk in answer["chunks"] for key in chunk["keys"]]
    return None if keys is None else given_object_keys(keys)


def _evict_l1(server, wanted: list[ObjectKey] | None, model: str | None, dry_run: bool, force: bool,
              result: dict[str, Any]) -> None:
    entries = l1_entries(server, model if wanted is None else None)[0]
    if wanted is not None:
        selected = set(wanted)
        entries = [entry for entry in entries if ObjectKey.from_encoded(entry["key"]) in selected]
    going = [entry for entry in entries if force or not entry["locked"]]
    removed, skipped = len(going), len(entries) - len(going)
    if not dry_run:
        removed = 0
        for start in range(0, len(going), DELETE_BATCH):
            answer = server.delete_objects([entry["key"] for entry in going[start:start + DELETE_BATCH]],
                                           tier="l1", force=force)
            removed, skipped = removed + answer["deleted"], skipped + answer["skipped"]
    result["removed"]["cpu"], result["skipped_pinned"]["cpu"] = removed, skipped
    result["chunks"].extend({"tier": "cpu", "key": ObjectKey.from_encoded(entry["key"]).native_key()}
                            for entry in going)


def stored(store: Store, model: str | None, names: list[str] | None = None) -> list[str]:
    """The chunk keys an L2 store holds: all of `model`'s, or those of `names`."""
    if store.layout == "mp-fs":
        held = disk_chunks(store, model if names is None else None)
        return list(held) if names is None else [name for name in names if name in held]
    return redis_tier_keys(store, model) if names is None else stored_redis_keys(store, names)


def _evict_l2(server, store: Store, wanted: list[ObjectKey] | None, model: str | None, pinned: set[str],
              dry_run: bool, result: dict[str, Any]) -> None:
    held = stored(store, model, None if wanted is None else list(dict.fromkeys(key.native_key() for key in wanted)))
    going = [key for key in held if key not in pinned]
    if going and not dry_run:
        for start in range(0, len(going), DELETE_BATCH):
            answer = server.delete_objects([parse_object_key(key).encoded()
                                            for key in going[start:start + DELETE_BATCH]],
                                           tier="l2", adapter=ADAPTER_TYPES[store.layout])
            if not answer["ok"]:
                raise ServerError(f"the server's {ADAPTER_TYPES[store.layout]} adapter failed to delete: "
                                  f"{answer.get('error')}", hint="check the LMCache server's log")
        left = stored(store, model, going)
        if left:
            raise ServerError(f"{len(left)} of {len(going)} chunks are still in the {store.tier} tier after the "
                              f"server's delete (first: {left[0]})", hint="check the LMCache server's log")
    result["removed"][store.tier], result["skipped_pinned"][store.tier] = len(going), len(held) - len(going)
    result["chunks"].extend({"tier": store.tier, "key": key} for key in going)


class MPInstance(NoManagement):
    """A running `lmcache server`: its L1 (cpu) through its HTTP API and kvctl's MP routes, its L2
    stores from its configuration, pins through the LMCache coordinator (fleet-wide, L2 only)."""

    kind = "mp"
    pin_ids = False  # the coordinator counts pins per key, with no ids
    key_format = "mp-object"  # ObjectKey.native_key(): model@kv_rank@group@hash[@salt]

    def __init__(self, address, selector) -> None:
        if not address.mp_http:
            raise UsageError(f"the HTTP URL of the MP instance {address.name}'s server is unknown",
                             hint="pass --instance with the lmcache server's HTTP URL")
        self.address = address
        self.selector = selector
        self.name = address.name
        self.notes: list[str] = []

    @property
    def vllm_url(self) -> str | None:
        return self.address.vllm

    def model_name(self, model: str | None = None) -> str:
        from kvctl.clients.mp_server import MPServerClient

        with MPServerClient(self.address.mp_http) as server:
            return registered_model(server, model or self.selector.model or self.address.model)[0]

    def _world_size(self, model: str) -> int:
        from kvctl.clients.mp_server import MPServerClient

        with MPServerClient(self.address.mp_http) as server:
            return registered_model(server, model)[1]

    def tokenize(self, prompt: PromptSource, model: str | None = None) -> list[int]:
        from kvctl.core.lmcache.tokens import local_model_dir

        name = model or self.selector.model or self.address.model
        if not name and not prompt.tokens_file:  # only the server knows which model it serves
            name = self.model_name()
        return prompt.token_ids(model or local_model_dir(name), self.address.vllm, name)

    settle_s = 10.0  # the server writes L2 after answering: a report waits this long for every tier

    def lookup(self, tokens: list[int], model: str | None = None) -> LookupResult:
        """The L2 stores of the server's configuration read directly, joined by its L1 answer; L1 alone,
        and said so, when the configuration is unknown (as `list` does)."""
        from kvctl.core.cache.lookup import read_tiers
        from kvctl.core.lmcache.deployment import MP_L1_UNCHECKED, target_from_config

        if not self.address.config_dir:
            self.notes = [UNLISTED_L2.format(what="looked up")]
            return self._l1_lookup(tokens, model)
        chosen = self.selector
        target = target_from_config(self.address.config_dir, model or chosen.model or self.address.model,
                                    chosen.kv_dtype, chosen.world_size, chosen.hash_seed)
        self.notes = [note for note in target.notes if note != MP_L1_UNCHECKED]
        return read_tiers(tokens, target, self.address.mp_http)

    def _l1_lookup(self, tokens: list[int], model: str | None) -> LookupResult:
        """The server's own answer for its L1: its keys (every object group and rank), resident or not."""
        from kvctl_plugins.wire import hit_tokens

        from kvctl.clients.mp_server import MPServerClient
        from kvctl.core.cache.lookup import Chunk, LookupResult

        with MPServerClient(self.address.mp_http) as server:
            name, world_size = registered_model(server, model or self.selector.model or self.address.model)
            answer = server.lookup(tokens, name, world_size)
        chunks = [Chunk(chunk["index"], chunk["start"], chunk["end"],
                        ObjectKey.from_encoded(chunk["keys"][0]).native_key(), list(chunk["tiers"]))
                  for chunk in answer["chunks"]]
        presence = {"cpu": [bool(chunk.tiers) for chunk in chunks]}
        return LookupResult(name, "mp", answer["chunk_size"], len(tokens), chunks,
                            hit_tokens(presence, [chunk.end - chunk.start for chunk in chunks]), ["cpu"])

    def list(self, tiers: Sequence[str] | None, model: str | None, limit: int) -> Listing:
        from kvctl.core.cache.listing import collect, config_stores, from_mp_l1, selected, store_listers

        url, config_dir = self.address.mp_http, self.address.config_dir
        listers = {"cpu": lambda: from_mp_l1(url, limit, model)} if selected("cpu", tiers) else {}
        listing = collect({**listers, **store_listers(config_stores(config_dir), tiers, limit, model)})
        if not config_dir:
            listing.notes.append(UNLISTED_L2.format(what="listed"))
        return listing

    def _coordinator(self, required: bool = True) -> str | None:
        url = coordinator_url(self.selector.coordinator, self.address.config_dir, self.address.coordinator)
        if required and not url:
            raise UsageError(NO_COORDINATOR, hint=COORDINATOR_HINT)
        return url

    def _eviction_target(self, model: str | None) -> MPTarget:
        from kvctl.core.cache.listing import config_stores

        return MPTarget(self.address.mp_http, config_stores(self.address.config_dir),
                        model or self.selector.model or self.address.model,
                        self._coordinator(required=False))

    def plan_eviction(self, selection: Selection) -> EvictionPlan:
        from kvctl.core.instance.protocol import EvictionPlan

        chosen = {"tiers": list(selection.tiers) if selection.tiers else None, "force": selection.force,
                  "keys": list(selection.keys) if selection.keys is not None else None,
                  "tokens": list(selection.tokens) if selection.tokens is not None else None}
        return EvictionPlan.from_dict(evict(self._eviction_target(selection.model), dry_run=True, **chosen), selection)

    def execute_eviction(self, plan: EvictionPlan) -> EvictionPlan:
        """Each tier's planned keys through the server (L1's DELETE, the L2 adapters), checked afterwards."""
        from kvctl.core.instance.protocol import EvictionPlan, execute_plan

        target = self._eviction_target(plan.selection.model if plan.selection else None)
        return execute_plan(plan, lambda tier, keys: EvictionPlan.from_dict(
            evict(target, dry_run=False, tiers=[tier], force=plan.forced, keys=keys)))

    def _pin_call(self, action: str, tokens: list[int], model: str | None) -> CoordinatorPin:
        from kvctl.clients.coordinator import CoordinatorClient
        from kvctl.core.instance.protocol import CoordinatorPin, Unsupported

        if self.selector.fleet:
            raise Unsupported("MP pins live in the coordinator, for the whole fleet at once",
                              hint="pin once with --instance NAME of one MP instance")
        url = self._coordinator()
        name = self.model_name(model)
        with CoordinatorClient(url) as client:
            answer = getattr(client, action)(name, tokens, self._world_size(name))
        return CoordinatorPin(name, answer["requested"], answer["affected"], answer["status"])

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None,
            model: str | None = None) -> CoordinatorPin:
        from kvctl.core.instance.protocol import Unsupported

        if ttl_s is not None or tiers:
            raise Unsupported("MP pins (the coordinator's) hold a prompt's chunks in L2 until unpinned: no --ttl or "
                              "--tier", hint="drop --ttl and --tier")
        return self._pin_call("pin", tokens, model)

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None) -> CoordinatorPin:
        from kvctl.core.instance.protocol import Unsupported

        if pin_id or everything:
            raise Unsupported("the LMCache coordinator unpins by prompt only (its pins have no ids)",
                              hint="pass the prompt that was pinned (--prompt-file/--chat/--tokens-file)")
        return self._pin_call("unpin", tokens, model)

    def pin_scope(self) -> str:
        """Where this instance's pins live, fleet-wide: its coordinator (a pin set's ledger is kept per one)."""
        return self._coordinator()

    def pins(self, model: str | None = None) -> PinList:
        from kvctl.core.instance.protocol import PinList, PinnedKey

        held = coordinator_pins(self._coordinator(), model)
        return PinList([PinnedKey(pin["key"], pin["pin_count"]) for pin in held])

    def prefetch(self, tokens: list[int]) -> dict[str, int]:
        from kvctl.core.instance.protocol import Unsupported

        raise Unsupported("--from-tier needs an in-process instance with kvctl's routes",
                          hint="MP mode prefetches on its own when vLLM looks a prompt up; use plain prewarm there")

    # -- snapshots: L1's objects through kvctl's MP routes, under their native keys ----------------

    def key_facts(self, model: str | None = None) -> KeyFacts:
        """What the server makes keys with (/status), and the model, world size and KV dtype vLLM
        registered: no MP key names the dtype, but bytes of another dtype and the same size would load
        and be read as garbage. None where the server cannot name the model."""
        from kvctl.clients.mp_server import MPServerClient
        from kvctl.core.instance.running import read_running

        facts = read_running(self.address).facts
        with MPServerClient(self.address.mp_http) as server:
            models = {entry["model"]: entry for entry in server.info()["models"]}
        name = model or self.selector.model or self.address.model or (next(iter(models)) if len(models) == 1
                                                                       else None)
        registered = models.get(name, {})
        facts.model, facts.world_size, facts.kv_dtype = name, registered.get("world_size"), registered.get("kv_dtype")
        return facts

    def prompt_keys(self, tokens: list[int], model: str | None = None) -> list[str]:
        """The object keys the server makes for a prompt, chunk by chunk: every object group's and rank's."""
        from kvctl.clients.mp_server import MPServerClient

        with MPServerClient(self.address.mp_http) as server:
            name, world_size = registered_model(server, model or self.selector.model or self.address.model)
            answer = server.lookup(tokens, name, world_size)
        return [ObjectKey.from_encoded(key).native_key() for chunk in answer["chunks"] for key in chunk["keys"]]

    def read_chunks(self, keys: Sequence[str]) -> Iterator[StoredChunk]:
        from kvctl.clients.mp_server import MPServerClient
        from kvctl.core.instance.inprocess import client_chunks

        names = [key.native_key() for key in given_object_keys(list(keys))]
        with MPServerClient(self.address.mp_http) as server:
            yield from client_chunks(server, names)

    def write_chunks(self, chunks: Iterable[StoredChunk], tier: str | None = None) -> dict[str, dict[str, int]]:
        """Into L1 ("cpu"): the server's store policy copies them on to its L2 stores, as after any store."""
        from kvctl.clients.mp_server import MPServerClient
        from kvctl.core.instance.inprocess import batched_writes
        from kvctl.core.instance.protocol import Unsupported

        if tier not in (None, "cpu"):
            raise Unsupported(f"an MP server takes snapshot chunks into L1 (cpu) only, not {tier}: its L2 store "
                             "policy copies them on", hint="drop --tier (or pass --tier cpu)")
        with MPServerClient(self.address.mp_http) as server:
            return batched_writes(chunks, lambda _to, body: server.write_chunks(body))

    def stages_writes(self, tier: str | None = None) -> bool:
        return False  # each request's chunks are stored as it is answered

    def mp_server_url(self, feature: str) -> str:
        return self.address.mp_http
