"""`kvctl doctor --instance controller://…`: what silently empties or blinds a fleet on LMCache's
controller, each a complaint in LMCache's and production-stack's trackers, and the drift between the
controller's index and what the instances really hold.

The controller's own answers (its registry, index counts, /env) and, when it runs on this host, its
process (command line, the LMCache it loaded: its HTTP API reports no version) are compared with what each
live instance says of itself (its /conf, /lmc_version, and kvctl's routes where they answer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvctl.core.diagnose.findings import Finding
from kvctl.core.errors import KvctlError
from kvctl.core.instance.controller_only import CONTROLLER_CHUNK, UNREACHED_HINT

RANDOM_ID = re.compile(r"lmcacheengineconfig_[0-9a-f]{32}")  # what LMCache makes up when no id is set
DEFAULT_WORKER_TIMEOUT_S = 300.0  # lmcache_controller --lmcache-worker-timeout
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MEMBER_KEYS = ["lmcache_instance_id", "lmcache_worker_heartbeat_time", "pre_caching_hash_algorithm", "chunk_size"]


def controller_findings(fleet: str, members: list) -> list[Finding]:
    """Findings over a controller fleet: `members` are its discovered addresses (instance.controller_fleet)."""
    from kvctl.clients.controller import ControllerClient
    from kvctl.core.lmcache.controller import DISCOVERY_TIMEOUT_S, http_url

    url = http_url(fleet)
    try:
        with ControllerClient(url, DISCOVERY_TIMEOUT_S) as controller:
            indexed = controller.key_counts()
            registry = {address.name: controller.workers(address.name) for address in members}
            environment = controller.request("GET", "/env")
    except KvctlError as error:
        return [Finding("error", "controller", f"the controller at {url} did not answer: {error.message}",
                        "no fleet view: discovery, routing and the index are unavailable", error.hint)]
    findings = _shared_addresses(registry)
    seed = environment.get("PYTHONHASHSEED") if isinstance(environment, dict) else None
    controller = local_controller(url)
    versions: dict[str, str] = {}
    for address in members:
        held = sum(count for (instance, _worker), count in indexed.items() if instance == address.name)
        if address.problem:
            if held:
                findings.append(Finding("warning", "controller_drift", f"the controller still indexes {held} chunks "
                                        f"of {address.name}, which is not reachable: {address.problem}",
                                        "its /lookup keeps naming an instance that cannot serve them, and shadows "
                                        "live holders (one holder per chunk)", address.hint, address.name))
            continue
        if address.controller_only:
            findings.append(Finding("info", "controller_only", f"{address.name} is registered, but its internal API "
                                    "is not where kvctl's configurations put it: only the controller answers for it "
                                    f"(health, its index: {held} chunks, pin, clearing its CPU tier)",
                                    "its heartbeats, hashing, seed and drift are not checked",
                                    UNREACHED_HINT, address.name))
            continue
        findings += _member_findings(address, held, seed, controller, versions)
    return findings + version_findings(controller.lmcache_version, versions)


@dataclass(frozen=True)
class ControllerProcess:
    """What the controller's HTTP API does not say, read from its process when it runs here."""
    lmcache_version: str | None = None
    worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S


def local_controller(url: str) -> ControllerProcess:
    """The controller's LMCache version and worker timeout, when a process of this user listens on its
    port: its command line (lmcache_controller's --lmcache-worker-timeout always overrides the config and
    the environment) and the LMCache it loaded."""
    from kvctl.core.diagnose.local_process import command_line, listening_pid, loaded_lmcache_version

    parts = urlsplit(url)
    pid = listening_pid(parts.port) if parts.hostname in LOOPBACK and parts.port else None
    if pid is None:
        return ControllerProcess()
    argv, timeout = command_line(pid), None
    for index, part in enumerate(argv):
        if part == "--lmcache-worker-timeout" and index + 1 < len(argv):
            timeout = _seconds(argv[index + 1])
        elif part.startswith("--lmcache-worker-timeout="):
            timeout = _seconds(part.partition("=")[2])
    return ControllerProcess(loaded_lmcache_version(pid), timeout or DEFAULT_WORKER_TIMEOUT_S)


