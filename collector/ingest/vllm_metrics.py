"""A snapshot of a vLLM server's ``/metrics`` (Prometheus text) → vLLM's own reuse counters.

vLLM 0.33.0 exposes, per ``model_name`` and ``engine`` label (``v1/metrics/loggers.py``):

* ``vllm:prompt_tokens_by_source{source=...}`` (loggers.py:757-769; sources
  ``local_compute``, ``local_cache_hit``, ``external_kv_transfer``, ``v1/metrics/stats.py:
  441-467``): every prompt token, by where its KV came from. On prefill,
  ``external_kv_transfer`` is the tokens its connector loaded from decode (D→P); on decode, the
  tokens it loaded from prefill (P→D);
* ``vllm:prompt_tokens_cached_by_source{source=...}`` (loggers.py:781-797; sources of
  ``v1/metrics/cache_hit_source.py``: ``device``, ``host``, ``p2p``, ``disk``,
  ``external_unspecified``), counted at admission;
* ``vllm:num_requests_kv_fetch_by_stage{stage=...}`` (loggers.py:569-590, a consumer's gauge);
* the NIXL connector's (``kv_connector/v1/nixl/stats.py:180-285``): the histograms
  ``vllm:nixl_xfer_time_seconds`` (its ``_count`` is the transfers that finished) and
  ``vllm:nixl_bytes_transferred`` (its ``_sum`` the bytes), and the counters
  ``vllm:nixl_num_failed_transfers``, ``vllm:nixl_num_failed_notifications``,
  ``vllm:nixl_num_kv_expired_reqs`` and ``vllm:nixl_num_notifications_after_expiry``.

A counter's exposition name ends in ``_total`` (prometheus_client). The values are cumulative
since the server started: a snapshot taken after the run holds the run's counts only when the
server served nothing else (kvscope records them as found and says so). A series the snapshot
lacks is not measured (left out), never 0. Kind detection: a ``# TYPE vllm:`` line or a sample
of a ``vllm:`` metric.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope import semconv
from kvscope.collector.ingest.spans import read_source
from kvscope.errors import IngestError
from kvscope.store.rows import TraceRows

KIND = "vllm-metrics"
KIND_PREFILL = "vllm-prefill-metrics"
KIND_DECODE = "vllm-decode-metrics"

_DETECT = re.compile(r"^(?:# (?:TYPE|HELP) )?vllm:[a-z_]+", re.MULTILINE)

# Exposition name (after prometheus_client's parser drops _total/_count/_sum per family) →
# (family, sample suffix, label that splits it, kvscope's counter name).
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
KV_FETCH_BY_STAGE = "vllm:num_requests_kv_fetch_by_stage"
# (sample name, kvscope's name) of the NIXL connector's series.
NIXL_SAMPLES = (
    ("vllm:nixl_xfer_time_seconds_count", "nixl_transfers"),
    ("vllm:nixl_bytes_transferred_sum", "nixl_bytes_transferred"),
    ("vllm:nixl_num_failed_transfers_total", "nixl_failed_transfers"),
    ("vllm:nixl_num_failed_notifications_total", "nixl_failed_notifications"),
    ("vllm:nixl_num_kv_expired_reqs_total", "nixl_kv_expired_reqs"),
    ("vllm:nixl_num_notifications_after_expiry_total", "nixl_notifications_after_expiry"),
)
_SPLIT = ((f"{PROMPT_TOKENS_BY_SOURCE}_total", "source", "prompt_tokens_"),
          (f"{CACHED_BY_SOURCE}_total", "source", "cached_tokens_"),
          (KV_FETCH_BY_STAGE, "stage", "kv_fetch_"))


@dataclass
class VllmMetrics:
    """One parsed /metrics snapshot: per engine (``model_name``/``engine`` labels), the
    counters it holds."""

    path: Path
    sha256: str
    role: str | None
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: int = 0

    @property
    def records(self) -> int:
        return len(self.engines)

    def run_settings(self) -> dict[str, Any]:
        return {"role": self.role, "vllm_counters": self.engines,
                "counters_note": "cumulative since the server started, as scraped"}


def looks_like(head: str) -> bool:
    """Whether the start of a file is a Prometheus text snapshot of vLLM's metrics."""
    return _DETECT.search(head) is not None


