"""What kvctl loads into LMCache and vLLM processes, without editing any installed file.

* management routes under /kvctl/v1 on LMCache's internal API server (routes.py);
* a CPU connector so LMCacheConnectorV1 runs on vLLM's CPU backend (cpu_connector.py);
* a local disk tier that survives restarts: its index is rebuilt from the files at start
  (disk_index.py);
* chunk statistics that no longer make every lookup miss (chunk_statistics.py).

`install()` applies them, once it has checked that LMCache has every internal name they use
(lmcache_names.py); it is idempotent. Entry points: `kvctl_plugins.vllm_connector`
(vLLM's kv_connector_module_path, keeping the connector name LMCacheConnectorV1) and
`python -m kvctl_plugins.standalone` (LMCache's standalone engine). The MP server's routes
(mp_routes.py) load separately, through `lmcache server --server-module`. This package imports
lmcache and vllm, never kvctl.cli.
"""

from __future__ import annotations

__version__ = "0.1.0"
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from kvctl_plugins import chunk_statistics, cpu_connector, disk_index, lmcache_names, routes

    lmcache_names.require(lmcache_names.IN_PROCESS)
    routes.install()
    cpu_connector.install()
    disk_index.install()
    chunk_statistics.install()
    _installed = True
