"""LMCache configuration as kvctl reads it: the files `kvctl config init` writes, value
conversion with LMCache's own rules, and the effective values with where each came from.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvctl.core.common.display import PATH_CHARS, redact_url, shown
from kvctl.core.common.safe_files import load_yaml, read_text
from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.lmcache.schema import inprocess_keys, mp_server_flags

MODES = ("inprocess", "mp")
CONFIG_FILE = "lmcache.yaml"
KV_TRANSFER_FILE = "kv-transfer-config.json"
ENV_FILE = "env.sh"
INPROCESS_CONNECTOR = "LMCacheConnectorV1"
MP_CONNECTOR = "LMCacheMPConnector"
# Chunk-hash functions LMCache 0.5.6 accepts: vLLM's named ones, or Python's hash() ("builtin").
INPROCESS_HASH_ALGORITHMS = ("builtin", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
MP_HASH_ALGORITHMS = ("blake3", "sha256_cbor")  # "builtin" keys change with every server process
HASH_ALGORITHMS = tuple(dict.fromkeys(INPROCESS_HASH_ALGORITHMS + MP_HASH_ALGORITHMS))
HASH_SEED = "0"
SECRET_WORDS = ("password", "secret", "token", "api_key", "apikey")
# Numbers LMCache takes but then misbehaves on: (least, most, why) per key, for those `conf set` may change.
BOUNDS: dict[str, tuple[int, int, str]] = {
    "min_retrieve_tokens": (0, (1 << 63) - 1, "LMCache refuses a negative one at start"),
    "blocking_timeout_secs": (1, int(threading.TIMEOUT_MAX), "every Redis get waits this long: below 1 each one "
                              "times out, above Python's longest wait each one fails"),
}


class ConversionError(ValueError):
    """A value that LMCache would reject or silently read differently."""


def to_bool(value: Any) -> bool:
    """LMCache's _to_bool, minus its silent traps: only real booleans and true/false/1/0 pass."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    raise ConversionError(f"{shown(value, quoted=True)} is not a boolean; LMCache reads it as false")


def _to_number(value: Any, kind: type) -> int | float:
    if isinstance(value, bool):
        raise ConversionError(f"{shown(value, quoted=True)} is a boolean, not a number")
    try:
        number = kind(value) if not isinstance(value, str) else kind(value.strip())
    except (TypeError, ValueError, OverflowError):  # int(inf) overflows
        what = "an integer" if kind is int else "a number"
        raise ConversionError(f"{shown(value, quoted=True)} is not {what}") from None
    if kind is float and math.isnan(number):  # no LMCache setting means anything with NaN; no comparison holds
        raise ConversionError(f"{shown(value, quoted=True)} is not a number")
    if kind is int and not -(1 << 63) <= number < 1 << 63:  # 400 digits: no float holds it for later checks
        raise ConversionError(f"{shown(value, quoted=True)} is out of range: LMCache's integers fit in 64 bits")
    if kind is int and isinstance(value, float) and value != number:
        raise ConversionError(f"{shown(value, quoted=True)} is not an integer; LMCache would truncate it to {number}")
    return number


def _to_list(value: Any, item: str) -> list:
    items = value if isinstance(value, list) else [part.strip() for part in str(value).split(",") if part.strip()]
    convert = {"int": lambda v: _to_number(v, int), "float": lambda v: _to_number(v, float), "str": str}[item]
    return [convert(element) for element in items]


def convert_value(key: str, value: Any) -> Any:
    """Convert a raw value (YAML, env string, JSON) the way LMCache's converter for `key` does."""
    spec = inprocess_keys()[key]
    if value is None:
        if spec["optional"]:
            return None
        raise ConversionError("null is not allowed here; LMCache keeps the default instead")
    kind = spec["type"]
    if kind == "bool":
        return to_bool(value)
    if kind in ("int", "float"):
        number = _to_number(value, int if kind == "int" else float)
        if kind == "float" and "size" in key and not (math.isfinite(number) and number >= 0):
            raise ConversionError(f"{shown(value, quoted=True)} is not a size: sizes are finite numbers of GB, "
                                  "0 or more")
        least, most, why = BOUNDS.get(key, (number, number, ""))
        if not least <= number <= most:
            raise ConversionError(f"{number} is out of range: {least} to {most} ({why})")
        return number
    if kind.startswith("list["):
        return _to_list(value, kind[5:-1])
    if kind == "dict":
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except (TypeError, ValueError, RecursionError):  # nested deeper than Python's stack
            raise ConversionError(f"{shown(value, quoted=True)} is not a JSON object") from None
        if not isinstance(parsed, dict):
            raise ConversionError(f"{shown(value, quoted=True)} is not a JSON object")
        return parsed
    if isinstance(value, (dict, list)):
        raise ConversionError(f"expected a string, got a {type(value).__name__}")
    if key == "local_disk":  # LMCache's _parse_local_disk: comma list, file:// prefixes dropped
        return ",".join(part.strip().removeprefix("file://") for part in str(value).split(",") if part.strip()) or None
    return str(value)


def env_value(text: str) -> Any:
    """An LMCACHE_* environment value before conversion: surrounding quotes stripped, as LMCache does."""
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    return stripped


def env_key(name: str) -> str | None:
    """The config key an LMCACHE_* variable sets, or None when it is not a config variable."""
    if not name.startswith("LMCACHE_"):
        return None
    key = name[len("LMCACHE_"):].lower()
    return key if key in inprocess_keys() else None


def is_secret(key: str) -> bool:
    """Whether a setting, variable or flag of this name holds a secret (password, api_key, --api-key…)."""
    name = key.lower().replace("-", "_")
    return any(word in name for word in SECRET_WORDS)