def _engine_key(labels: dict[str, str]) -> str:
    model, engine = labels.get("model_name"), labels.get("engine")
    return f"{model or ''}/{engine or ''}"


def read_role(path: Path, role: str | None) -> VllmMetrics:
    """Parse one snapshot; IngestError names the file (and line) of a problem."""
    from prometheus_client.parser import text_string_to_metric_families

    source = read_source(path)
    parsed = VllmMetrics(path, source.sha256, role)
    wanted = dict(NIXL_SAMPLES)
    split = {name: (label, prefix) for name, label, prefix in _SPLIT}
    try:
        families = list(text_string_to_metric_families(source.text))
    except (ValueError, TypeError, IndexError) as exc:
        raise IngestError(f"{path}: not Prometheus text exposition: {exc}") from None
    for family in families:
        for sample in family.samples:
            if not sample.name.startswith("vllm:"):
                continue
            parsed.samples += 1
            if math.isnan(sample.value):
                continue
            name = wanted.get(sample.name)
            if name is None and sample.name in split:
                label, prefix = split[sample.name]
                if sample.labels.get(label):
                    name = prefix + sample.labels[label]
            if name is None:
                continue
            counters = parsed.engines.setdefault(_engine_key(sample.labels), {})
            counters[name] = counters.get(name, 0.0) + sample.value
    if parsed.samples == 0:
        raise IngestError(f"{path}:1: no vllm: sample in this Prometheus text (is it a vLLM "
                          "server's /metrics?)")
    return parsed


# A scrape's body beyond this is refused (a vLLM server's /metrics is a few hundred KiB).
SCRAPE_MAX_BYTES = 64 * 1024 * 1024
SCRAPE_TIMEOUT_S = 10.0


def scrape(url: str, into: Path) -> Path:
    """GET ``url`` (a vLLM server's ``/metrics``) now and keep the body as a snapshot file in
    ``into``, named after the host and port; IngestError names the URL on any failure."""
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(url)
    name = f"metrics-{parts.hostname or 'host'}-{parts.port or parts.scheme}.prom"
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            body = response.read(SCRAPE_MAX_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise IngestError(f"{url}: cannot scrape: {getattr(exc, 'reason', exc)}") from None
    if len(body) > SCRAPE_MAX_BYTES:
        raise IngestError(f"{url}: more than {SCRAPE_MAX_BYTES} bytes; not a /metrics page")
    path = into / name
    path.write_bytes(body)
    return path


def read(path: Path) -> VllmMetrics:
    """A snapshot whose server's role was not named."""
    return read_role(path, None)


# A file whose server's role was named (``vllm-prefill-...:FILE``, ``--kind``).
read_prefill = functools.partial(read_role, role=semconv.ROLE_PREFILL)
read_decode = functools.partial(read_role, role=semconv.ROLE_DECODE)


def add_spans(parsed: VllmMetrics, run_id: str, rows: TraceRows) -> int:
    """A snapshot adds no span: its counters are recorded with the run (run_settings)."""
    return 0


__all__ = ["CACHED_BY_SOURCE", "KIND", "KIND_DECODE", "KIND_PREFILL", "KV_FETCH_BY_STAGE",
    "NIXL_SAMPLES", "PROMPT_TOKENS_BY_SOURCE", "SCRAPE_MAX_BYTES", "SCRAPE_TIMEOUT_S",
    "VllmMetrics", "add_spans", "looks_like", "read", "read_decode", "read_prefill", "read_role",
    "scrape"]
