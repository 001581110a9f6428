"""vLLM's own ``/metrics`` for an emulated engine: the series kvscope reconciles the ledger with.

Each emulated server answers ``GET /metrics`` in Prometheus text, named, labelled
(``model_name``, ``engine`` "0") and counted as vLLM 0.33.0 counts them, so ``kvscope ingest
vllm-prefill-metrics:FILE`` and the ``reconciliation`` analysis run on an emulator run as on real
servers:

* ``vllm:prompt_tokens``, ``vllm:prompt_tokens_by_source{source}``, ``vllm:prompt_tokens_cached``
  (``v1/metrics/loggers.py``), prefill only: per request, the local hit and the tokens scheduled
  to load from decode at its first schedule (``PrefillStats.set`` in ``scheduler.py``, skipped
  after a preemption), counted when the request first emits output (``take_prefill_stats``); a
  request ended in error (a failed load, policy fail: the scheduler's error output carries no
  stats) or parked for good (a stalled re-issued load) is not counted;
* the NIXL connector's (``kv_connector/v1/nixl/stats.py``), on the engine whose worker reads:
  ``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred`` observed per finished READ
  (prefill's D→P readbacks, decode's P→D pulls), ``vllm:nixl_num_failed_transfers`` (a failed
  READ or handshake, grouped as vLLM groups them), ``vllm:nixl_num_kv_expired_reqs`` (a read
  prefill declined as expired, ``_read_blocks_for_req``; a decode retention its TTL reaper
  released unread, ``_reap_expired_send_leases``, since decode's retained blocks are send leases
  too) and ``vllm:nixl_num_notifications_after_expiry`` (decode: a READ or notify-only message
  for a request it no longer tracks).

Not modelled, so never counted here where vLLM could count them: prefill's own send leases
(P→D blocks held for a decode read that never comes) expiring, failed notifications, and
``vllm:prompt_tokens_by_source`` on decode.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvscope import semconv

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM 0.33.0's buckets (nixl/stats.py: xfer time uses the list without its first entry).
_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class VllmMetrics:
    """One emulated engine's vLLM counters (one registry per engine, as one vLLM server)."""

    def __init__(self, model_name: str, *, prefill: bool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        values = (model_name, "0")
        reg = self.registry
        self._prompt = self._by_source = self._cached = None
        if prefill:
            self._prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                   labels, registry=reg).labels(*values)
            by_source = Counter("vllm:prompt_tokens_by_source",
                                "Number of prompt tokens by source.", (*labels, "source"),
                                registry=reg)
            self._by_source = {s: by_source.labels(*values, s) for s in _SOURCES}
            self._cached = Counter("vllm:prompt_tokens_cached",
                                   "Number of cached prompt tokens (local + external).",
                                   labels, registry=reg).labels(*values)
        self._xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.", labels,
            buckets=_XFER_TIME_BUCKETS, registry=reg).labels(*values)
        self._bytes = Histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.", labels,
            buckets=_BYTES_BUCKETS, registry=reg).labels(*values)
        self._failed = Counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification "
            "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
            labels, registry=reg).labels(*values)
        self._failed_notifications = Counter(
            "vllm:nixl_num_failed_notifications",
            "Number of failed NIXL KV Cache notifications. Retained for compatibility; these "
            "failures are also included in vllm:nixl_num_failed_transfers.",
            labels, registry=reg).labels(*values)
        self._expired = Counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the "
            "P instance.", labels, registry=reg).labels(*values)
        self._after_expiry = Counter(
            "vllm:nixl_num_notifications_after_expiry",
            "Number of completion notifications for requests that were no longer tracked, "
            "usually because their KV lease expired. The KV blocks may have been reused before "
            "the transfer finished. Counted per notification (one per remote rank), not per "
            "request.", labels, registry=reg).labels(*values)

    def prompt(self, prompt_tokens: int, local_hit_tokens: int, external_tokens: int) -> None:
        """One request's prompt tokens by source, as its first schedule counted them."""
        if self._prompt is None or self._by_source is None or self._cached is None:
            raise RuntimeError("prompt tokens are counted on prefill engines only")
        self._prompt.inc(prompt_tokens)
        self._by_source["local_cache_hit"].inc(local_hit_tokens)
        self._by_source["external_kv_transfer"].inc(external_tokens)
        self._by_source["local_compute"].inc(prompt_tokens - local_hit_tokens - external_tokens)
        self._cached.inc(local_hit_tokens + external_tokens)

    def transfer(self, status: str, seconds: float, size_bytes: int) -> None:
        """One READ this engine's worker made (or declined), by its status."""
        if status == semconv.TRANSFER_OK:
            self._xfer_time.observe(seconds)
            self._bytes.observe(size_bytes)
        elif status == semconv.TRANSFER_DECLINED_EXPIRED:
            self._expired.inc()
        else:  # a failed READ or handshake: vLLM groups both in num_failed_transfers
            self._failed.inc()

    def lease_expired(self, count: int = 1) -> None:
        """Send leases (decode's retained blocks) the reaper released unread."""
        self._expired.inc(count)

    def notifications_after_expiry(self, count: int) -> None:
        """READ or notify-only messages for requests no longer tracked."""
        self._after_expiry.inc(count)

    def exposition(self) -> bytes:
        """The registry in Prometheus text, as vLLM's ``/metrics`` serves it."""
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "VllmMetrics"]
