"""vLLM's multi-turn benchmark ``--stats-json-output`` file → client-side ``kvscope.turn`` spans.

The format is vLLM 0.33.0's ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` (cited
below as ``bsmt.py:LINE``): a JSON array (``json.dump(stats_data, f, indent=2)``, bsmt.py:1755)
of ``RequestStats._asdict()`` objects (bsmt.py:1746), one per *successful* request (a request
whose response was not valid returns no stats, bsmt.py:464-466; warm-up requests are not in it,
bsmt.py:1672-1674). Each record becomes:

* one ``kvscope.turn`` span (kind CLIENT, ``kvscope.turn.observer`` = ``client``) from the
  request's start to its end, with the conversation id, the turn index, the client's TTFT as a
  ``first_token`` event and ``kvscope.ttft_ms``, and the client's token counts under their own
  names (the client counts message contents only, no chat template, so they are not the
  engine's ``gen_ai.usage.*`` counts);
* from a conversation's second recorded turn on, when the previous turn is in the file, one
  ``kvscope.tool_wait`` span from the previous response's end to this request's start (what the
  client did between its turns: its own pacing and its other conversations).

What the file cannot tell is left out, never guessed: the router's lookup, decode's params, the
engine's decisions and transfers, and whether the client sent its conversation id to the server
at all (``--send-conversation-id``, bsmt.py:1495, is not recorded). The ledger labels such turns
``unknown`` after the first, naming that evidence.

Times: ``start_time_ms`` is ``time.perf_counter_ns()`` in ms (bsmt.py:296, 366), a monotonic
clock with an arbitrary origin, so only differences are meaningful. kvscope places the last
response's end at the file's modification time (the benchmark writes the file right after its
last request, bsmt.py:1744-1755) and records that anchor in the run's settings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvscope import semconv
from kvscope.collector.ingest.spans import (
    KIND_CLIENT,
    KIND_INTERNAL,
    STATUS_ERROR,
    STATUS_UNSET,
    add_span,
    ingest_id,
    read_source,
    resource,
)
from kvscope.errors import IngestError
from kvscope.store.rows import Attrs, TraceRows

if TYPE_CHECKING:
    from kvscope.collector.ingest.proxy_log import ProxyRequest

KIND = "vllm-bench-stats"

# RequestStats (bsmt.py:119-131), in the writer's order, with the JSON types json.dump gives.
_FLOAT, _INT, _STR = "number", "integer", "string"
FIELDS: dict[str, str] = {
    "ttft_ms": _FLOAT,  # bsmt.py:120; -1.0 when not measured (bsmt.py:363)
    "tpot_ms": _FLOAT,  # bsmt.py:121; per token after the first chunk (bsmt.py:489-499)
    "latency_ms": _FLOAT,  # bsmt.py:122; request start to the stream's [DONE] (bsmt.py:312)
    "start_time_ms": _FLOAT,  # bsmt.py:123; perf_counter_ns in ms (bsmt.py:296, 366)
    "input_num_turns": _INT,  # bsmt.py:124; len(messages): 1, 3, 5, ... (bsmt.py:515)
    "input_num_tokens": _INT,  # bsmt.py:125; message contents only (bsmt.py:469)
    "output_num_tokens": _INT,  # bsmt.py:126; the streamed text tokenized (bsmt.py:482)
    "output_num_chunks": _INT,  # bsmt.py:127
    "output_num_first_chunk_tokens": _INT,  # bsmt.py:128
    "approx_cached_percent": _FLOAT,  # bsmt.py:129
    "conversation_id": _STR,  # bsmt.py:130; the client's id, sent or not (bsmt.py:460)
    "client_id": _INT,  # bsmt.py:131
}
_NS_PER_MS = 1_000_000
# Bounds of the numbers a record may hold. A time past ~31 years (perf_counter's clock starts
# at boot) or a count past int64 is no benchmark's: left unchecked, 1e300 ms overflowed the
# store's nanosecond timestamps only once the store was opened. Counts, ids and the record's
# own times are never negative; ttft_ms is -1.0 when not measured (bsmt.py:363).
_MAX_MS = 1e12
_MAX_COUNT = 2**63 - 1
_NON_NEGATIVE = ("start_time_ms", "latency_ms")


@dataclass(slots=True)
class BenchTurn:
    """One request of the benchmark, as its stats record says (times in the file's clock)."""

    line: int
    conversation_id: str
    turn_index: int
    messages: int
    start_ns: int
    latency_ns: int
    ttft_ms: float | None
    tpot_ms: float | None
    input_tokens: int
    output_tokens: int | None
    client_id: int | None
    # A failed request (kvscope replay's records; the benchmark writes successes only): its
    # error; and the earlier failed attempts of the same turn (their line, start, error).
    error: str | None = None
    failed_attempts: tuple[tuple[int, int, str], ...] = ()
    # The proxy's record of the same request, when the run's proxy log was joined (.join).
    proxy: ProxyRequest | None = None

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.latency_ns


@dataclass(frozen=True)
class BenchStats:
    """One parsed stats file."""

    path: Path
    sha256: str
    turns: list[BenchTurn]
    # Added to the file's clock to give Unix time: its last end lands on the file's mtime.
    clock_offset_ns: int
    # Who wrote it (kvscope replay's records are read into the same shape, .replay_records).
    kind: str = "vllm-bench-stats"
    service: str = semconv.SERVICE_VLLM_BENCHMARK

    @property
    def records(self) -> int:
        return len(self.turns)

    def run_settings(self) -> dict[str, Any]:
        """The clock anchor, recorded with the run (the file's times are perf_counter)."""
        if self.kind != KIND:
            return {"clock": "Unix time, as recorded"}
        return {"clock": "perf_counter, last end at the file's mtime",
                "clock_offset_ns": self.clock_offset_ns}


def looks_like(head: str) -> bool:
    """Whether the start of a file looks like a stats file (kind detection)."""
    if not head.lstrip().startswith("["):
        return False
    if head.replace(" ", "").replace("\n", "") == "[]":
        return True  # what the writer leaves when no request succeeded
    return all(f'"{name}"' in head for name in (
        "ttft_ms", "start_time_ms", "input_num_turns", "conversation_id"))


def _line(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    return index


@dataclass(frozen=True)
class _Place:
    """Where one record sits in its file, to name the line of a problem."""

    path: Path
    text: str
    start: int
    end: int
    line: int  # of ``start``

    def __call__(self, field: str | None = None) -> str:
        """``path:line`` of ``field``'s key in the record, else of the record's start."""
        index = self.text.find(f'"{field}"', self.start, self.end) if field else -1
        if index < 0:
            return f"{self.path}:{self.line}"
        return f"{self.path}:{self.line + self.text.count(chr(10), self.start, index)}"


def _elements(path: Path, text: str) -> Iterator[tuple[_Place, Any]]:
    """Each element of the top-level JSON array with where it sits."""
    decoder = json.JSONDecoder()
    i = _skip_space(text, 0)
    if i >= len(text) or text[i] != "[":
        raise IngestError(f"{path}:{_line(text, i)}: expected a JSON array of request stats")
    # Lines are counted on from the previous record, not from the top each time (a large
    # benchmark writes ~16 lines for each of 100k records).
    counted, line = 0, 1
    i = _skip_space(text, i + 1)
    if i < len(text) and text[i] == "]":
        end = i + 1
    else:
        while True:
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError as exc:
                raise IngestError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
            except ValueError:
                # Python refuses to convert an integer of more than 4300 digits.
                line += text.count("\n", counted, i)
                raise IngestError(f"{path}:{line}: a number in this record is too long "
                                  "to be a request stat") from None
            line += text.count("\n", counted, i)
            counted = i
            yield _Place(path, text, i, end, line), value
            i = _skip_space(text, end)
            if i < len(text) and text[i] == ",":
                i = _skip_space(text, i + 1)
                continue
            if i < len(text) and text[i] == "]":
                end = i + 1
                break
            raise IngestError(f"{path}:{_line(text, i)}: invalid JSON: expected ',' or ']' "
                              "in the array of request stats")
    rest = _skip_space(text, end)
    if rest < len(text):
        raise IngestError(f"{path}:{_line(text, rest)}: unexpected data after the array")


def _checked(place: _Place, record: Any) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise IngestError(f"{place()}: a request stats record must be an object, "
                          f"got {type(record).__name__}")
    missing = [name for name in FIELDS if name not in record]
    if missing:
        raise IngestError(f"{place()}: request stats record lacks {', '.join(missing)}")
    for name, kind in FIELDS.items():
        value = record[name]
        ok = (isinstance(value, str) if kind == _STR
              else isinstance(value, int) and not isinstance(value, bool) if kind == _INT
              else isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value))
        if not ok:
            raise IngestError(f"{place(name)}: {name} must be a finite {kind}, got {value!r}")
        if kind == _INT and not 0 <= value <= _MAX_COUNT:
            raise IngestError(f"{place(name)}: {name} must be between 0 and {_MAX_COUNT}, "
                              f"got {value!r}")
        if kind == _FLOAT:
            low = 0.0 if name in _NON_NEGATIVE else -_MAX_MS
            if not low <= value <= _MAX_MS:
                raise IngestError(f"{place(name)}: {name} must be between {low:g} and "
                                  f"{_MAX_MS:g}, got {value!r}")
    return record


def _turn(place: _Place, record: dict[str, Any]) -> BenchTurn:
    messages = record["input_num_turns"]
    # The benchmark sends a conversation's first 1, 3, 5, ... messages, each ending with a user
    # message (bsmt.py:413-418, 701-702 and 781): turn k carries 2k - 1 messages.
    if messages < 1 or messages % 2 == 0:
        raise IngestError(f"{place('input_num_turns')}: input_num_turns must be odd and "
                          f"positive (the benchmark sends 1, 3, 5, ... messages), got {messages}")
    ttft = record["ttft_ms"]
    return BenchTurn(
        line=place.line,
        conversation_id=record["conversation_id"],
        turn_index=(messages + 1) // 2,
        messages=messages,
        start_ns=round(record["start_time_ms"] * _NS_PER_MS),
        latency_ns=round(record["latency_ms"] * _NS_PER_MS),
        # The writer's sentinel for "no first token seen" (bsmt.py:363).
        ttft_ms=float(ttft) if ttft >= 0 else None,
        tpot_ms=float(record["tpot_ms"]),
        input_tokens=record["input_num_tokens"],
        output_tokens=record["output_num_tokens"],
        client_id=record["client_id"],
    )


def read(path: Path) -> BenchStats:
    """Parse and check one stats file; IngestError names the file and line of a problem."""
    source = read_source(path)
    text, mtime_ns = source.text, source.mtime_ns
    turns: list[BenchTurn] = []
    seen: dict[tuple[str, int], int] = {}
    for place, record in _elements(path, text):
        turn = _turn(place, _checked(place, record))
        key = (turn.conversation_id, turn.turn_index)
        if key in seen:
            raise IngestError(f"{place()}: conversation {turn.conversation_id!r} turn "
                              f"{turn.turn_index} already appears at line {seen[key]}")
        seen[key] = turn.line
        turns.append(turn)
    last_end = max((t.end_ns for t in turns), default=mtime_ns)
    return BenchStats(path, source.sha256, turns, mtime_ns - last_end)


# --- spans -------------------------------------------------------------------------------------


def turn_ids(sha256: str, turn: BenchTurn) -> tuple[str, str]:
    """The trace and span id of ``turn``'s span in the file of digest ``sha256``."""
    key = (turn.conversation_id, turn.turn_index)
    return ingest_id(sha256, *key, "trace", size=16), ingest_id(sha256, *key, "turn", size=8)


def add_spans(stats: BenchStats, run_id: str, rows: TraceRows) -> int:
    """Append the file's turn and tool-wait spans for run ``run_id``; return how many (a turn
    a proxy log was joined to carries its router evidence; the log adds its legs)."""
    from kvscope.collector.ingest import proxy_log

    resource_attrs = resource(stats.service, run_id, stats.kind, stats.path.name)
    offset = stats.clock_offset_ns
    ends: dict[tuple[str, int], int] = {
        (t.conversation_id, t.turn_index): t.end_ns for t in stats.turns
    }
    added = 0

    def add(name: str, trace_id: str, span_id: str, parent: str, kind: str, start_ns: int,
            end_ns: int, values: dict[str, Any], events: list[tuple[int, str, Attrs]],
            error: str | None = None) -> None:
        # Times in the file's clock: moved onto the Unix clock by the file's offset.
        add_span(rows, resource_attrs=resource_attrs, service=stats.service,
                 name=name, trace_id=trace_id, span_id=span_id, parent=parent, kind=kind,
                 start_ns=start_ns + offset, end_ns=end_ns + offset, values=values,
                 events=events, status=STATUS_ERROR if error is not None else STATUS_UNSET,
                 status_message=error or "")

    for turn in stats.turns:
        key = (turn.conversation_id, turn.turn_index)
        trace_id, span_id = turn_ids(stats.sha256, turn)
        values: dict[str, Any] = {
            semconv.GEN_AI_CONVERSATION_ID: turn.conversation_id,
            semconv.TURN_INDEX: turn.turn_index,
            semconv.TURN_OBSERVER: semconv.OBSERVER_CLIENT,
            semconv.MESSAGE_COUNT: turn.messages,
            semconv.CLIENT_INPUT_TOKENS: turn.input_tokens,
            semconv.CLIENT_OUTPUT_TOKENS: turn.output_tokens,
            semconv.CLIENT_TPOT_MS: turn.tpot_ms,
            semconv.CLIENT_ID: turn.client_id,
            semconv.TURN_ATTEMPTS: (len(turn.failed_attempts) + 1 if turn.failed_attempts
                                    else None),
        }
        if turn.proxy is not None:
            values.update(proxy_log.turn_values(turn.proxy))
        events: list[tuple[int, str, Attrs]] = []
        if turn.ttft_ms is not None:
            values[semconv.TTFT_MS] = turn.ttft_ms
            events.append((turn.start_ns + offset + round(turn.ttft_ms * _NS_PER_MS),
                           semconv.EVENT_FIRST_TOKEN, []))
        add(semconv.SPAN_TURN, trace_id, span_id, "", KIND_CLIENT, turn.start_ns,
            turn.end_ns, values, events, turn.error)
        added += 1
        for line, start_ns, error in turn.failed_attempts:
            # A failed request the client repeated: evidence of the turn, not a turn.
            add(semconv.SPAN_TURN_ATTEMPT, ingest_id(stats.sha256, *key, line, "trace", size=16),
                ingest_id(stats.sha256, *key, line, "attempt", size=8), "", KIND_CLIENT,
                start_ns, start_ns, {semconv.GEN_AI_CONVERSATION_ID: turn.conversation_id,
                                     semconv.TURN_INDEX: turn.turn_index,
                                     semconv.TURN_OBSERVER: semconv.OBSERVER_CLIENT,
                                     semconv.DURATION_MEASURED: False}, [], error)
            added += 1
        previous_end = ends.get((turn.conversation_id, turn.turn_index - 1))
        if previous_end is not None and previous_end <= turn.start_ns:
            add(semconv.SPAN_TOOL_WAIT, trace_id, ingest_id(stats.sha256, *key, "wait", size=8),
                span_id, KIND_INTERNAL, previous_end, turn.start_ns, {
                    semconv.GEN_AI_CONVERSATION_ID: turn.conversation_id,
                    semconv.TURN_INDEX: turn.turn_index,
                    semconv.WAIT_SOURCE: semconv.WAIT_INFERRED,
                }, [])
            added += 1
    return added


__all__ = ["BenchStats", "BenchTurn", "FIELDS", "KIND", "add_spans", "looks_like", "read",
    "turn_ids"]
