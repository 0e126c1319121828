"""`kvctl doctor`: why would this deployment miss? Findings over one running instance, a configuration
directory (no engine) or a whole fleet, each with what it costs and what to do.

Every check is a small function that returns findings; the pure ones (comparisons of facts, Redis INFO
sections, metrics) take plain data, the others read one thing (a directory, a Redis server, a running
engine's /conf, /meta, /env, /metrics). A check that cannot run says why in an info finding.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.core.diagnose.findings import Finding, Report, did_not_run
from kvctl.core.errors import KvctlError
from kvctl.core.instance.running import TIMEOUT_S, Running, read_running
from kvctl.core.lmcache.key_facts import KEY_FIELDS, UNSET, VERSION_FIELDS, KeyFacts

REDIS_HEADROOM = 0.9  # used_memory above this share of maxmemory is a warning


# -- key compatibility ---------------------------------------------------------------------------


def _show(value: Any) -> str:
    return UNSET if value is None else str(value)


def _split_cost(groups: dict[str, list[str]]) -> str:
    """`a will never hit b's chunks` for two members; the groups for more."""
    names = [sorted(members) for members in groups.values()]
    if len(names) == 2 and len(names[0]) == 1 and len(names[1]) == 1:
        a, b = names[0][0], names[1][0]
        return f"{a} will never hit {b}'s chunks, nor {b} {a}'s, in any shared tier"
    shown = " | ".join(", ".join(group) for group in names)
    return f"members in different groups ({shown}) make different keys: none hits another group's chunks"


def compare_members(members: dict[str, KeyFacts]) -> list[Finding]:
    """Across a fleet: a key ingredient that differs is an error (shared tiers never hit); versions out
    of lockstep a warning; a PYTHONHASHSEED known to be unset where it matters an error."""
    findings = []
    for name, facts in members.items():
        if facts.hash_seed == UNSET and facts.seed_matters():
            findings.append(Finding("error", "key_compatibility", f"PYTHONHASHSEED is unset in the serving process "
                                    f"(hash {facts.hash_algorithm or 'builtin'})",
                                    f"{name}'s keys change with every restart: it never hits what it stored before, "
                                    "and no peer hits its chunks", KEY_FIELDS["hash_seed"][1], name))
    for table, level in ((KEY_FIELDS, "error"), (VERSION_FIELDS, "warning")):
        for name_of_field, (label, hint) in table.items():
            known = {name: getattr(facts, name_of_field) for name, facts in members.items()
                     if getattr(facts, name_of_field) is not None
                     and (name_of_field != "hash_seed" or facts.seed_matters())}
            groups: dict[str, list[str]] = {}
            for name, value in known.items():
                groups.setdefault(str(value), []).append(name)
            if len(groups) < 2:
                continue
            values = ", ".join(f"{name}={_show(value)}" for name, value in known.items())
            cost = (_split_cost(groups) if level == "error" else
                    "the key recipe, on-store layouts and wire formats may differ between versions")
            findings.append(Finding(level, "key_compatibility" if level == "error" else "version_lockstep",
                                    f"{label} differs across members: {values}", cost, hint))
    return findings


def key_differences(first: KeyFacts, second: KeyFacts,
                    fields: Iterable[str] = KEY_FIELDS) -> list[tuple[str, Any, Any]]:
    """(field, first's value, second's) for each key ingredient of `fields` both know and that differs, in
    that order; PYTHONHASHSEED only where both hash with it."""
    found = []
    for name_of_field in fields:
        mine, theirs = getattr(first, name_of_field), getattr(second, name_of_field)
        if mine is None or theirs is None or str(mine) == str(theirs):
            continue
        if name_of_field == "hash_seed" and not (first.seed_matters() and second.seed_matters()):
            continue
        found.append((name_of_field, mine, theirs))
    return found


def compare_with_config(running: KeyFacts, config: KeyFacts, config_name: str, instance: str | None = None,
                        skip: frozenset[str] = frozenset()) -> list[Finding]:
    """One instance's running values against its configuration directory's files (warnings)."""
    findings = []
    for name_of_field, live, written in key_differences(running, config):
        if name_of_field in skip:
            continue
        label, hint = KEY_FIELDS[name_of_field]
        findings.append(Finding("warning", "config_drift", f"{label}: the running process has {_show(live)}, "
                                f"{config_name} says {_show(written)}",
                                "offline lookups, evictions and every peer built from these files compute other keys "
                                "than the running engine stores", f"restart from the configuration, or fix it; {hint}",
                                instance))
    return findings


# -- LMCACHE_* overrides ---------------------------------------------------------------------------


def env_overrides(environ: dict[str, str], file_values: dict[str, Any], effective: dict[str, Any] | None,
                  file_name: str = "lmcache.yaml", instance: str | None = None) -> list[Finding]:
    """LMCACHE_* variables of the running process that LMCache reads over the file: a warning where the
    file sets the key to something else (naming variable, file value and effective value), an info
    where the file leaves the key to the default."""
    from kvctl.core.lmcache.config import ConversionError, convert_value, env_key, env_value, is_secret, redact

    findings = []
    for variable, text in sorted(environ.items()):
        key = env_key(variable)
        if key is None:
            continue
        try:
            from_env = convert_value(key, env_value(text))
            shown = json.dumps(redact(key, from_env)) if isinstance(from_env, dict) else redact(key, text)
        except ConversionError:
            from_env = env_value(text)
            shown = "***" if is_secret(text) else redact(key, text)  # unparsed: which part is the secret is unknown
        live = redact(key, effective[key]) if key in (effective or {}) else shown
        if key in file_values:
            try:
                written = convert_value(key, file_values[key])
            except ConversionError:
                written = file_values[key]
            if written == from_env:
                continue
            findings.append(Finding(
                "warning", "env_override",
                f"{variable}={shown} overrides {key}: {redact(key, written)} in {file_name}, "
                f"effective {live}",
                "the file does not describe what runs: tools and peers that read it get this setting wrong",
                f"unset {variable} where vLLM starts (kvctl serve drops inherited LMCACHE_* unless "
                f"--keep-lmcache-env), or write it into {file_name}", instance))
        else:
            findings.append(Finding("info", "env_override", f"{variable}={shown} sets {key} (effective "
                                    f"{live}), which {file_name} leaves to the default",
                                    "none while it matches every peer", f"write {key} into {file_name} to keep it in "
                                    "one place", instance))
    return findings


# -- disk tier ------------------------------------------------------------------------------------


def disk_findings(directories: list[str], budget_bytes: int | None, suffix: str = ".pt",
                  instance: str | None = None) -> list[Finding]:
    """Files LMCache cannot use in a disk tier (foreign names, zero-length or torn chunk files whose size
    differs from their siblings', stale partial files of interrupted kvctl loads), bytes beyond the
    budget, free space below it."""
    from kvctl.clients.disk_tier import is_partial
    from kvctl.core.lmcache.keys import parse_key, parse_object_key

    def kind_of(name: str):
        """What a file's size must match (model, rank, dtype), None for a name that is no chunk."""
        if not name.endswith(suffix):
            return None
        if suffix == ".data":  # the MP server's fs L2 adapter: a header, then the data
            parsed = parse_object_key(name)
            return None if parsed is None else (parsed.model_name, parsed.kv_rank, parsed.object_group_id)
        parsed = parse_key(name[: -len(suffix)])
        return None if parsed is None else (parsed.model_name, parsed.world_size, parsed.kv_dtype)

    findings: list[Finding] = []
    total = 0
    for directory in directories:
        try:
            entries = [entry for entry in os.scandir(directory) if entry.is_file(follow_symlinks=False)]
        except FileNotFoundError:
            findings.append(did_not_run("disk", f"the disk tier directory {directory} does not exist yet", instance))
            continue
        except OSError as error:
            findings.append(did_not_run("disk", f"cannot read the disk tier directory {directory}: {error.strerror}",
                                  instance))
            continue
        sizes: dict[str, int] = {}
        foreign = []
        by_kind: dict[tuple, list[str]] = {}
        for entry in entries:
            if entry.name.startswith(".kvctl"):
                continue
            size = entry.stat(follow_symlinks=False).st_size
            total += size
            if is_partial(entry.name):
                continue  # partial_findings
            kind = kind_of(entry.name)
            if kind is None:
                foreign.append(entry.name)
                continue
            sizes[entry.name] = size
            by_kind.setdefault(kind, []).append(entry.name)
        findings += partial_findings(directory, instance)
        if foreign:
            findings.append(Finding("warning", "disk", f"{len(foreign)} file(s) in {directory} are no LMCache chunk: "
                                    f"{', '.join(sorted(foreign)[:5])}", "disk space the tier's budget does not count "
                                    "and LMCache never reads", "move them out of the cache directory", instance))
        empty = sorted(name for name, size in sizes.items() if size == 0)
        if empty:
            findings.append(Finding("warning", "disk", f"{len(empty)} zero-length chunk file(s) in {directory}: "
                                    f"{', '.join(empty[:5])}", "a chunk that reads as garbage or fails to load",
                                    "remove them: kvctl evict --config DIR --key KEY", instance))
        for names in by_kind.values():
            usual, _ = Counter(sizes[name] for name in names if sizes[name]).most_common(1)[0] if any(
                sizes[name] for name in names) else (0, 0)
            torn = sorted(name for name in names if sizes[name] and sizes[name] != usual)
            if torn and len(names) > 1:
                findings.append(Finding("warning", "disk", f"{len(torn)} torn chunk file(s) in {directory} "
                                        f"({sizes[torn[0]]} bytes where the others have {usual}): "
                                        f"{', '.join(torn[:5])}", "a truncated chunk: loading it fails or brings "
                                        "wrong KV values", "remove them: kvctl evict --config DIR --key KEY",
                                        instance))
    if budget_bytes:
        if total > budget_bytes:
            findings.append(Finding("warning", "disk", f"the disk tier holds {_size(total)}, beyond its budget "
                                    f"max_local_disk_size {_size(budget_bytes)}", "LMCache's index starts empty "
                                    "and does not count these bytes: the disk fills past the budget",
                                    "evict old chunks (kvctl evict --config DIR --all) or raise the budget", instance))
        for directory in directories:
            try:
                usage = os.statvfs(directory)
            except OSError:
                continue
            free = usage.f_bavail * usage.f_frsize
            if free + min(total, budget_bytes) < budget_bytes:
                findings.append(Finding("warning", "disk", f"the file system of {directory} has {_size(free)} free, "
                                        f"less than the budget {_size(budget_bytes)} still needs",
                                        "stores fail (or evict early) before the tier reaches its budget",
                                        "free space or lower max_local_disk_size", instance))
    return findings


def partial_findings(directory: str, instance: str | None = None) -> list[Finding]:
    """The partial files kvctl loads left in a disk directory when they were killed (SIGKILL, a crash):
    disk space no tier counts and LMCache never reads; a load writing there now is no finding."""
    from kvctl.clients.disk_tier import stale_partials

    try:
        with stale_partials(directory) as stale:
            if not stale:
                return []
            size = sum(path.lstat().st_size for path in stale)
    except (KvctlError, OSError):
        return []  # gone meanwhile; disk_findings says what keeps it from reading the directory
    return [Finding("warning", "disk", f"{len(stale)} stale kvctl partial file(s) in {directory} ({_size(size)}), left "
                    f"by interrupted snapshot loads: {', '.join(path.name for path in stale[:3])}",
                    "disk space no tier counts; LMCache never reads them",
                    "remove them: kvctl evict --config DIR --tier disk --dry-run lists them, and any eviction of "
                    "that tier (without --dry-run) removes them with the chunks it selects", instance)]


def _size(count: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.4g} {unit}"
    return f"{int(count)} B"


# -- Redis --------------------------------------------------------------------------------------


def redis_info_findings(memory: dict[str, Any], stats: dict[str, Any], where: str,
                        instance: str | None = None) -> list[Finding]:
    """A Redis server's INFO memory and stats: a policy that splits a chunk's two names, evictions that
    happened, memory near maxmemory."""
    from kvctl.clients.redis_tier import split_eviction_risk

    findings = []
    if risk := split_eviction_risk(memory):
        findings.append(Finding("warning", "redis", f"{where}: {risk}", "chunks LMCache counts as stored but cannot "
                                "read: a hit turns into a recompute", "use maxmemory-policy noeviction (or "
                                "volatile-lru, LMCache sets no TTL) and size maxmemory for the cache", instance))
    evicted = int(stats.get("evicted_keys") or 0)
    if evicted:
        findings.append(Finding("warning", "redis", f"{where} has evicted {evicted} key(s)", "evicted chunks are "
                                "misses; with two names per chunk, possibly half-chunks", "raise maxmemory or store "
                                "less", instance))
    used, limit = int(memory.get("used_memory") or 0), int(memory.get("maxmemory") or 0)
    if limit and used > REDIS_HEADROOM * limit:
        findings.append(Finding("warning", "redis", f"{where} uses {_size(used)} of maxmemory {_size(limit)}",
                                "the next stores evict chunks (or fail under noeviction)", "raise maxmemory",
                                instance))
    return findings


def redis_findings(url, instance: str | None = None) -> list[Finding]:
    from kvctl.clients.redis_tier import RedisTier

    where = f"Redis {url.url(redact=True)}"
    try:
        with RedisTier(url) as redis:
            redis.ping()
            memory = redis.memory()
            with redis._session() as client:
                stats = client.info("stats") if url.scheme != "redis-cluster" else {}
    except KvctlError as error:
        return [Finding("error", "redis", f"{where} does not answer: {error.message}", "every chunk on Redis is a "
                        "miss: LMCache reports 'not contained' while its connection is down", error.hint, instance)]
    return redis_info_findings(memory, stats, where, instance)


# -- exposure -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteGuard:
    """What guards an internal API bound beyond loopback: kvctl's plugins (their guard also puts
    LMCache's own /env, /conf, /cache/*, /backends, /run_script ... behind the token there), a routes
    token, and that token out of the process's environment (GET /env answers every variable)."""

    plugins: bool = False
    token: bool = False
    token_in_env: bool = False

    def gaps(self) -> list[str]:
        return [gap for gap, missing in (
            ("kvctl's plugins are not loaded, so LMCache's own routes answer anyone", not self.plugins),
            ("no routes token is set", not self.token),
            ("the routes token is readable from GET /env (kvctl's plugins older than this kvctl)", self.token_in_env),
        ) if missing]


def config_guard(view: ConfigView) -> RouteGuard:
    from kvctl_plugins.wire import TOKEN_FILE_VARIABLE, TOKEN_VARIABLE

    from kvctl.core.config.init import PLUGIN_MODULE

    return RouteGuard(view.kv_transfer.get("kv_connector_module_path") == PLUGIN_MODULE,
                      bool(view.env.get(TOKEN_VARIABLE) or view.env.get(TOKEN_FILE_VARIABLE)))


def running_guard(running: Running) -> RouteGuard:
    from kvctl_plugins.wire import TOKEN_VARIABLE

    guard = (running.routes or {}).get("routes_guard") or {}
    return RouteGuard(guard.get("lmcache_routes") is True, guard.get("token") is True,
                      TOKEN_VARIABLE in (running.env or {}))


def exposure_findings(values: dict[str, Any], guard: RouteGuard, where: str,
                      instance: str | None = None) -> list[Finding]:
    """Management routes bound beyond loopback, /run_script enabled (in-process keys and MP flags alike).
    An internal API beyond loopback is only a warning where kvctl's guard holds whole; an MP server's
    own routes have no guard (its coordinator calls them without one)."""
    from kvctl.core.config.init import is_loopback
    from kvctl.core.lmcache.config import to_bool

    findings = []

    def truthy(key: str) -> bool:
        try:
            return to_bool(values.get(key, False))
        except ValueError:
            return False

    hosts = []
    if truthy("internal_api_server_enabled") and not values.get("internal_api_server_socket_path_prefix"):
        hosts.append(("internal_api_server_host", values.get("internal_api_server_host") or "127.0.0.1",
                      guard.gaps()))
    if "http_host" in values:
        hosts.append(("http_host", values.get("http_host") or "127.0.0.1",
                      ["LMCache's MP routes have no token guard (its coordinator calls them without one)"]))
    for key, host, gaps in hosts:
        if is_loopback(str(host)):
            continue
        findings.append(Finding("error" if gaps else "warning", "exposure",
                                f"{where}: {key} {host} binds the management API beyond loopback"
                                + (f"; unguarded: {'; '.join(gaps)}" if gaps else
                                   "; guarded: every route but the read-only probes wants the routes token"),
                                "anyone who reaches the port can read /env (every variable, secrets included), "
                                "change /conf and clear the cache" if gaps else "the routes token is the only "
                                "guard: whoever holds it controls the cache", "bind it to 127.0.0.1 and reach it "
                                "through an SSH tunnel or an authenticating proxy", instance))
    if truthy("run_script_api_enabled"):
        findings.append(Finding("error", "exposure", f"{where}: run_script_api_enabled is on: POST /run_script runs "
                                "the Python it is sent", "remote code execution in the serving process for anyone "
                                "who reaches the management port", "set run_script_api_enabled: false", instance))
    return findings


EXPOSURE_KEYS = ("internal_api_server_enabled", "internal_api_server_host", "internal_api_server_socket_path_prefix",
                 "run_script_api_enabled")
SECRET_LINE = re.compile(r"(password|passwd|secret|token|api_key|apikey)[^=:\n]*[=:]\s*['\"]?[^\s'\"]+"
                         r"|://[^/\s:@]*:[^/\s@]+@", re.IGNORECASE)


def secret_file_findings(paths: list[Path], instance: str | None = None) -> list[Finding]:
    """A file holding a password or token that other users can read."""
    findings = []
    for path in paths:
        try:
            mode = path.stat().st_mode
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if not (mode & 0o077) or not SECRET_LINE.search(text):
            continue
        world = bool(mode & stat.S_IROTH)
        findings.append(Finding("error" if world else "warning", "secrets",
                                f"{path} holds a password or token and is readable by "
                                f"{'every user' if world else 'its group'} (mode {stat.S_IMODE(mode):o})",
                                "others on the machine can read the Redis or route credentials",
                                f"chmod 600 {path}", instance))
    return findings


# -- the connector retrieving ------------------------------------------------------------------------


def retrieve_findings(stats: dict[str, Any] | None, instance: str | None = None) -> list[Finding]:
    """Lookups that hit while retrieves bring nothing: the connector is not loading what LMCache has."""
    if not stats:
        return [did_not_run("retrieve", "no LMCache metrics to compare lookups and retrieves", instance)]
    lookup_hits = (stats.get("lookup") or {}).get("hit_tokens")
    retrieve = stats.get("retrieve") or {}
    if not lookup_hits:
        return []
    if retrieve.get("hit_tokens") is None and retrieve.get("requests") is None:
        return [did_not_run("retrieve", "the engine exports no retrieve metrics", instance)]
    if not retrieve.get("hit_tokens"):
        return [Finding("error", "retrieve", f"lookups hit {lookup_hits:,.0f} tokens but retrieves brought "
                        f"{retrieve.get('hit_tokens') or 0:,.0f} (of {retrieve.get('tokens') or 0:,.0f} requested)",
                        "every hit is recomputed: the cache costs stores and lookups and saves nothing",
                        "check the connector in vLLM's log (on CPU: 'No supported cpu connector found'; kvctl serve "
                        "loads kvctl_plugins.vllm_connector), and min_retrieve_tokens", instance)]
    return []


# -- facts from a configuration directory and from a running engine -------------------------------------


@dataclass
class ConfigView:
    """What a configuration directory says, for the checks that read files."""

    path: Path
    facts: KeyFacts
    values: dict[str, Any]  # lmcache.yaml as written
    settings: dict[str, Any]  # effective (in-process) or as written (MP)
    exposed: dict[str, Any]  # what decides the binds and routes (Deployment.exposed)
    env: dict[str, str]
    stores: list
    files: list[Path]
    kv_transfer: dict[str, Any] = field(default_factory=dict)


def read_config(config: str | os.PathLike) -> ConfigView:
    from kvctl.core.lmcache.config import locate
    from kvctl.core.lmcache.deployment import read_deployment

    deployment = read_deployment(config)
    files = [path for path in vars(locate(config)).values() if path is not None]
    has_env = any(path.name == "env.sh" for path in files)
    seed = deployment.env.get("PYTHONHASHSEED", UNSET if has_env else None)
    return ConfigView(Path(config), deployment.key_facts(seed), deployment.values, deployment.settings,
                      deployment.exposed, deployment.env, deployment.stores, files, deployment.kv_transfer)


def routes_findings(running: Running, where: str, instance: str | None = None) -> list[Finding]:
    """A stock server: what kvctl cannot do there, and the one line that fixes it."""
    if not running.routes_absent:
        return []
    cost, hint = running.without_routes
    return [Finding("warning", "routes", f"kvctl's routes are absent: {where} is LMCache's own server without "
                    "kvctl's plugins", f"without them {cost}", hint, instance)]


# -- putting the checks together --------------------------------------------------------------------


def config_findings(view: ConfigView, instance: str | None = None) -> list[Finding]:
    """Everything a configuration directory alone shows: exposure, secrets, disk and Redis stores."""
    findings = exposure_findings(view.exposed, config_guard(view), str(view.path), instance)
    findings += secret_file_findings(view.files, instance)
    findings += store_findings(view.stores, view.settings, instance)
    if view.facts.hash_seed == UNSET and view.facts.seed_matters():
        findings.append(Finding("warning", "key_compatibility", f"{view.path}/env.sh sets no PYTHONHASHSEED",
                                "without a fixed seed vLLM's NONE_HASH differs per process: keys never match across "
                                "restarts or peers", "export PYTHONHASHSEED=0 in env.sh", instance))
    return findings


def store_findings(stores: list, settings: dict[str, Any], instance: str | None = None,
                   seen: set | None = None) -> list[Finding]:
    findings = []
    seen = set() if seen is None else seen
    for store in stores:
        if store.tier == "disk":
            marker = ("disk", store.directories)
            if marker in seen:
                continue
            seen.add(marker)
            budget = settings.get("max_local_disk_size") if store.layout == "lmcache-disk" else None
            findings += disk_findings(list(store.directories), int(float(budget) * 1024**3) if budget else None,
                                      ".pt" if store.layout == "lmcache-disk" else ".data", instance)
        elif store.redis is not None:
            marker = ("redis", store.redis.url(redact=True))
            if marker in seen:
                continue
            seen.add(marker)
            findings += redis_findings(store.redis, instance)
    return findings


@dataclass
class Examination:
    """One running member: its facts and the findings about it alone."""

    name: str
    facts: KeyFacts
    findings: list[Finding]
    stores: list


def examine(address, config: str | os.PathLike | None = None, timeout: float = TIMEOUT_S) -> Examination:
    """Every check of one running instance against its configuration directory (the address's, the
    given one, or the directory of the process's LMCACHE_CONFIG_FILE)."""
    from kvctl.core.lmcache.deployment import inprocess_stores

    name = address.name
    running = read_running(address, timeout)
    findings = [did_not_run("running", f"not read: {note}", name) for note in running.notes]
    findings += routes_findings(running, address.mp_http or address.worker or name, name)
    config = config or address.config_dir
    if config is None and running.env and running.env.get("LMCACHE_CONFIG_FILE"):
        candidate = Path(running.env["LMCACHE_CONFIG_FILE"]).parent
        config = candidate if candidate.is_dir() else None
    view = None
    if config is not None:
        try:
            view = read_config(config)
        except KvctlError as error:
            findings.append(did_not_run("config_drift", f"cannot read the configuration {config}: {error.message}",
                                        name))
    else:
        findings.append(did_not_run("config_drift", "no configuration directory known (give --config, or config_dir in "
                              "the inventory): running values not compared with files", name))
    overridden: set[str] = set()
    if view is not None and running.env is not None and running.reads_lmcache_env:
        override = env_overrides(running.env, view.values, running.conf, "lmcache.yaml", name)
        overridden = {finding.what.split("=", 1)[0] for finding in override if finding.level == "warning"}
        findings += override
    elif running.env is None:
        findings.append(did_not_run("env_override", "the process's environment (/env) did not answer", name))
    if view is not None:
        skip = frozenset(key for key, variable in (("chunk_size", "LMCACHE_CHUNK_SIZE"), (
            "hash_algorithm", "LMCACHE_PRE_CACHING_HASH_ALGORITHM")) if variable in overridden)
        findings += compare_with_config(running.facts, view.facts, str(view.path), name, skip)
        findings += exposure_findings(view.exposed, config_guard(view), str(view.path), name)
        findings += secret_file_findings(view.files, name)
    if running.conf and (view is None or any(running.conf.get(key) != view.settings.get(key) for key in EXPOSURE_KEYS)
                         or running_guard(running).gaps() != config_guard(view).gaps()):
        findings += exposure_findings(running.conf, running_guard(running), "running engine", name)
    if running.counts_retrieves:
        findings += retrieve_findings(running.stats, name)
    stores = list(view.stores) if view is not None else []
    if not stores and running.conf:
        stores = inprocess_stores(running.conf)[0]
    settings = view.settings if view is not None else (running.conf or {})
    return Examination(name, running.facts, findings, [(store, settings) for store in stores])


def diagnose_config(config: str | os.PathLike) -> Report:
    """A configuration directory with no engine."""
    view = read_config(config)
    findings = config_findings(view)
    findings.append(did_not_run("running", "no engine given (--instance): running values, LMCACHE_* overrides and "
                          "retrieves are not checked"))
    return Report(findings)


def diagnose_instance(address, config: str | os.PathLike | None = None, timeout: float = TIMEOUT_S) -> Report:
    try:
        examination = examine(address, config, timeout)
    except KvctlError as error:
        return Report([_unreachable(address.name, error.message, error.hint)])
    findings = list(examination.findings)
    findings += compare_members({examination.name: examination.facts})
    seen: set = set()
    for store, settings in examination.stores:
        findings += store_findings([store], settings, examination.name, seen)
    return Report(findings)


def _unreachable(name: str, message: str, hint: str | None) -> Finding:
    return Finding("error", "reachable", f"{name} did not answer: {message}", "every request it serves is a "
                   "miss for the fleet, and none of its checks ran", hint or "start it, or fix its address", name)


def diagnose_fleet(state=None, inventory=None, timeout: float = TIMEOUT_S, fleet: str = "all") -> Report:
    """Every fleet member (the inventory's, or a controller's) examined at once, then compared with
    each other; shared stores once."""
    from kvctl.core.instance import addresses
    from kvctl.core.lmcache.deployment import Store
    from kvctl.core.lmcache.tiers import parse_redis_url

    members = addresses.resolve(fleet, state, inventory)
    examined = [address for address in members if not address.controller_only]  # the controller's own findings
    outcomes = addresses.fan_out(examined, lambda address: examine(address, None, timeout), timeout + 5)
    findings: list[Finding] = []
    facts: dict[str, KeyFacts] = {}
    stores: list = []
    for outcome in outcomes:
        if outcome.error is not None:
            findings.append(_unreachable(outcome.instance, outcome.error, outcome.hint))
            continue
        findings += outcome.result.findings
        facts[outcome.instance] = outcome.result.facts
        stores += [(store, settings, outcome.instance) for store, settings in outcome.result.stores]
    findings += compare_members(facts)
    from kvctl.core.lmcache.controller import is_controller

    if is_controller(fleet):  # what blinds the controller, and its index against the instances' contents
        from kvctl.core.diagnose.controller_checks import controller_findings

        findings += controller_findings(fleet, members)
    seen: set = set()
    for store, settings, name in stores:
        findings += store_findings([store], settings, name, seen)
    shared = addresses.shared_redis(inventory)
    if shared:
        findings += store_findings([Store("redis", "lmcache-redis", redis=parse_redis_url(shared))], {}, None, seen)
    return Report(findings)


def diagnose(selector, timeout: float = TIMEOUT_S) -> Report:
    """The report for what the selector flags name: a configuration alone, the fleet, or one instance."""
    from kvctl.core.instance import addresses

    if selector.config is not None and selector.instance is None:
        return diagnose_config(selector.config)
    if selector.fleet:
        return diagnose_fleet(selector.state, selector.inventory, timeout, selector.instance)
    address = addresses.resolve(selector.instance, selector.state, selector.inventory)[0]
    return diagnose_instance(address, selector.config, timeout)
