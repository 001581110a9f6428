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

from kvscope.collector.proxy.app import (
    Proxy,
    ProxyConfig,
    Upstream,
    build_app,
)
from kvscope.collector.proxy.conversation import conversation_id_from
from kvscope.collector.proxy.telemetry import ProxyTelemetry, TurnRecord, boundary_hashes
from kvscope.reuse.router import ConversationRouter, Lookup

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
