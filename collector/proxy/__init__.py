"""``kvscope proxy``: an instrumented drop-in for vLLM's multi-turn P/D disaggregation proxy.

    conversation.py  the conversation id of a request (the router is kvscope.reuse.router)
    telemetry.py   per-turn records → kvscope.turn / input_processing / generation / tool_wait
                   spans, and the Prometheus metrics behind GET /metrics
    metrics.py     the Prometheus metrics behind GET /metrics (prometheus_client)
    export_process.py   spans built and written in a child process
    app.py         the aiohttp server (routes, both legs, streaming); the command is
                   kvscope.cli.proxy
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.lazy import lazy_names

if TYPE_CHECKING:
    from kvscope.collector.proxy.app import Proxy, ProxyConfig, Upstream, build_app
    from kvscope.collector.proxy.conversation import conversation_id_from
    from kvscope.collector.proxy.telemetry import ProxyTelemetry, TurnRecord
    from kvscope.reuse.boundaries import boundary_hashes
    from kvscope.reuse.router import ConversationRouter, Lookup

# The names below load their module on first use (PEP 562, as kvscope.store), so a light module
# of the package (conversation.py: replay reads its SESSION_HEADER) imports no aiohttp server.
_MODULE_OF = {
    "Proxy": "kvscope.collector.proxy.app",
    "ProxyConfig": "kvscope.collector.proxy.app",
    "Upstream": "kvscope.collector.proxy.app",
    "build_app": "kvscope.collector.proxy.app",
    "conversation_id_from": "kvscope.collector.proxy.conversation",
    "ProxyTelemetry": "kvscope.collector.proxy.telemetry",
    "TurnRecord": "kvscope.collector.proxy.telemetry",
    "boundary_hashes": "kvscope.reuse.boundaries",
    "ConversationRouter": "kvscope.reuse.router",
    "Lookup": "kvscope.reuse.router",
}

__all__ = [
    "ConversationRouter",
    "Lookup",
    "Proxy",
    "ProxyConfig",
    "ProxyTelemetry",
    "TurnRecord",
    "Upstream",
    "boundary_hashes",
    "build_app",
    "conversation_id_from",
]


__getattr__ = lazy_names(__name__, _MODULE_OF, globals())
