"""vLLM's `kv_connector_module_path` for LMCache's in-process connector, with kvctl's plugins.

vLLM imports this module in the scheduler and in every worker process and takes the class named
by `kv_connector` from it, so the connector keeps the name users know:

    --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                           "kv_connector_module_path": "kvctl_plugins.vllm_connector"}'
"""

from kvctl_plugins import install

install()

from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1  # noqa: E402

__all__ = ["LMCacheConnectorV1"]
