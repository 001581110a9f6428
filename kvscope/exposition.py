"""Prometheus exposition shared by ``kvscope serve`` and ``kvscope proxy``: buckets, formats and
the receiver's own series names (the alert rules read them too).

Both servers keep their series in a :class:`prometheus_client.CollectorRegistry` of their own and
answer ``GET /metrics`` through :func:`render`, which picks the text format (0.0.4) or
OpenMetrics from the scraper's ``Accept`` header, as ``prometheus_client``'s own server does;
exemplars (trace ids) appear only in OpenMetrics. ``prometheus_client`` is imported on first use:
this module is core, and the vLLM plugin's import path must not pull it in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# vLLM 0.33.0's buckets for ``vllm:time_to_first_token_seconds``
# (vllm/v1/metrics/buckets.py:57-80, TIME_TO_FIRST_TOKEN_BUCKETS, used by
# vllm/v1/metrics/loggers.py:930-934), so kvscope's TTFT histograms and vLLM's line up bucket for
# bucket in one Grafana panel or one histogram_quantile.
VLLM_TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)

# Durations of the proxy's legs and turns, and of KV transfers, seconds.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)


# ``kvscope serve``'s own counters (:class:`kvscope.collector.receiver.ReceiverCollector`),
# exposed with ``_total``: what it took, refused or lost.
RECEIVER_SPANS_ACCEPTED = "kvscope_receiver_spans_accepted"
RECEIVER_SPANS_REJECTED = "kvscope_receiver_spans_rejected"
RECEIVER_POINTS_REJECTED = "kvscope_receiver_points_rejected"
RECEIVER_REQUESTS_REFUSED = "kvscope_receiver_requests_refused"
RECEIVER_ROWS_DROPPED = "kvscope_receiver_rows_dropped"
RECEIVER_ROWS_FAILED = "kvscope_receiver_rows_failed"
RECEIVER_VALUES_TRUNCATED = "kvscope_receiver_attribute_values_truncated"


def prom_name(name: str) -> str:
    """The Prometheus name of a semconv metric name (dots become underscores)."""
    return name.replace(".", "_")


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The exposition of ``registry`` in the format ``accept`` asks for: (body, Content-Type)."""
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


__all__ = [
    "LATENCY_BUCKETS_S", "RECEIVER_POINTS_REJECTED", "RECEIVER_REQUESTS_REFUSED",
    "RECEIVER_ROWS_DROPPED", "RECEIVER_ROWS_FAILED", "RECEIVER_SPANS_ACCEPTED",
    "RECEIVER_SPANS_REJECTED", "RECEIVER_VALUES_TRUNCATED", "VLLM_TTFT_BUCKETS_S", "prom_name",
    "render",
]
