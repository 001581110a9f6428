"""The proxy's Prometheus metrics (``GET /metrics``), on ``prometheus_client`` as vLLM's own are.

One :class:`ProxyMetrics` per proxy, in a registry of its own (several proxies in one process
— tests, the benchmark — never share series). A finished turn is one :meth:`ProxyMetrics.observe`
call on the event loop. Series (names unchanged from the hand-written exposition this replaces):

    kvscope_proxy_turns_total               route, outcome, model_name, prefill/decode instance
    kvscope_proxy_router_lookups_total      result, model_name
    kvscope_proxy_upstream_errors_total     leg, kind, model_name, instance (the leg's)
    kvscope_proxy_client_disconnects_total  model_name
    kvscope_proxy_ttft_seconds              histogram; model_name, prefill/decode instance;
                                            vLLM's ``vllm:time_to_first_token_seconds`` buckets;
                                            exemplar ``trace_id`` (OpenMetrics only; one
                                            per bucket per second at most)
    kvscope_proxy_leg_duration_seconds      histogram; leg, model_name, instance
    kvscope_proxy_turn_duration_seconds     histogram; model_name
    kvscope_proxy_router_entries            gauge, read at scrape time
    kvscope_proxy_telemetry_dropped_spans_total  counter, read at scrape time
    kvscope_proxy_build_info                version, python
    process_* and python_gc_* / python_info  prometheus_client's process, GC and platform
                                            collectors

``model_name`` is what the client asked for (the request's ``model``), so its values are
bounded: past :data:`MAX_MODEL_NAMES` distinct names, further ones are counted as ``other``; a
name takes a slot only once a turn for it succeeded (names upstream refuses never do).
The format follows the scraper's ``Accept`` header (:func:`kvscope.exposition.render`).
"""

from __future__ import annotations

import platform
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvscope import __version__, exposition, semconv
from kvscope.exposition import prom_name

# Distinct model names kept as label values; the rest become OTHER_MODEL.
MAX_MODEL_NAMES = 32
OTHER_MODEL = "other"
# Each TTFT bucket takes a new exemplar (trace id) at most this often (turns' own clock).
EXEMPLAR_EVERY_NS = 1_000_000_000


class TurnRecordLike(Protocol):
    """What :meth:`ProxyMetrics.observe` reads of a finished
    :class:`~kvscope.collector.proxy.telemetry.TurnRecord`."""

    route: str | None
    model: str | None
    prefill_instance: str | None
    decode_instance: str | None
    lookup: str | None
    error_kind: str | None
    error_leg: str | None
    client_disconnected: bool
    first_token_ns: int | None
    arrival_ns: int
    trace_id: int
    prefill_start_ns: int | None
    prefill_end_ns: int | None
    decode_start_ns: int | None
    decode_end_ns: int | None
    end_ns: int


class _ScrapeTime(Collector):
    """Series whose values are read when scraped (the router's size, telemetry's drops)."""

    def __init__(self) -> None:
        self.router_entries: Callable[[], float] | None = None
        self.dropped_spans: Callable[[], float] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.router_entries is not None:
            yield GaugeMetricFamily(prom_name(semconv.METRIC_PROXY_ROUTER_ENTRIES),
                                    "Conversations with decode metadata cached now.",
                                    value=self.router_entries())
        if self.dropped_spans is not None:
            yield CounterMetricFamily(
                prom_name(semconv.METRIC_PROXY_TELEMETRY_DROPPED),
                "Spans lost: queue full, export failed or store write failed.",
                value=self.dropped_spans())


