"""kvscope's vLLM instrumentation: the NIXL connector hooks, their plugin and explicit connector.

Importing this package does not import vLLM: :mod:`.instrumentor` imports it inside
``instrument()``, :mod:`.plugin` only when the plugin is enabled, and :mod:`.connector` (the
``kv_connector_module_path`` alternative) is imported by vLLM's connector factory, never here.
"""

from __future__ import annotations

from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor
from kvscope.collector.vllm.plugin import register

__all__ = ["NixlConnectorInstrumentor", "register"]
