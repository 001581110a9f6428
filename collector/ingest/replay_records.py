"""``kvscope replay --output`` JSON lines → client-side ``kvscope.turn`` spans, as the benchmark's.

Each line is one request's :class:`kvscope.emulator.replay.RequestRecord` (``json.dumps(asdict
(record), sort_keys=True)``, ``emulator/replay.py``): the fields of vLLM's ``--stats-json-output``
(read by :mod:`.bench_stats`) plus ``turn_index``, ``attempt``, ``http_status`` and ``error``.
Its ``start_time_ms`` is the wall clock (Unix ms), so no anchor is needed. A turn is its last
attempt; the earlier ones (failed: replay re-sends only a failed turn) become
``kvscope.turn_attempt`` spans, and a turn whose last attempt failed is an errored turn with its
error. The records take part in the join with a proxy log like the benchmark's.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvscope import semconv
from kvscope.collector.ingest.bench_stats import BenchStats, BenchTurn
from kvscope.collector.ingest.spans import read_source
from kvscope.errors import IngestError

KIND = "kvscope-replay"

_NS_PER_MS = 1_000_000
# RequestRecord's fields the spans need, with their JSON types (None allowed where marked).
_REQUIRED = {"conversation_id": str, "turn_index": int, "attempt": int, "start_time_ms": float,
             "latency_ms": float, "input_num_turns": int, "input_num_tokens": int}
_OPTIONAL = {"ttft_ms": float, "tpot_ms": float, "output_num_tokens": int,
             "http_status": int, "error": str}


def looks_like(head: str) -> bool:
    """Whether the file's first line is a replay record (kind detection)."""
    first = head.lstrip().split("\n", 1)[0]
    if not first.startswith("{"):
        return False
    try:
        value = json.loads(first)
    except ValueError:
        return False
    return isinstance(value, dict) and all(
        key in value for key in ("conversation_id", "turn_index", "attempt", "start_time_ms",
                                 "http_status"))


def _checked(path: Path, number: int, value: object) -> dict:
    if not isinstance(value, dict):
        raise IngestError(f"{path}:{number}: not a JSON object (kvscope replay's records)")
    for key, kind in (*_REQUIRED.items(), *_OPTIONAL.items()):
        found = value.get(key)
        if found is None and key in _OPTIONAL:
            continue
        ok = (isinstance(found, int | float) and not isinstance(found, bool)
              if kind is float else isinstance(found, kind) and not isinstance(found, bool))
        if not ok:
            raise IngestError(f"{path}:{number}: field {key!r} is {found!r}, not "
                              f"{'a number' if kind is float else kind.__name__}")
    return value


def read(path: Path) -> BenchStats:
    """Parse one replay output; IngestError names the file and line of a problem."""
    source = read_source(path)
    attempts: dict[tuple[str, int], list[tuple[int, dict]]] = {}
    for number, raw in enumerate(source.text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise IngestError(f"{path}:{number}: not JSON: {exc.msg}") from None
        record = _checked(path, number, value)
        key = (record["conversation_id"], record["turn_index"])
        attempts.setdefault(key, []).append((number, record))
    if not attempts:
        raise IngestError(f"{path}:1: no replay record in this file")
    turns: list[BenchTurn] = []
    for (conversation, index), found in attempts.items():
        found.sort(key=lambda item: (item[1]["attempt"], item[0]))
        line, last = found[-1]
        failed = tuple((n, round(r["start_time_ms"] * _NS_PER_MS),
                        r.get("error") or f"HTTP {r.get('http_status')}") for n, r in found[:-1])
        ok = last.get("error") is None and last.get("http_status") == 200
        turns.append(BenchTurn(
            line=line, conversation_id=conversation, turn_index=index,
            messages=last["input_num_turns"],
            start_ns=round(last["start_time_ms"] * _NS_PER_MS),
            latency_ns=round(last["latency_ms"] * _NS_PER_MS),
            ttft_ms=last.get("ttft_ms"), tpot_ms=last.get("tpot_ms"),
            input_tokens=last["input_num_tokens"],
            output_tokens=last.get("output_num_tokens"),
            client_id=None,
            error=None if ok else (last.get("error") or f"HTTP {last.get('http_status')}"),
            failed_attempts=failed))
    turns.sort(key=lambda t: t.line)
    return BenchStats(path, source.sha256, turns, 0, kind=KIND,
                      service=semconv.SERVICE_KVSCOPE_REPLAY)


__all__ = ["KIND", "looks_like", "read"]
