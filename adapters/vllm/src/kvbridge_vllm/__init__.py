"""kvbridge as a vLLM KV connector (``KVConnectorBase_V1``), for disaggregated prefill and decode.

    kv_transfer_config = {"kv_connector": "KVBridgeConnector",
                          "kv_connector_module_path": "kvbridge_vllm.connector",
                          "kv_role": "kv_producer",          # the prefill instance; kv_consumer on decode
                          "kv_connector_extra_config": {"backend": "loopback"}}

This package imports no vLLM module; ``kvbridge_vllm.connector`` does.
"""

from kvbridge_vllm.layout import KVPool, pool_layout
from kvbridge_vllm.settings import Settings

__all__ = ["KVPool", "Settings", "pool_layout"]