def _seconds(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if 0 < value < 10**9 else None


def version_findings(controller_version: str | None, versions: dict[str, str]) -> list[Finding]:
    """The controller's and the engines' LMCache versions: its worker messages are version-coupled, and a
    controller on another version rejects a worker's registration (production-stack PR #1060)."""
    cost = ("the controller and its workers speak version-coupled messages: a mismatched worker is rejected at "
            "registration or misread, and drops out of the index")
    hint = "run the controller from the engines' environment (kvctl serve --controller does)"
    if controller_version is None:
        return [Finding("info", "controller_version", "the controller's LMCache version is unknown: its HTTP API "
                        "reports none, and it is not a process of this user on this host", cost, hint)]
    others = {name: version for name, version in versions.items() if version != controller_version}
    if not others:
        return []
    return [Finding("error", "controller_version", f"the controller runs LMCache {controller_version}; "
                    + ", ".join(f"{name} runs {version}" for name, version in sorted(others.items())), cost, hint)]


def _shared_addresses(registry: dict[str, list[dict[str, Any]]]) -> list[Finding]:
    """Cache-owning instances behind one address: the controller tells instances apart by IP."""
    by_ip: dict[str, set[str]] = {}
    for instance, workers in registry.items():
        for worker in workers:
            by_ip.setdefault(str(worker.get("ip")), set()).add(instance)
    return [Finding("warning", "controller_address", f"{len(names)} instances register from {ip}: "
                    f"{', '.join(sorted(names))}", "the controller tells instances apart by IP: its /query_instance "
                    "and P2P transfers take one for another", "give each cache-owning instance its own address "
                    "(a pod, a host), or rely on kvctl's routing (kvctl lookup --instance controller://…)")
            for ip, names in sorted(by_ip.items()) if len(names) > 1]


def _member_findings(address, indexed: int, controller_seed: str | None, controller: ControllerProcess,
                     versions: dict[str, str]) -> list[Finding]:
    """One registered engine's findings; its LMCache version goes into `versions`."""
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.core.errors import RoutesAbsent

    name = address.name
    findings: list[Finding] = []
    try:
        with InternalAPIClient(address.worker, 10.0) as engine:
            conf = engine.conf(MEMBER_KEYS)
            env = engine.env()
            versions[name] = str(engine.version())
            try:
                tiers = engine.info().get("tiers", [])
            except RoutesAbsent:
                tiers = None
    except KvctlError as error:
        return [Finding("info", "controller", f"{name} could not be read: {error.message}", "its checks did not "
                        "run", error.hint, name)]
    beat = _seconds(conf.get("lmcache_worker_heartbeat_time"))
    if beat is None:
        findings.append(Finding("error", "controller_heartbeats", f"{name} sends the controller no heartbeats "
                                "(lmcache_worker_heartbeat_time unset)", "the controller cannot tell it is alive: "
                                "once stopped it stays registered, indexed and asked (its /health hangs)",
                                "set lmcache_worker_heartbeat_time: 5 (kvctl config init --controller does)", name))
    elif beat >= controller.worker_timeout_s:
        findings.append(Finding("warning", "controller_heartbeats", f"{name} beats every {beat:g} s, the controller "
                                f"times workers out after {controller.worker_timeout_s:g} s",
                                "once the controller's health checks are on (--health-check-interval), it "
                                "deregisters the live instance between two heartbeats and drops its index",
                                "set lmcache_worker_heartbeat_time well below the controller's "
                                "--lmcache-worker-timeout (5 s, as kvctl config init --controller does)", name))
    if RANDOM_ID.fullmatch(str(conf.get("lmcache_instance_id") or "")):
        findings.append(Finding("warning", "controller_instance_id", f"{name} has an instance id LMCache made up",
                                "not stable across restarts: a restarted engine registers as a new instance while "
                                "the old one lingers, indexed and stale", "set lmcache_instance_id (kvctl config "
                                "init takes it from the directory name)", name))
    algorithm, chunk = conf.get("pre_caching_hash_algorithm"), conf.get("chunk_size")
    if algorithm != "builtin" or chunk != CONTROLLER_CHUNK:
        findings.append(Finding("warning", "controller_lookup", f"{name} hashes with {algorithm} and chunk size "
                                f"{chunk}; the controller's /lookup with builtin and {CONTROLLER_CHUNK} only",
                                "the controller's index answers nothing for its chunks: a router asking it never "
                                "routes to the holder", "kvctl lookup --instance controller://… asks the instances "
                                "themselves; or use --hash-algorithm builtin --chunk-size 256", name))
    elif isinstance(env, dict) and env.get("PYTHONHASHSEED") != controller_seed:
        findings.append(Finding("warning", "controller_seed", f"{name} runs with PYTHONHASHSEED "
                                f"{env.get('PYTHONHASHSEED')!r}, the controller with {controller_seed!r}",
                                "builtin hashing differs between them: the controller's /lookup names no holder",
                                "start the controller and every engine with the same PYTHONHASHSEED", name))
    if tiers is not None:
        held = sum(int(tier.get("keys") or 0) for tier in tiers if tier.get("tier") in ("cpu", "disk"))
        if held != indexed:
            findings.append(Finding("warning", "controller_drift", f"the controller indexes {indexed} chunks of "
                                    f"{name}; it holds {held} on its CPU and disk tiers",
                                    "routing by the controller's index sends requests where the chunks are not, or "
                                    "away from where they are", "the index catches up on the next full sync; "
                                    "kvctl lookup --instance controller://… shows the instances' own answers", name))
    return findings
