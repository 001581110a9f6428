"""The explicit alternative to the plugin: a NIXL connector class named in vLLM's config.

For teams that prefer configuration over plugins::

    --kv-transfer-config '{"kv_connector": "KvscopeNixlConnector",
      "kv_connector_module_path": "kvscope.collector.vllm.connector",
      "kv_role": "kv_producer",
      "kv_connector_extra_config": {"bidirectional_kv_xfer": true,
                                    "kvscope_otlp_endpoint": "http://127.0.0.1:4318"}}'

The class name differs from ``NixlConnector`` so that no factory registry can shadow it. It is
vLLM's ``NixlConnector`` unchanged; constructing it enables the same instrumentation as the
plugin (``kvscope_otlp_endpoint`` in the extra config, else ``KVSCOPE_OTLP_ENDPOINT``). vLLM
resolves the class in the front end, engine core and every worker, so each process instruments
itself. Importing this module imports vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from kvscope.collector.vllm import plugin

EXTRA_CONFIG_ENDPOINT = "kvscope_otlp_endpoint"


class KvscopeNixlConnector(NixlConnector):
    """vLLM's NIXL connector with kvscope's hooks enabled for this process."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        endpoint = None
        try:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            endpoint = extra.get(EXTRA_CONFIG_ENDPOINT) or None
        except Exception:  # a config without the field: fall back to the environment
            endpoint = None
        # Before super().__init__: the role objects it builds are already instrumented classes.
        plugin.register(endpoint)
        super().__init__(vllm_config, role, kv_cache_config)


__all__ = ["EXTRA_CONFIG_ENDPOINT", "KvscopeNixlConnector"]
