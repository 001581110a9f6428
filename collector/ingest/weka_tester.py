"""The WEKA kv-cache-tester's output files → what the tester measured, recorded with the run.

The tester (``callanjfox/kv-cache-tester``) drives an OpenAI-compatible server and writes, in its
output directory (column names as its files have them):

* ``detailed_results_*.csv`` (cache-rate mode): one row per request, ``request_id, phase_id,
  working_set_size, cache_hit_rate, context_size, cached_tokens, unique_tokens, output_tokens,
  ttft, ttlt, generation_time, total_time, launch_time, finish_time, concurrency_level, itl``
  (times in seconds; ``cached_tokens`` is what the tester meant to be cached, not what the
  server reported);
* ``summary_trace_replay.csv`` (trace-replay mode): one row per assessment period,
  ``period_number, start_time, end_time, active_users, ..., ttft_avg, ttft_p50, ttft_p95,
  ttft_p99, avg_cache_hit_rate, ...``;
* ``user_lifecycle.csv``: ``timestamp, user_id, event_type, trace_id, details`` (started,
  completed, truncated, ...);
* ``test_metadata.json``: ``model``, ``api_endpoint``, ``mode``, ``timestamp``, ``config``
  (and ``trace_stats`` in trace-replay mode).

None of them names a conversation the way a P/D proxy sees it, nor a request id the servers
log, so they add no turn spans (a turn would be invented): kvscope records what each file
measured in the run's settings — per phase or period the request counts and TTFT percentiles
as the tester computed or as its rows give them, the lifecycle's events by type, the metadata
as written — next to the runs kvscope did watch. Each file is detected by its header (CSV) or
its keys (JSON).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.collector.ingest.spans import read_source
from kvscope.errors import IngestError
from kvscope.store.rows import TraceRows

KIND = "weka-kv-cache-tester"

DETAILED = ("request_id", "phase_id", "cached_tokens", "ttft", "launch_time", "finish_time")
SUMMARY = ("period_number", "start_time", "end_time", "requests_completed", "ttft_p50",
           "avg_cache_hit_rate")
LIFECYCLE = ("timestamp", "user_id", "event_type", "trace_id", "details")
METADATA = ("model", "api_endpoint", "mode", "config")
_FILES = {"detailed_results": DETAILED, "summary_trace_replay": SUMMARY,
          "user_lifecycle": LIFECYCLE}


@dataclass
class TesterOutput:
    """One of the tester's files: which one, and what the run records of it."""

    path: Path
    sha256: str
    file: str  # detailed_results, summary_trace_replay, user_lifecycle or test_metadata
    rows: int
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return self.rows

    def run_settings(self) -> dict[str, Any]:
        return {"tester_file": self.file, "rows": self.rows, "measured": self.measured}


def _header(head: str) -> list[str]:
    first = head.lstrip("\ufeff").split("\n", 1)[0].strip()
    return [name.strip() for name in first.split(",")]


def _which(head: str) -> str | None:
    stripped = head.lstrip()
    if stripped.startswith("{"):
        return "test_metadata" if all(f'"{key}"' in head for key in METADATA) else None
    columns = set(_header(head))
    for name, needed in _FILES.items():
        if columns.issuperset(needed):
            return name
    return None


def looks_like(head: str) -> bool:
    """Whether the file is one of the tester's outputs (by its header or keys)."""
    return _which(head) is not None


def _number(path: Path, line: int, column: str, text: str) -> float | None:
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        raise IngestError(f"{path}:{line}: column {column!r} is {text!r}, not a number") from None


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"ttft_p50_s": None, "ttft_p90_s": None}
    if len(values) == 1:
        return {"ttft_p50_s": values[0], "ttft_p90_s": values[0]}
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return {"ttft_p50_s": statistics.median(values), "ttft_p90_s": cuts[8]}


def _detailed(path: Path, rows: list[dict[str, str]]) -> dict[str, Any]:
    phases: dict[str, dict[str, list[float]]] = {}
    for line, row in enumerate(rows, start=2):
        phase = phases.setdefault(row["phase_id"], {"ttft": [], "cached": []})
        ttft = _number(path, line, "ttft", row["ttft"])
        cached = _number(path, line, "cached_tokens", row["cached_tokens"])
        if ttft is not None:
            phase["ttft"].append(ttft)
        if cached is not None:
            phase["cached"].append(cached)
    return {"phases": {
        name: {"requests": len(values["ttft"]), **_quantiles(values["ttft"]),
               "intended_cached_tokens": sum(values["cached"]) if values["cached"] else None}
        for name, values in phases.items()}}


def _summary(path: Path, rows: list[dict[str, str]]) -> dict[str, Any]:
    periods = []
    for line, row in enumerate(rows, start=2):
        periods.append({column: _number(path, line, column, row[column])
                        for column in ("period_number", "start_time", "end_time",
                                       "requests_completed", "ttft_p50", "avg_cache_hit_rate")})
    return {"periods": periods}


def _lifecycle(rows: list[dict[str, str]]) -> dict[str, Any]:
    events: dict[str, int] = {}
    for row in rows:
        events[row["event_type"]] = events.get(row["event_type"], 0) + 1
    return {"events": events, "users": len({row["user_id"] for row in rows})}


def read(path: Path) -> TesterOutput:
    """Parse one of the tester's files; IngestError names the file (and line) of a problem."""
    source = read_source(path)
    which = _which(source.text[:4096])
    if which is None:
        raise IngestError(f"{path}:1: not a kv-cache-tester output (a detailed_results, "
                          "summary_trace_replay or user_lifecycle CSV header, or "
                          "test_metadata.json's keys)")
    if which == "test_metadata":
        try:
            value = json.loads(source.text)
        except json.JSONDecodeError as exc:
            raise IngestError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise IngestError(f"{path}:1: not a JSON object")
        return TesterOutput(path, source.sha256, which, 1, value)
    rows = list(csv.DictReader(io.StringIO(source.text.lstrip("\ufeff"))))
    measured = (_detailed(path, rows) if which == "detailed_results"
                else _summary(path, rows) if which == "summary_trace_replay"
                else _lifecycle(rows))
    return TesterOutput(path, source.sha256, which, len(rows), measured)


def add_spans(parsed: TesterOutput, run_id: str, rows: TraceRows) -> int:
    """The tester's files add no span (they name no turn a proxy or server saw)."""
    return 0


__all__ = ["DETAILED", "KIND", "LIFECYCLE", "METADATA", "SUMMARY", "TesterOutput", "add_spans",
    "looks_like", "read"]
