"""LMCache's configuration surface as data: the 108 in-process keys and the MP server's flags.

`schema.json` is a snapshot taken from the installed lmcache by `extract_schema()`
(`scripts/gen-lmcache-schema` writes it; a test fails when it differs from the installed
lmcache). kvctl reads the snapshot so that `config init/validate/show` answer in milliseconds
instead of paying LMCache's multi-second torch import.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

SCHEMA_FILE = "schema.json"


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    return json.loads(resources.files("kvctl.core.lmcache").joinpath(SCHEMA_FILE).read_text())


def inprocess_keys() -> dict[str, dict[str, Any]]:
    return load_schema()["inprocess"]["keys"]


def mp_server_flags() -> dict[str, dict[str, Any]]:
    return load_schema()["mp_server"]["flags"]


def mp_connector_keys() -> list[str]:
    return load_schema()["mp_connector"]["keys"]


def _type_name(declared: Any) -> tuple[str, bool]:
    """('int', optional) from a declared type such as `typing.Optional[list[int]]`."""
    text = declared.__name__ if isinstance(declared, type) else str(declared)
    match = re.fullmatch(r"typing\.Optional\[(.+)\]", text)
    if match:
        return match.group(1), True
    return text, False


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    return str(value)


def _environment_names(package_dir: Path) -> set[str]:
    """Every LMCACHE_* name that LMCache's source reads besides the config keys."""
    pattern = re.compile(r"[\"'](LMCACHE_[A-Z0-9_]+)[\"']")
    return {match for path in package_dir.rglob("*.py") for match in pattern.findall(path.read_text(errors="ignore"))}


def _mp_connector_keys(package_dir: Path) -> list[str]:
    """The `lmcache.mp.*` keys LMCacheMPConnector reads from vLLM's kv_connector_extra_config."""
    from lmcache.integration.vllm.vllm_multi_process_adapter import ExtraConfigDefault

    source = (package_dir / "integration" / "vllm").rglob("*.py")
    pattern = re.compile(r"[\"'](lmcache\.mp\.[a-z0-9_.]+)[\"']")
    names = {match for path in source for match in pattern.findall(path.read_text(errors="ignore"))}
    names |= {"lmcache.mp." + member.name for member in ExtraConfigDefault}
    return sorted(names)


def extract_schema() -> dict[str, Any]:
    """Read the schema out of the installed lmcache (slow: imports lmcache and torch)."""
    import argparse
    from importlib.metadata import version

    from lmcache.v1 import config as lmcache_config
    from lmcache.v1.multiprocess import http_server

    keys = {}
    for name, definition in lmcache_config._CONFIG_DEFINITIONS.items():
        type_name, optional = _type_name(definition["type"])
        default = definition["default"]
        keys[name] = {
            "type": type_name,
            "optional": optional,
            "default": None if name == "lmcache_instance_id" else _jsonable(default),
            "env": "LMCACHE_" + name.upper(),
            "description": definition.get("description", ""),
        }

    parser = argparse.ArgumentParser(add_help=False)
    for add_args in (http_server.add_http_frontend_args, http_server.add_mp_server_args, http_server.add_p2p_args,
                     http_server.add_storage_manager_args, http_server.add_observability_args,
                     http_server.add_coordinator_args):
        add_args(parser)
    flags = {}
    for action in parser._actions:
        if not action.option_strings:
            continue
        kind = type(action).__name__
        flags[action.dest] = {
            "flag": action.option_strings[0],
            "type": "bool" if kind in ("_StoreTrueAction", "_StoreFalseAction", "BooleanOptionalAction")
            else getattr(action.type, "__name__", "str") if action.type else "str",
            "negatable": kind == "BooleanOptionalAction",
            "repeatable": kind == "_AppendAction",
            "multiple": action.nargs in ("+", "*"),
            "default": _jsonable(action.default),
            "choices": _jsonable(list(action.choices)) if action.choices else None,
        }
    config_env = {spec["env"] for spec in keys.values()}
    env_names = _environment_names(Path(lmcache_config.__file__).parents[1]) - config_env
    return {
        "lmcache_version": version("lmcache"),
        "inprocess": {
            "keys": keys,
            "aliases": dict(lmcache_config._CONFIG_ALIASES),
            "deprecated": dict(lmcache_config._DEPRECATED_CONFIGS),
        },
        "environment": {
            "variables": sorted(name for name in env_names if not name.endswith("_")),
            "prefixes": sorted(name for name in env_names if name.endswith("_")),
        },
        "mp_server": {"flags": flags},
        "mp_connector": {"keys": _mp_connector_keys(Path(lmcache_config.__file__).parents[1])},
    }