class ProxyMetrics:
    """The proxy's series in their own registry; :meth:`observe` one finished turn."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.turns = Counter(
            prom_name(semconv.METRIC_PROXY_TURNS),
            "Turns the proxy finished, by route and outcome.",
            ["route", "outcome", "model_name", "prefill_instance", "decode_instance"],
            registry=registry)
        self.router_lookups = Counter(
            prom_name(semconv.METRIC_PROXY_ROUTER_LOOKUPS), "Router cache lookups, by result.",
            ["result", "model_name"], registry=registry)
        self.upstream_errors = Counter(
            prom_name(semconv.METRIC_PROXY_UPSTREAM_ERRORS),
            "Failed prefill or decode calls, by leg and kind.",
            ["leg", "kind", "model_name", "instance"], registry=registry)
        self.client_disconnects = Counter(
            prom_name(semconv.METRIC_PROXY_CLIENT_DISCONNECTS),
            "Clients that went away before their response ended.", ["model_name"],
            registry=registry)
        self.ttft = Histogram(
            prom_name(semconv.METRIC_PROXY_TTFT),
            "Request arrival to the first decode event sent to the client, seconds.",
            ["model_name", "prefill_instance", "decode_instance"],
            buckets=exposition.VLLM_TTFT_BUCKETS_S, registry=registry)
        self.leg_duration = Histogram(
            prom_name(semconv.METRIC_PROXY_LEG_DURATION),
            "Duration of the prefill and decode legs, seconds.",
            ["leg", "model_name", "instance"], buckets=exposition.LATENCY_BUCKETS_S,
            registry=registry)
        self.turn_duration = Histogram(
            prom_name(semconv.METRIC_PROXY_TURN_DURATION),
            "Request arrival to the last byte sent, seconds.", ["model_name"],
            buckets=exposition.LATENCY_BUCKETS_S, registry=registry)
        Info("kvscope_proxy_build", "kvscope proxy build information.",
             registry=registry).info({"version": __version__,
                                      "python": platform.python_version()})
        self.scrape_time = _ScrapeTime()
        registry.register(self.scrape_time)
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        self._models: set[str] = set()
        self._children: dict[tuple[str, ...], tuple[Any, ...]] = {}
        self._lookups: dict[tuple[str, str], Any] = {}
        self._exemplar_ns: dict[tuple[str, ...], list[int | None]] = {}

    def model_label(self, model: str | None, served: bool = True) -> str:
        """``model`` as a label value, bounded to :data:`MAX_MODEL_NAMES` distinct values.

        A name takes one of the slots only with a turn upstream ``served``: the first 32 names
        clients sent once took them for good, even names upstream refused (404 for a model it
        does not serve). Until then its turns count as :data:`OTHER_MODEL`.
        """
        if model is None:
            return ""
        if model in self._models:
            return model
        if not served or len(self._models) >= MAX_MODEL_NAMES:
            return OTHER_MODEL
        self._models.add(model)
        return model

    def observe(self, record: TurnRecordLike) -> None:
        """Count one finished turn (on the event loop; never raises into the turn: the caller
        catches)."""
        model = self.model_label(record.model, served=record.error_kind is None)
        prefill = record.prefill_instance or ""
        decode = record.decode_instance or ""
        key = (record.route or "", record.error_kind or "ok", model, prefill, decode)
        children = self._children.get(key)
        if children is None:
            # prometheus_client's labels() validates and locks on every call: a third of a
            # turn's metrics cost, so each label set's children are looked up once.
            children = self._children[key] = (
                self.turns.labels(*key), self.ttft.labels(model, prefill, decode),
                self.leg_duration.labels(semconv.LEG_PREFILL, model, prefill),
                self.leg_duration.labels(semconv.LEG_DECODE, model, decode),
                self.turn_duration.labels(model))
        turns, ttft, prefill_leg, decode_leg, turn_duration = children
        turns.inc()
        if record.lookup is not None:
            lookups = self._lookups.get((record.lookup, model))
            if lookups is None:
                lookups = self._lookups[(record.lookup, model)] = self.router_lookups.labels(
                    record.lookup, model)
            lookups.inc()
        if record.error_leg is not None and record.error_kind is not None:
            instance = prefill if record.error_leg == semconv.LEG_PREFILL else decode
            self.upstream_errors.labels(record.error_leg, record.error_kind, model,
                                        instance).inc()
        if record.client_disconnected:
            self.client_disconnects.labels(model).inc()
        if record.first_token_ns is not None:
            seconds = (record.first_token_ns - record.arrival_ns) / 1e9
            # An exemplar costs ~6 µs (prometheus_client validates and timestamps it) and a
            # bucket keeps only its latest, so each bucket takes one at most every
            # EXEMPLAR_EVERY_NS of the turns' own time: rare (tail) buckets still get theirs.
            latest = self._exemplar_ns.get(key)
            if latest is None:
                latest = self._exemplar_ns[key] = [None] * (len(exposition.VLLM_TTFT_BUCKETS_S) + 1)
            slot = bisect_left(exposition.VLLM_TTFT_BUCKETS_S, seconds)
            before = latest[slot]
            if before is None or record.end_ns - before >= EXEMPLAR_EVERY_NS:
                latest[slot] = record.end_ns
                ttft.observe(seconds, {"trace_id": f"{record.trace_id:032x}"})
            else:
                ttft.observe(seconds)
        if record.prefill_start_ns is not None and record.prefill_end_ns is not None:
            prefill_leg.observe((record.prefill_end_ns - record.prefill_start_ns) / 1e9)
        if record.decode_start_ns is not None and record.decode_end_ns is not None:
            decode_leg.observe((record.decode_end_ns - record.decode_start_ns) / 1e9)
        turn_duration.observe((record.end_ns - record.arrival_ns) / 1e9)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition in the format ``accept`` asks for: (body, Content-Type)."""
        return exposition.render(self.registry, accept)


__all__ = ["EXEMPLAR_EVERY_NS", "MAX_MODEL_NAMES", "OTHER_MODEL", "ProxyMetrics", "TurnRecordLike"]
