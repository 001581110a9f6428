"""``kvscope proxy``: an instrumented drop-in for vLLM's multi-turn P/D disaggregation proxy.

    router.py      the conversation id of a request (the router is kvscope.reuse.router)
    telemetry.py   per-turn records → kvscope.turn / input_processing / generation / tool_wait
                   spans, and the Prometheus metrics behind GET /metrics
    app.py         the aiohttp server (routes, both legs, streaming) and the command line
"""

from __future__ import annotations

from kvscope.collector.proxy.app import (
    Proxy,
    ProxyConfig,
    Upstream,
    add_proxy_arguments,
    build_app,
    main_proxy,
)
from kvscope.collector.proxy.router import conversation_id_from
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
    "add_proxy_arguments",
    "boundary_hashes",
    "build_app",
    "conversation_id_from",
    "main_proxy",
]
