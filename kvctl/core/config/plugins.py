"""`kvctl plugins enable|disable`: a deployment's own vLLM `--kv-transfer-config`, changed so that vLLM
loads kvctl's plugins (or no longer does), for deployments kvctl did not launch.

vLLM imports `kv_connector_module_path` in the scheduler and every worker and takes the class named by
`kv_connector` from it: `kvctl_plugins.vllm_connector` re-exports LMCache's LMCacheConnectorV1 after
installing the plugins, so the connector keeps its name and nothing else in the configuration changes.
An MP deployment loads kvctl's routes in its `lmcache server` (--server-module), not in vLLM.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

from kvctl.core.config.init import PLUGIN_MODULE
from kvctl.core.errors import UsageError
from kvctl.core.lmcache.config import INPROCESS_CONNECTOR, MP_CONNECTOR

MODULE_KEY = "kv_connector_module_path"
MP_ROUTES_FLAG = "--server-module '{\"module_path\": \"kvctl_plugins.mp_routes\"}'"


@dataclass(frozen=True)
class PluginChange:
    """A kv-transfer-config before and after; `source` is the file it came from (None: a command-line value)."""

    source: str | None
    before: dict[str, Any]
    after: dict[str, Any]

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        name = self.source or "--kv-transfer-config"
        return "".join(difflib.unified_diff(_pretty(self.before).splitlines(True), _pretty(self.after).splitlines(True),
                                            f"{name} (before)", f"{name} (after)"))

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "changed": self.changed, "before": self.before, "after": self.after,
                "kv_transfer_config": json.dumps(self.after, separators=(",", ":"))}


def _pretty(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2) + "\n"


def plan_change(config: dict[str, Any], source: str | None, enable: bool) -> PluginChange:
    """The configuration with kvctl's plugins loaded (`enable`) or not; refused where vLLM would then
    load something else than the user has, or where the plugins cannot load through vLLM at all."""
    connector = config.get("kv_connector")
    current = config.get(MODULE_KEY)
    if connector == MP_CONNECTOR:
        raise UsageError("an MP deployment loads kvctl's routes in its lmcache server, not in vLLM",
                         hint=f"add {MP_ROUTES_FLAG} to its lmcache server command (kvctl serve --mode mp does)")
    if connector != INPROCESS_CONNECTOR:
        raise UsageError(f"kv_connector is {json.dumps(connector)[:80]}: kvctl's plugins load with LMCache's "
                         f"in-process connector, {INPROCESS_CONNECTOR}",
                         hint=f"use \"kv_connector\": \"{INPROCESS_CONNECTOR}\"")
    if current not in (None, PLUGIN_MODULE):
        raise UsageError(f"{MODULE_KEY} is already {json.dumps(current)[:80]}: vLLM loads that module instead, and "
                         "kvctl will not replace it", hint=f"remove {MODULE_KEY} first if that module only re-exports "
                         f"LMCache's connector, then run this again")
    after = dict(config)
    if enable:
        after[MODULE_KEY] = PLUGIN_MODULE
    else:
        after.pop(MODULE_KEY, None)
    return PluginChange(source, config, after)
