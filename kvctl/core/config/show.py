"""`kvctl config show`: the values LMCache will run with, and where each came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.core.common.display import shown
from kvctl.core.lmcache.config import detect_mode, effective_config, load_mapping, locate, redact
from kvctl.core.lmcache.schema import mp_server_flags


@dataclass
class Settings:
    mode: str
    values: dict[str, Any]
    sources: dict[str, str]
    problems: list[str] = field(default_factory=list)
    command: list[str] | None = None


def effective_settings(target: Path | None, environ: dict[str, str]) -> Settings:
    yaml_values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    yaml_source = extra_source = "file"
    mp = False
    if target is not None:
        files = locate(target)
        if files.yaml_path:
            yaml_values = load_mapping(files.yaml_path)
            yaml_source = f"file:{shown(files.yaml_path.name)}"
        kv_transfer = load_mapping(files.kv_transfer_path) if files.kv_transfer_path else None
        if kv_transfer is not None:
            extra = kv_transfer.get("kv_connector_extra_config") or {}
            extra_source = f"vllm:{shown(files.kv_transfer_path.name)}"
        mp = detect_mode(kv_transfer, yaml_values) == "mp"
    if mp:
        return _mp_settings(yaml_values, yaml_source)
    effective = effective_config(yaml_values, yaml_source, environ, extra, extra_source)
    problems = [f"{key} from {source} is ignored: {message}" for key, source, message in effective.problems]
    values = {key: redact(key, value) for key, value in effective.values.items()}
    return Settings("inprocess", values, effective.sources, problems)


def _mp_settings(yaml_values: dict[str, Any], yaml_source: str) -> Settings:
    from kvctl.core.config.init import mp_server_launch

    flags = mp_server_flags()
    values = {key: spec["default"] for key, spec in flags.items()}
    sources = dict.fromkeys(flags, "default")
    known = {key: value for key, value in yaml_values.items() if key in flags}
    values.update(known)
    sources.update(dict.fromkeys(known, yaml_source))
    problems = [f"{shown(key)} from {yaml_source} is not an lmcache server setting" for key in yaml_values
                if key not in flags]
    redacted = {key: redact(key, value) for key, value in values.items()}
    command = [redact("argv", arg) for arg in mp_server_launch(known)[0]]  # credentials travel in the environment
    return Settings("mp", redacted, sources, problems, command)
