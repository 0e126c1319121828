"""`kvctl config validate`: errors for what LMCache 0.5.6 only warns about or silently drops.

Findings come from kvctl's own checks (fast, from the schema snapshot) and, when lmcache is
installed, from loading the file with LMCache's own config machinery in a child process.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvctl.core.common.display import PATH_CHARS, shown
from kvctl.core.common.safe_files import load_yaml, read_text
from kvctl.core.config.init import PLUGIN_MODULE, is_loopback, resp_credentials
from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.lmcache.config import (
    HASH_ALGORITHMS,
    INPROCESS_CONNECTOR,
    MP_CONNECTOR,
    ConfigFiles,
    ConversionError,
    convert_value,
    detect_mode,
    env_key,
    env_value,
    locate,
    parse_env_file,
)
from kvctl.core.lmcache.keys import MP_BUILTIN_UNREPRODUCIBLE
from kvctl.core.lmcache.schema import inprocess_keys, load_schema, mp_connector_keys, mp_server_flags
from kvctl.core.lmcache.tiers import REDIS_SCHEMES, parse_redis_url
from kvctl.core.serve import platform

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class Finding:
    level: str  # "error" or "warning"
    key: str | None
    message: str
    hint: str | None = None


@dataclass
class Report:
    file: str
    mode: str
    findings: list[Finding] = field(default_factory=list)
    lmcache_checked: bool = False

    @property
    def ok(self) -> bool:
        return not any(finding.level == "error" for finding in self.findings)

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "mode": self.mode, "ok": self.ok, "lmcache_checked": self.lmcache_checked,
                "findings": [asdict(finding) for finding in self.findings]}


class _Collector:
    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def error(self, key: str | None, message: str, hint: str | None = None) -> None:
        self.findings.append(Finding("error", key, message, hint))

    def warning(self, key: str | None, message: str, hint: str | None = None) -> None:
        self.findings.append(Finding("warning", key, message, hint))


def did_you_mean(name: str, candidates: list[str]) -> str | None:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"did you mean {match[0]!r}?" if match else None


def validate(target: str | os.PathLike, mode: str | None = None, block_size: int | None = None,
             environ: dict[str, str] | None = None, use_lmcache: bool = True) -> Report:
    files = locate(target)
    block = block_size or platform.vllm_block_size()
    collector = _Collector()
    kv_transfer = _load_kv_transfer(files, collector)
    yaml_values = _load_yaml(files, collector)
    mode = mode or detect_mode(kv_transfer, yaml_values)
    if yaml_values is not None:
        if mode == "mp":
            _check_mp_yaml(yaml_values, block, collector)
        else:
            _check_inprocess_yaml(yaml_values, block, collector)
    if kv_transfer is not None:
        _check_kv_transfer(kv_transfer, mode, yaml_values, collector)
    if files.env_path is not None:
        env_file = parse_env_file(read_text(files.env_path))
        _check_env(env_file, f"{shown(files.env_path.name)}:", collector, from_file=True)
        if mode == "inprocess" and "PYTHONHASHSEED" not in env_file:
            collector.warning("PYTHONHASHSEED", f"{shown(files.env_path.name)} does not set PYTHONHASHSEED",
                              hint="without a fixed seed vLLM's NONE_HASH differs per process and chunk keys never "
                              "match")
    _check_env(dict(os.environ if environ is None else environ), "env:", collector, from_file=False)
    report = Report(str(Path(target)), mode, collector.findings)
    if use_lmcache and files.yaml_path is not None and yaml_values is not None:
        _check_with_lmcache(files.yaml_path, mode, report)
    return report


# -- loading -----------------------------------------------------------------------------------


def _load_yaml(files: ConfigFiles, collector: _Collector) -> dict[str, Any] | None:
    if files.yaml_path is None:
        return None
    import yaml

    try:
        data = load_yaml(read_text(files.yaml_path), str(files.yaml_path))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = shown(str(getattr(error, "problem", error)), 200)
        collector.error(None, f"{shown(files.yaml_path.name)} is not valid YAML{where}: {problem}",
                        hint="fix the syntax; keys are LMCache config names at the top level, e.g. 'chunk_size: 256'")
        return None
    if data is None:
        collector.error(None, f"{shown(files.yaml_path.name)} is empty", hint="generate one with 'kvctl config init'")
        return None
    if not isinstance(data, dict):
        collector.error(None, f"{shown(files.yaml_path.name)} must be a mapping of config keys, "
                        f"not a {type(data).__name__}",
                        hint="write one 'key: value' per line at the top level")
        return None
    return {str(key): value for key, value in data.items()}


def _load_kv_transfer(files: ConfigFiles, collector: _Collector) -> dict[str, Any] | None:
    if files.kv_transfer_path is None:
        return None
    name = shown(files.kv_transfer_path.name)
    try:
        data = json.loads(read_text(files.kv_transfer_path))
    except (ValueError, RecursionError) as error:
        where = (f" (line {error.lineno}, column {error.colno}): {error.msg}" if isinstance(error, json.JSONDecodeError)
                 else ": it nests deeper than Python parses" if isinstance(error, RecursionError)
                 else f": {str(error).split(';')[0]}")  # an integer of more than 4300 digits
        collector.error(None, f"{name} is not valid JSON{where}",
                        hint="it is the value of vLLM's --kv-transfer-config; regenerate it with 'kvctl config init'")
        return None
    if not isinstance(data, dict):
        collector.error(None, f"{name} must be a JSON object",
                        hint='e.g. {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}')
        return None
    return data


# -- in-process YAML ---------------------------------------------------------------------------


def _check_inprocess_yaml(values: dict[str, Any], block: int, collector: _Collector) -> None:
    schema = load_schema()["inprocess"]
    keys = schema["keys"]
    converted: dict[str, Any] = {}
    for key, raw in values.items():
        if key in keys:
            try:
                converted[key] = convert_value(key, raw)
            except ConversionError as error:
                collector.error(key, f"{key}: {error}", hint=f"{key} takes a {_type_text(keys[key])}")
        else:
            _unknown_key(key, schema, collector)
    _check_inprocess_values(converted, block, collector, source="file")


def _unknown_key(key: str, schema: dict[str, Any], collector: _Collector, where: str = "") -> None:
    aliases, deprecated = schema["aliases"], schema["deprecated"]
    name = shown(key)  # the key is the user's: it may be a megabyte long or hold control characters
    if key in deprecated and aliases.get(key) in schema["keys"]:
        collector.warning(key, f"{key}{where} is deprecated: {deprecated[key]}", hint=f"rename it to {aliases[key]}")
    elif key in aliases:
        collector.error(key, f"{key}{where} is silently dropped by LMCache 0.5.6 (its alias table is not applied)",
                        hint=f"use {aliases[key]} instead")
    elif key in deprecated:
        collector.error(key, f"{key}{where} is ignored by LMCache: {deprecated[key]}", hint="remove it")
    else:
        collector.error(name, f"unknown key {name}{where} (LMCache ignores it with only a warning)",
                        hint=did_you_mean(key, list(schema["keys"])) or "see 'kvctl config show' for all keys")


def _check_inprocess_values(values: dict[str, Any], block: int, collector: _Collector, source: str) -> None:
    defaults = {key: spec["default"] for key, spec in inprocess_keys().items()}
    get = lambda key: values.get(key, defaults[key])  # noqa: E731 - the value LMCache would use
    chunk = get("chunk_size")
    if not isinstance(chunk, int) or chunk <= 0 or chunk % block:
        collector.error("chunk_size", f"chunk_size {chunk} is not a positive multiple of vLLM's block size {block}",
                        hint=f"use a multiple of {block} (vLLM rejects the connector otherwise), "
                        f"e.g. {max(block, 256 // block * block)}")
    if get("local_disk") and not get("max_local_disk_size"):
        collector.error("max_local_disk_size", "local_disk is set but max_local_disk_size is 0: "
                        "LMCache silently creates no disk tier",
                        hint="set max_local_disk_size to the disk budget in GB")
    if get("max_local_disk_size") and not get("local_disk"):
        collector.warning("local_disk", "max_local_disk_size is set but local_disk is not: there is no disk tier",
                          hint="set local_disk to a directory, e.g. file:///var/cache/lmcache/")
    if get("local_cpu") and get("max_local_cpu_size") == 0:
        collector.error("max_local_cpu_size", "max_local_cpu_size is 0: LMCache's CPU tier, which every store goes "
                        "through, has no room", hint="give the CPU tier a size in GB, e.g. 0.5")
    if get("local_cpu") and get("max_local_cpu_size") > platform.available_memory_gb():
        collector.error("max_local_cpu_size", f"max_local_cpu_size {get('max_local_cpu_size')} GB is more than the "
                        f"{platform.available_memory_gb():.1f} GB of free memory",
                        hint="lower it, e.g. to a fifth of the free memory")
    if get("local_disk") and get("max_local_disk_size"):
        for path in str(get("local_disk")).split(","):
            path = path.strip().removeprefix("file://")
            free = platform.free_disk_gb(path)
            if get("max_local_disk_size") > free:
                collector.error("max_local_disk_size", f"max_local_disk_size {get('max_local_disk_size')} GB is more "
                                f"than the {free:.1f} GB free at {shown(path, PATH_CHARS)}",
                                hint="lower it or choose a larger disk")
    remote = get("remote_url")
    if remote:
        scheme = str(remote).partition("://")[0]
        if scheme in REDIS_SCHEMES:
            try:
                url = parse_redis_url(str(remote))
            except UsageError as error:
                collector.error("remote_url", f"remote_url: {error.message}", hint=error.hint)
            else:
                _check_redis_eviction(collector, url)
        if scheme == "redis-sentinel":
            collector.error("remote_url", "LMCache 0.5.6's redis-sentinel connector never awaits Redis: it stores "
                            "nothing and answers every lookup as cached", hint="point remote_url at the master with "
                            "redis://, or use redis-cluster://")
        if get("remote_storage_plugins"):
            collector.error("remote_url", "remote_url (deprecated) is set next to remote_storage_plugins: "
                            "LMCache creates both remote backends", hint="keep only remote_storage_plugins")
    if get("run_script_api_enabled"):
        collector.warning("run_script_api_enabled", "run_script_api_enabled lets anyone who reaches the internal "
                          "API server run Python code in the serving process", hint="set it to false")
    host = get("internal_api_server_host")
    if get("internal_api_server_enabled") and not is_loopback(str(host)):
        collector.warning("internal_api_server_host", f"the internal API server binds {shown(host)}, beyond this "
                          "machine: LMCache's own routes have no authentication (kvctl's answer only "
                          "KVCTL_ROUTES_TOKEN)",
                          hint="bind 127.0.0.1 (the default)")
    if not get("internal_api_server_enabled") and source == "file":
        collector.warning("internal_api_server_enabled", "the internal API server is off: kvctl can only inspect "
                          "disk and Redis offline", hint="set internal_api_server_enabled: true")
    if get("pre_caching_hash_algorithm") not in HASH_ALGORITHMS:
        collector.error("pre_caching_hash_algorithm", f"unknown hash algorithm "
                        f"{shown(get('pre_caching_hash_algorithm'), quoted=True)}: "
                        "LMCache falls back to Python's hash()",
                        hint="use sha256_cbor (or builtin with a fixed PYTHONHASHSEED)")
    elif "pre_caching_hash_algorithm" not in values and source == "file":
        collector.warning("pre_caching_hash_algorithm", "no explicit pre_caching_hash_algorithm: chunk keys use "
                          "Python's hash() and depend on PYTHONHASHSEED",
                          hint="set pre_caching_hash_algorithm: sha256_cbor")
    if "lmcache_instance_id" not in values and source == "file":
        collector.warning("lmcache_instance_id", "no lmcache_instance_id: LMCache picks a random one at every start",
                          hint="set a stable lmcache_instance_id")


def _check_redis_eviction(collector, url) -> None:
    """Warn when the Redis server may evict one of a chunk's two names and keep the other (asked with a
    short timeout; a server that does not answer from here says nothing about its policy)."""
    from kvctl.clients.redis_tier import RedisTier

    try:
        with RedisTier(url, timeout=2.0) as redis:
            risk = redis.eviction_risk()
    except KvctlError:
        return
    if risk:
        collector.warning("remote_url", f"Redis at {url.url(redact=True)}: {risk}",
                          hint="use maxmemory-policy noeviction or volatile-* (LMCache sets no TTL), or no maxmemory")


def _type_text(spec: dict[str, Any]) -> str:
    return f"{spec['type']}{' or null' if spec['optional'] else ''}"


# -- MP server YAML ----------------------------------------------------------------------------


def _check_mp_yaml(values: dict[str, Any], block: int, collector: _Collector) -> None:
    flags = mp_server_flags()
    for key, value in values.items():
        spec = flags.get(key)
        if spec is None:
            collector.error(shown(key), f"unknown lmcache server setting {shown(key)}",
                            hint=did_you_mean(key, list(flags)) or "keys are `lmcache server` flag names with _ for -")
            continue
        problem = _mp_value_problem(spec, value)
        if problem:
            collector.error(key, f"{key}: {problem}", hint=f"see 'lmcache server --help' for {spec['flag']}")
    chunk = values.get("chunk_size", flags["chunk_size"]["default"])
    if isinstance(chunk, int) and (chunk <= 0 or chunk % block):
        collector.error("chunk_size", f"chunk_size {chunk} is not a positive multiple of vLLM's block size {block}",
                        hint=f"use a multiple of {block}, e.g. {max(block, 256 // block * block)}")
    if values.get("hash_algorithm") == "builtin":
        collector.error("hash_algorithm", MP_BUILTIN_UNREPRODUCIBLE + "; nothing stored survives a restart",
                        hint="use hash_algorithm: blake3 (the default)")
    if "l1_size_gb" in values and "eviction_policy" not in values:
        collector.error("eviction_policy", "l1_size_gb without eviction_policy: the server refuses to start",
                        hint="add eviction_policy: LRU")
    size = values.get("l1_size_gb")
    if isinstance(size, (int, float)) and math.isfinite(size) and size > platform.available_memory_gb():
        collector.error("l1_size_gb", f"l1_size_gb {size} GB is more than the {platform.available_memory_gb():.1f} GB "
                        "of free memory", hint="lower it")
    for key in ("host", "http_host"):
        if key in values and not is_loopback(str(values[key])):
            collector.warning(key, f"{key} {shown(values[key])} exposes the MP server beyond this machine with no "
                              "authentication", hint="use 127.0.0.1")
    if values.get("run_script_api_enabled"):
        collector.warning("run_script_api_enabled", "the run_script API runs arbitrary Python code in the server",
                          hint="set it to false")
    try:
        resp_credentials(values)
    except UsageError as error:
        collector.error("l2_adapter", error.message, hint=error.hint)
    for adapter in values.get("l2_adapter") or []:
        if isinstance(adapter, dict) and adapter.get("type") == "resp" and not isinstance(adapter.get("port"), int):
            collector.error("l2_adapter", "resp L2 adapter needs host and an integer port",
                            hint="e.g. {type: resp, host: 127.0.0.1, port: 6379}")
        if isinstance(adapter, dict) and adapter.get("type") == "fs" and not adapter.get("base_path"):
            collector.error("l2_adapter", "fs L2 adapter needs base_path",
                            hint="e.g. {type: fs, base_path: /var/cache/lmcache}")


def _mp_value_problem(spec: dict[str, Any], value: Any) -> str | None:
    items = value if isinstance(value, list) and (spec["repeatable"] or spec["multiple"]) else [value]
    for item in items:
        kind = spec["type"]
        text = shown(item, quoted=True)
        if kind == "bool" and not isinstance(item, bool):
            return f"{text} is not true or false"
        if kind == "int" and (isinstance(item, bool) or not isinstance(item, int)):
            return f"{text} is not an integer"
        if kind == "float" and (isinstance(item, bool) or not isinstance(item, (int, float)) or math.isnan(item)):
            return f"{text} is not a number"
        if kind == "float" and "size" in spec["flag"] and not (math.isfinite(item) and item > 0):
            return f"{text} is not a size: sizes are finite numbers of GB above 0"
        if spec["choices"] and item not in spec["choices"]:
            return f"{text} is not one of {', '.join(map(str, spec['choices']))}"
        if spec["repeatable"] and not isinstance(item, (dict, str)):
            return f"{text} must be a mapping (it is passed as JSON)"
    return None


# -- kv-transfer-config.json -------------------------------------------------------------------


def _check_kv_transfer(config: dict[str, Any], mode: str, yaml_values: dict[str, Any] | None,
                       collector: _Collector) -> None:
    connector = config.get("kv_connector")
    if connector not in (INPROCESS_CONNECTOR, MP_CONNECTOR) and not config.get("kv_connector_module_path"):
        collector.error("kv_connector", f"kv_connector {shown(connector, quoted=True)} is not an LMCache connector",
                        hint=f"use {INPROCESS_CONNECTOR} (in-process) or {MP_CONNECTOR} (multiprocess)")
    if config.get("kv_role") not in KV_ROLES:
        collector.error("kv_role", f"kv_role {shown(config.get('kv_role'), quoted=True)} is not one of "
                        f"{', '.join(KV_ROLES)}",
                        hint="use kv_both unless you split prefill and decode")
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        collector.error("kv_connector_extra_config", "kv_connector_extra_config must be a JSON object", hint="e.g. {}")
        return
    schema = load_schema()["inprocess"]
    converted = {}
    for name, value in extra.items():
        label = shown(name)
        if name.startswith("lmcache.mp."):
            if mode != "mp":
                collector.error(label, f"{label} only applies to {MP_CONNECTOR}",
                                hint="remove it or switch to --mode mp")
            elif name not in mp_connector_keys():
                collector.error(label, f"unknown MP connector key {label}",
                                hint=(did_you_mean(name, mp_connector_keys())
                                      or "see the lmcache.mp.* keys in LMCache's docs"))
        elif name.startswith("lmcache."):
            key = name[len("lmcache."):]
            if key not in schema["keys"]:
                _unknown_key(key, schema, collector, where=f" (as {label})")
                continue
            try:
                converted[key] = convert_value(key, value)
            except ConversionError as error:
                collector.error(name, f"{name}: {error}", hint=f"{key} takes a {_type_text(schema['keys'][key])}")
    algorithm = _effective(yaml_values, converted, "pre_caching_hash_algorithm", "builtin")
    if mode == "inprocess" and _effective(yaml_values, converted, "enable_chunk_statistics", False) is True and \
            algorithm != "builtin" and config.get("kv_connector_module_path") != PLUGIN_MODULE:
        collector.error("enable_chunk_statistics", "enable_chunk_statistics with the stock connector and "
                        f"{shown(algorithm)} hashing: LMCache 0.5.6's statistics recorder resets the scheduler's "
                        "first chunk hash to the builtin one, so every lookup misses",
                        hint=f'add "kv_connector_module_path": "{PLUGIN_MODULE}" (kvctl\'s plugins keep the hash), '
                        "or turn the statistics off")
    if mode == "mp" and yaml_values:
        for extra_key, yaml_key, default in (("lmcache.mp.hash_algorithm", "hash_algorithm", "blake3"),
                                             ("lmcache.mp.port", "port", 5555)):
            connector_value = extra.get(extra_key, default)
            server_value = yaml_values.get(yaml_key, mp_server_flags()[yaml_key]["default"])
            if connector_value != server_value:
                collector.error(extra_key, f"{extra_key} is {shown(connector_value, quoted=True)} but the server's "
                                f"{yaml_key} is {shown(server_value, quoted=True)}",
                                hint="make them equal; vLLM cannot use the server otherwise")


def _effective(yaml_values: dict[str, Any] | None, connector_values: dict[str, Any], key: str, default: Any) -> Any:
    """The value the engine will run with: the connector's extra config wins over the file, else LMCache's
    default (a value that does not convert is reported with the file's other values)."""
    if key in connector_values:
        return connector_values[key]
    value = (yaml_values or {}).get(key)
    try:
        return default if value is None else convert_value(key, value)
    except ConversionError:
        return default


# -- environment -------------------------------------------------------------------------------


def _check_env(variables: dict[str, str], where: str, collector: _Collector, from_file: bool) -> None:
    schema = load_schema()
    known = set(schema["environment"]["variables"])
    prefixes = tuple(schema["environment"]["prefixes"])
    config_env = [spec["env"] for spec in schema["inprocess"]["keys"].values()]
    for name, text in variables.items():
        label = shown(name)  # names in a shell's environment may hold anything but "=" and NUL
        if name.startswith("LM_CACHE_"):
            collector.error(f"{where}{label}",
                            f"{label} is ignored: LMCache reads LMCACHE_* (no underscore in LMCACHE)",
                            hint=f"rename it to LMCACHE_{label[len('LM_CACHE_'):]}")
        elif not name.startswith("LMCACHE_") or name in known:
            continue
        elif (target := schema["inprocess"]["aliases"].get(name[len("LMCACHE_"):].lower())) is not None:
            collector.error(f"{where}{name}", f"{name} is silently dropped by LMCache 0.5.6 (an alias it does not "
                            "apply)", hint=f"use LMCACHE_{target.upper()}")
        elif name.startswith(prefixes):
            continue
        elif (key := env_key(name)) is not None:
            try:
                convert_value(key, env_value(text))
            except ConversionError as error:
                collector.error(f"{where}{name}", f"{name}: {error}",
                                hint=f"{key} takes a {_type_text(schema['inprocess']['keys'][key])}")
            if not from_file:
                collector.warning(f"{where}{name}", f"{name} is set in this shell and overrides {key} from the file",
                                  hint=f"unset {name} unless you mean it")
        else:
            collector.error(f"{where}{label}", f"{label} is not a variable LMCache reads",
                            hint=did_you_mean(name, config_env + sorted(known))
                            or "see 'kvctl config show' for the variables LMCache reads")


# -- LMCache's own machinery -------------------------------------------------------------------


def _check_with_lmcache(path: Path, mode: str, report: Report) -> None:
    from kvctl.core.lmcache.probe import run_probe

    result = run_probe(mode, str(path))
    if not result["available"]:
        return
    report.lmcache_checked = True
    flagged = {finding.key for finding in report.findings}
    if result["error"]:
        report.findings.append(Finding("error", None,
                                       f"LMCache rejects the configuration: {shown(result['error'], 200)}",
                                       "fix the setting the message names"))
    for message in result["warnings"]:
        if any(key and key in message for key in flagged) or "deprecated" in message and "remote_url" in message:
            continue
        report.findings.append(Finding("warning", None, f"LMCache: {shown(message, 200)}", None))
