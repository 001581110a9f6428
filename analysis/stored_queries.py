"""Span queries whose results ``kvscope ledger`` keeps in tables beside the ledger.

Each is a query of ``otel_traces`` rows (one output row per span row, or ``SELECT DISTINCT``)
that analyses would otherwise run over every span row to find a few of them. Such a scan leaves
the store's blocks in DuckDB's cache, up to the reader's memory limit: at 1M turns the retention
query took RSS up 691 MiB for a 48 MiB frame. :func:`kvscope.analysis.ledger_units.update`
keeps each result in ``kvscope_stored_<name>``, appending the rows of spans stored since its
last build, and :meth:`kvscope.analysis.registry.AnalysisContext.frame` reads that table instead
of the query while the stored ledger is current. The analysis modules use the queries from here.
"""

from __future__ import annotations

from kvscope import semconv
from kvscope.store import query

_RUN = query.resource_attr(semconv.RUN_ID)

# Retention spans, as the retention cost reads them: D pinned a finished request's blocks until
# their release (engine spans name their run in the resource attributes).
RETENTION_SPANS = query.spans(semconv.SPAN_KV_RETENTION, {
    "run_id": _RUN,
    "engine_id": query.span_attr(semconv.ENGINE_ID),
    "request_id": query.span_attr(semconv.VLLM_REQUEST_ID),
    "start": "Timestamp",
    "duration_ns": "Duration",
    "size_bytes": query.span_attr(semconv.RETENTION_BYTES),
    "ttl_s": query.span_attr(semconv.RETENTION_TTL_S),
    "reason": query.span_attr(semconv.RETENTION_RELEASE_REASON),
    "measured": query.span_attr(semconv.DURATION_MEASURED),
})

# Retention spans, as the what-if reads them (with the tokens a handle holds).
WHATIF_RETENTIONS = query.spans(semconv.SPAN_KV_RETENTION, {
    "run_id": _RUN,
    "request_id": query.span_attr(semconv.VLLM_REQUEST_ID),
    "size_bytes": query.span_attr(semconv.RETENTION_BYTES),
    "tokens": query.span_attr(semconv.REMOTE_NUM_TOKENS),
    "ttl_s": query.span_attr(semconv.RETENTION_TTL_S),
    "reason": query.span_attr(semconv.RETENTION_RELEASE_REASON),
    "duration_ns": "Duration",
})

# The router TTL the proxy recorded on its turn spans (one value per run in practice).
ROUTER_TTLS = query.spans(semconv.SPAN_TURN, {
    "run_id": _RUN,
    "router_ttl_s": query.span_attr(semconv.ROUTER_TTL_S),
}, distinct=True)

# Finished D→P reads: the cost fit's wire time.
D2P_READS = query.spans(semconv.SPAN_KV_TRANSFER, {
    "run_id": _RUN,
    "size_bytes": query.span_attr(semconv.TRANSFER_BYTES),
    "duration_ns": "Duration",
}, where={query.span_attr(semconv.TRANSFER_DIRECTION): semconv.DIRECTION_D_TO_P,
          query.span_attr(semconv.TRANSFER_STATUS): semconv.TRANSFER_OK})

# By name: the table of each is kvscope_stored_<name>.
STORED_QUERIES: dict[str, query.Query] = {
    "d2p_reads": D2P_READS,
    "retention_spans": RETENTION_SPANS,
    "router_ttls": ROUTER_TTLS,
    "whatif_retentions": WHATIF_RETENTIONS,
}


def name_of(sql: query.Query) -> str | None:
    """The stored query ``sql`` is (equal text and parameters), or None."""
    return next((name for name, q in STORED_QUERIES.items() if q == sql), None)


__all__ = ["D2P_READS", "RETENTION_SPANS", "ROUTER_TTLS", "STORED_QUERIES", "WHATIF_RETENTIONS",
    "name_of"]
