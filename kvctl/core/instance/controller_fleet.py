"""A fleet from LMCache's controller (in-process mode): `--instance controller://HOST:PORT`, or
`controller: http://HOST:PORT` in kvctl.yaml, instead of a list kept by hand.

The controller knows each registered worker by instance id, worker id, its host's primary address
and the port it listens on for the controller, not where its internal API is. kvctl's own
configurations (`kvctl config init --controller`) fix the relation: worker r's controller port is its
internal API port + WORKER_PORT_OFFSET; an address of this host reads as loopback (kvctl binds the
internal API to 127.0.0.1). Every URL found that way is checked before it is used: the engine's own
GET /conf must name the registration's instance id. An instance whose last heartbeat is older than
the stale limit is reported stale and never asked as if alive (the controller keeps a dead instance
registered, and its /health hangs on one); one whose internal API is elsewhere is answered for by the
controller alone (kvctl.core.instance.controller_only), each answer saying so.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvctl.core.errors import KvctlError
from kvctl.core.instance.address import Address
from kvctl.core.lmcache.controller import DISCOVERY_TIMEOUT_S, WORKER_PORT_OFFSET, http_url, stale_limit

DISCOVERY_WIDTH = 32  # engines checked at once


@dataclass(frozen=True)
class Registration:
    """One instance as the controller lists it: its workers' (worker id, ip, controller port), and the
    age of its freshest heartbeat (or registration)."""

    instance_id: str
    workers: tuple[tuple[int, str, int], ...]
    heartbeat_age_s: float

    @classmethod
    def group(cls, infos: list[dict[str, Any]], now: float) -> list[Registration]:
        by_instance: dict[str, list[dict[str, Any]]] = {}
        for info in infos:
            by_instance.setdefault(str(info["instance_id"]), []).append(info)
        registrations = []
        for instance_id, workers in sorted(by_instance.items()):
            last = max(float(w.get("last_heartbeat_time") or w.get("registration_time") or 0) for w in workers)
            registrations.append(cls(instance_id, tuple(sorted((int(w["worker_id"]), str(w["ip"]), int(w["port"]))
                                                               for w in workers)), max(0.0, now - last)))
        return registrations

    def internal_api(self, local: set[str]) -> str:
        """Worker 0's internal API by kvctl's relation (the first registered worker's, minus its rank)."""
        worker_id, ip, port = self.workers[0]
        host = "127.0.0.1" if ip in local else (f"[{ip}]" if ":" in ip else ip)
        return f"http://{host}:{port - WORKER_PORT_OFFSET - worker_id}"


def local_addresses() -> set[str]:
    """This host's IPv4 addresses (what LMCache's get_ip() advertises is one of them), and loopback."""
    import fcntl
    import socket
    import struct

    found = {"127.0.0.1", "::1", "localhost"}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue  # an interface without an IPv4 address
            found.add(socket.inet_ntoa(packed[20:24]))
    return found


def discover(instance: str):
    """The controller's registered instances as addresses: reachable ones with their internal API,
    the others carrying why not (stale, or an internal API kvctl cannot find)."""
    from kvctl.clients.controller import ControllerClient

    url, stale_after_s = http_url(instance), stale_limit(instance)
    with ControllerClient(url, DISCOVERY_TIMEOUT_S) as controller:
        ids = controller.instance_ids()
    local = local_addresses()

    def address(instance_id: str) -> Address:
        with ControllerClient(url, DISCOVERY_TIMEOUT_S) as controller:
            infos = controller.workers(instance_id)  # its heartbeats as of now
        if not infos:
            return Address(instance_id, controller=url, problem="the controller lists it without workers (it left "
                           "while kvctl asked)", hint="run the command again")
        (registration,) = Registration.group(infos, time.time())
        age = round(registration.heartbeat_age_s, 1)
        found = Address(registration.instance_id, controller=url, heartbeat_age_s=age)
        if registration.heartbeat_age_s > stale_after_s:
            found.problem = (f"stale: its last heartbeat reached the controller {registration.heartbeat_age_s:.0f} s "
                             f"ago (the limit is {stale_after_s:g} s); the controller still lists it and indexes its "
                             "chunks")
            found.hint = ("start it again, or check lmcache_worker_heartbeat_time (kvctl config init --controller "
                          "sets 5)")
            return found
        api = registration.internal_api(local)
        if _answers_as(api, registration.instance_id):
            found.internal_api = [api]  # else the controller answers for it (kvctl.core.instance.controller_only)
        return found

    with ThreadPoolExecutor(max_workers=DISCOVERY_WIDTH) as pool:
        return list(pool.map(address, sorted(ids)))


def _answers_as(url: str, instance_id: str) -> bool:
    """Whether the engine at `url` is the registered instance (its own GET /conf names the id)."""
    from kvctl.clients.internal_api import InternalAPIClient

    try:
        with InternalAPIClient(url, DISCOVERY_TIMEOUT_S) as engine:
            return engine.conf(["lmcache_instance_id"]).get("lmcache_instance_id") == instance_id
    except (KvctlError, AttributeError):
        return False


# -- the routing question: which instance holds the longest cached prefix ---------------------------

CONTROLLER_HASHING = ("the controller's /lookup hashes tokens with builtin and chunk size 256 only: chunks keyed "
                      "otherwise are invisible to its index")


def routing(instance: str, outcomes: list, tokens: list[int] | None) -> dict[str, Any]:
    """Which instance holds the longest cached prefix of a prompt, from the instances' own lookups
    (`outcomes` of a fleet lookup), next to the controller's index answer, and where they disagree
    (an indexed instance that is stale or gone, one that holds what the index does not name)."""
    from kvctl.clients.controller import ControllerClient

    answered = {outcome.instance: int(outcome.result.hit_tokens.get("total") or 0)
                for outcome in outcomes if outcome.error is None}
    failed = {outcome.instance: outcome.error for outcome in outcomes if outcome.error is not None}
    best = max(answered, key=answered.get, default=None)
    summary: dict[str, Any] = {"best": {"instance": best, "hit_tokens": answered[best]}
                               if best is not None and answered[best] > 0 else None,
                               "controller_index": None, "disagreements": []}
    if tokens is None:
        summary["disagreements"].append("no instance tokenized the prompt: the controller's index was not asked")
        return summary
    try:
        with ControllerClient(http_url(instance), DISCOVERY_TIMEOUT_S) as controller:
            index = controller.lookup(tokens)
    except KvctlError as error:
        summary["disagreements"].append(f"the controller's index did not answer: {error.message}")
        return summary
    summary["controller_index"] = {name: {"location": location, "tokens": end} for name, (location, end)
                                   in index.items()}
    notes = summary["disagreements"]
    for name, (location, end) in index.items():
        if name in failed:
            notes.append(f"the controller's index names {name} ({end} tokens on {location}), which did not answer "
                         f"here: {failed[name]}")
        elif name in answered and answered[name] < end:
            notes.append(f"the controller's index says {name} holds {end} tokens; it holds {answered[name]}")
    unindexed = [name for name, hits in answered.items() if hits > 0 and name not in index]
    for name in unindexed:
        notes.append(f"{name} holds {answered[name]} tokens the controller's index does not name "
                     f"({CONTROLLER_HASHING}; it also names one holder per chunk)")
    return summary