def redact(key: str, value: Any) -> Any:
    """The value with passwords and tokens hidden, for showing on a screen or in a log."""
    if isinstance(value, str):
        if is_secret(key):
            return "***" if value else value
        return redact_url(value)
    if isinstance(value, dict):
        return {item_key: redact(f"{key}.{item_key}", item) for item_key, item in value.items()}
    if isinstance(value, list):
        return [redact(key, item) for item in value]
    return value


# -- files -------------------------------------------------------------------------------------


@dataclass
class ConfigFiles:
    """The files of one configuration: an LMCache YAML, and optionally the vLLM side and env.sh."""

    yaml_path: Path | None = None
    kv_transfer_path: Path | None = None
    env_path: Path | None = None


def locate(target: str | os.PathLike) -> ConfigFiles:
    """Find the configuration files from a directory written by `config init` or a single file."""
    path = Path(target).expanduser()
    if path.is_dir():
        # Present means read: a member that is not a regular file is refused when read, not skipped.
        files = ConfigFiles(
            *(path / name if (path / name).exists() else None for name in (CONFIG_FILE, KV_TRANSFER_FILE, ENV_FILE))
        )
        if files.yaml_path is None and files.kv_transfer_path is None:
            raise KvctlError(f"no {CONFIG_FILE} or {KV_TRANSFER_FILE} in {shown(str(path), PATH_CHARS)}",
                             hint=f"create one with 'kvctl config init --out {shown(str(path), PATH_CHARS)}'")
        return files
    if not path.exists():
        raise KvctlError(f"no such file or directory: {shown(str(path), PATH_CHARS)}",
                         hint="give a YAML file or a directory from 'kvctl config init'")
    if path.suffix == ".json":
        return ConfigFiles(kv_transfer_path=path)
    if path.suffix == ".sh":
        return ConfigFiles(env_path=path)
    return ConfigFiles(yaml_path=path)


def load_mapping(path: Path) -> dict[str, Any]:
    """A configuration file (JSON by its .json suffix, else YAML) that must hold a mapping, or one clear error."""
    import yaml

    name = shown(str(path), PATH_CHARS)
    text = read_text(path)
    try:
        data = json.loads(text) if path.suffix == ".json" else (load_yaml(text, str(path)) or {})
    except (yaml.YAMLError, ValueError, RecursionError) as error:  # RecursionError: JSON nested a thousand deep
        raise KvctlError(f"cannot parse {name}: {shown(str(error).splitlines()[0], 200)}",
                         hint=f"run 'kvctl config validate {name}'") from None
    if not isinstance(data, dict):
        raise KvctlError(f"{name} is not a mapping of settings", hint=f"run 'kvctl config validate {name}'")
    return data


def parse_env_file(text: str) -> dict[str, str]:
    """`export NAME=value` lines of a POSIX shell file (comments and other lines are ignored)."""
    variables = {}
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if words and words[0] == "export":
            words = words[1:]
        for word in words:
            name, sep, value = word.partition("=")
            if sep and name.isidentifier():
                variables[name] = value
    return variables


# -- mode


def detect_mode(kv_transfer: dict[str, Any] | None, yaml_values: dict[str, Any] | None) -> str:
    """mp when vLLM is told to use LMCacheMPConnector, or the YAML holds MP server settings."""
    if kv_transfer and kv_transfer.get("kv_connector") == MP_CONNECTOR:
        return "mp"
    if kv_transfer or not yaml_values:
        return "inprocess"
    keys, flags = inprocess_keys(), mp_server_flags()
    mp_only = sum(1 for key in yaml_values if key in flags and key not in keys)
    inprocess_only = sum(1 for key in yaml_values if key in keys and key not in flags)
    return "mp" if mp_only > inprocess_only else "inprocess"


# -- effective values --------------------------------------------------------------------------


@dataclass
class EffectiveConfig:
    """Every in-process key with its value and the layer it came from."""

    values: dict[str, Any]
    sources: dict[str, str]
    problems: list[tuple[str, str, str]]  # (key, source, message) for values LMCache would not take


def effective_config(yaml_values: dict[str, Any], yaml_source: str, environ: dict[str, str],
                     extra_config: dict[str, Any], extra_source: str) -> EffectiveConfig:
    """Layer defaults < YAML < LMCACHE_* environment < vLLM `lmcache.*` extra config, as LMCache does."""
    schema = inprocess_keys()
    values = {key: spec["default"] for key, spec in schema.items()}
    sources = dict.fromkeys(schema, "default")
    problems = []
    layers = [
        (yaml_source, yaml_values),
        ("env", {key: env_value(text) for name, text in environ.items() if (key := env_key(name))}),
        (extra_source, {name[len("lmcache."):]: value for name, value in extra_config.items()
                        if name.startswith("lmcache.") and not name.startswith("lmcache.mp.")}),
    ]
    for source, layer in layers:
        for key, raw in layer.items():
            if key not in schema:
                continue
            try:
                values[key] = convert_value(key, raw)
            except ConversionError as error:
                problems.append((key, source, str(error)))
                continue
            sources[key] = f"env:{schema[key]['env']}" if source == "env" else source
    return EffectiveConfig(values, sources, problems)


def parse_kv_transfer_config(text: str, source: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        raise UsageError(f"{source} is not JSON", hint="give vLLM's --kv-transfer-config: a JSON object, or the file "
                         "that holds one") from None
    if not isinstance(config, dict):
        raise UsageError(f"{source} is not a JSON object", hint='it looks like {"kv_connector": "LMCacheConnectorV1", '
                         '"kv_role": "kv_both"}')
    return config
