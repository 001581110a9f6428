"""The proxy's export process: same spans as in-process, drops counted, never in the way."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from kvscope import semconv
from kvscope.boundary_key import BoundaryKey
from kvscope.child import pack, unpack
from kvscope.collector.otel import setup_telemetry
from kvscope.collector.proxy.conversation import ConversationId
from kvscope.collector.proxy.export_process import (
    CHILD_NICE,
    TurnExportProcess,
    record_from_tuple,
    record_to_tuple,
    resolve_boundaries,
    span_count,
)
from kvscope.collector.proxy.telemetry import ProxyTelemetry, TurnRecord
from kvscope.errors import StoreLockedError
from kvscope.reuse.boundaries import boundary_hashes, chain_boundary
from tests.stores import query

KEY = BoundaryKey(b"test boundary key, 32 bytes long", "test")
COLUMNS = ("SpanName, TraceId, SpanId, ParentSpanId, SpanKind, ServiceName, ResourceAttributes, "
           "ScopeName, ScopeVersion, SpanAttributes, Duration, StatusCode, StatusMessage, "
           "Events, Timestamp")


def _turns(telemetry: ProxyTelemetry, n: int, *, seed: int = 7) -> list[TurnRecord]:
    """``n`` finished turns over 3 conversations (tool waits from the second turn), some failed."""
    records = []
    base = 1_767_225_600_000_000_000 + seed
    for i in range(n):
        record = telemetry.begin_turn("/v1/chat/completions", f"req-{seed}-{i}", None, None)
        record.trace_id, record.turn_span_id = (seed << 64) + i + 1, 3 * i + 1
        record.prefill_span_id, record.decode_span_id = 3 * i + 2, 3 * i + 3
        record.arrival_ns = base + i * 1_000_000
        telemetry.conversation_started(record, ConversationId(f"conv-{i % 3}", "body"))
        record.model, record.stream, record.lookup = "qwen", True, semconv.ROUTER_HIT
        # A large message too: hashlib drops the GIL above 2 KiB, on the sender thread.
        telemetry.message_boundaries(record, {"messages": [
            {"role": "system", "content": "s" * 5000},
            {"role": "user", "content": f"task {i % 3}"},
            {"role": "assistant", "content": [{"type": "text", "text": f"step {i}"}]},
        ]})
        record.prefill_start_ns, record.prefill_end_ns = record.arrival_ns + 10, base + 20
        record.prompt_tokens, record.cached_tokens = 1000 + i, 16
        if i % 4 == 3:
            record.fail(semconv.LEG_DECODE, "upstream_timeout", 504, "decode timed out")
        else:
            record.decode_start_ns = record.arrival_ns + 30
            record.first_token_ns, record.decode_end_ns = record.arrival_ns + 40, base + 90
            record.output_tokens, record.chunks, record.finish_reasons = 16, 17, ["stop"]
        if i % 5 == 2:  # an agent's traceparent: the turn span's parent is remote
            record.remote_parent_span_id = 1000 + i
        record.end_ns = record.arrival_ns + 100
        records.append(record)
    return records


def _rows(db: Path) -> list[tuple[Any, ...]]:
    rows = query(db, f"SELECT {COLUMNS} FROM otel_traces")
    # A tool wait's span id is drawn at build time, and every resource has its own
    # service.instance.id; every other field must match.
    out = []
    for row in rows:
        values = list(row)
        if values[0] == semconv.SPAN_TOOL_WAIT:
            values[2] = "-"
        values[6] = {k: v for k, v in values[6].items() if k != "service.instance.id"}
        out.append(tuple(values))
    return sorted(out, key=repr)


def test_a_record_survives_the_pipe_field_for_field() -> None:
    telemetry = ProxyTelemetry(None)
    record = _turns(telemetry, 2)[1]
    record.remote_parent_span_id, record.tracestate = 99, "k=v"
    record.conversation = ConversationId("c", "header", "too_long")
    record.turn_index, record.previous_end_ns, record.lookup_age_s = 5, 12, 1.5
    record.offered_request_id, record.offered_tokens = "chatcmpl-x", 160
    record.d_metadata_attached, record.retention_returned = True, True
    record.reuse_guard, record.history_last = "history_edited", "00cc"
    record.prefill_instance, record.decode_instance = "127.0.0.1:1", "127.0.0.1:2"
    record.prefill_request_id, record.decode_request_id = "p-1", "d-1"
    record.remote_num_tokens, record.retention_blocks = 175, 11
    record.client_disconnected, record.error_leg = True, "prefill"
    record.decode_streamed, record.decode_cached_tokens = False, 96
    record.error_kind, record.error_message, record.status_code = "x", "y", 502
    record.boundary_hashes, record.boundary_roles, record.message_count = "00aa,00bb", "su", 2
    record.boundary_key_id = KEY.key_id
    body = {"model": "m", "stream": True, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    record.boundary_source = body
    # A streamed reply's events, hashed on arrival after the messages.
    record.reply_source = (b'{"choices":[{"index":0,"delta":{"content":"he"}}]}',
                           b'{"choices":[{"index":0,"delta":{"content":"llo"}}]}')
    record.reply_hash = "ff"
    for f in fields(TurnRecord):  # a new field must be filled here too
        assert getattr(record, f.name) not in (None, f.default, [], ""), f.name
    record.reply_hash = None  # still to hash
    packed = pack(record_to_tuple(record))
    assert packed[:1] == b"M"  # plain values: marshalled
    received = record_from_tuple(unpack(packed))
    # Only the messages travel with it (not the rest of the body); hashed on arrival.
    assert received.boundary_source == {"messages": body["messages"]}
    resolve_boundaries(received, KEY)
    assert received.boundary_source is None
    assert (received.message_count, received.boundary_hashes) == boundary_hashes(body, KEY)
    assert received.boundary_roles == "su"
    assert received.reply_source is None
    assert received.reply_hash == chain_boundary(bytes.fromhex("00cc"), "assistant", "hello",
                                                 KEY).hex()
    record.boundary_source = record.reply_source = None
    record.boundary_hashes, record.reply_hash = received.boundary_hashes, received.reply_hash
    assert received == record


def test_a_completions_prompt_is_hashed_as_one_user_message() -> None:
    record = _turns(ProxyTelemetry(None), 1)[0]
    record.boundary_source = {"prompt": "once upon a time", "max_tokens": 5}
    received = record_from_tuple(record_to_tuple(record))
    assert received.boundary_source == {"prompt": "once upon a time"}
    resolve_boundaries(received, KEY)
    assert (received.message_count, received.boundary_hashes) == boundary_hashes(
        {"prompt": "once upon a time"}, KEY)
    assert received.boundary_roles == "u"


def test_spans_from_the_export_process_equal_the_in_process_spans(tmp_path: Path) -> None:
    inproc_db, process_db = tmp_path / "inproc.duckdb", tmp_path / "process.duckdb"
    inproc = ProxyTelemetry(setup_telemetry(semconv.SERVICE_PROXY, db=str(inproc_db)),
                            router_ttl_s=450.0, boundary_key=KEY)
    process = ProxyTelemetry(None, router_ttl_s=450.0, export_process=TurnExportProcess(
        semconv.SERVICE_PROXY, db=str(process_db), router_ttl_s=450.0, boundary_key=KEY))
    try:
        for telemetry in (inproc, process):
            for record in _turns(telemetry, 40):
                telemetry.finish_turn(record)
            assert telemetry.flush(60)
        counts = process.telemetry_counts()
        expected = sum(span_count(r) for r in _turns(ProxyTelemetry(None), 40))
        assert counts["exported_spans"] == counts["queued_spans"] == expected
        assert counts["dropped_spans"] == 0
    finally:
        inproc.shutdown()
        process.shutdown()
    rows = _rows(process_db)
    assert len(rows) == expected
    assert rows == _rows(inproc_db)
    hashes = {r[9].get(semconv.MESSAGE_BOUNDARY_HASHES) for r in rows
              if r[0] == semconv.SPAN_TURN}
    assert len(hashes) == 40 and None not in hashes  # hashed by the export process, per turn


def test_sdk_spans_carry_the_ids_parents_and_first_token_event_of_the_record() -> None:
    telemetry = ProxyTelemetry(None, router_ttl_s=450.0)
    records = _turns(telemetry, 3)
    for record in records:
        resolve_boundaries(record, KEY)
    turn, prefill, decode, *tool_wait = telemetry.spans_for(records[2])
    record = records[2]
    assert turn.context is not None and turn.parent is not None
    assert (turn.context.trace_id, turn.context.span_id, turn.context.is_remote) == (
        record.trace_id, record.turn_span_id, False)
    assert (turn.parent.span_id, turn.parent.is_remote) == (1002, True)
    for span in (turn, prefill, decode, *tool_wait):
        assert span.context is not None and span.context.trace_flags.sampled
    for span, span_id in ((prefill, record.prefill_span_id), (decode, record.decode_span_id)):
        assert span.context is not None and span.parent is not None
        assert span.context.span_id == span_id
        assert (span.parent.span_id, span.parent.is_remote) == (record.turn_span_id, False)
    assert record.first_token_ns is not None
    for span in (turn, decode):
        (event,) = span.events
        assert (event.name, event.timestamp) == (semconv.EVENT_FIRST_TOKEN,
                                                 record.first_token_ns)
        assert dict(event.attributes or {}) == {semconv.TTFT_MS: 40 / 1e6}
    assert prefill.events == ()


def _finish_turns(n: int, **export: Any
                  ) -> tuple[TurnExportProcess, ProxyTelemetry, list[TurnRecord]]:
    """Telemetry sending through a new export process (``export``: its options), ``n`` turns
    finished."""
    process = TurnExportProcess(semconv.SERVICE_PROXY, **export)
    telemetry = ProxyTelemetry(None, export_process=process)
    records = _turns(telemetry, n)
    for record in records:
        telemetry.finish_turn(record)
    return process, telemetry, records


def test_close_exports_everything_submitted(tmp_path: Path) -> None:
    db = tmp_path / "close.duckdb"
    _, telemetry, records = _finish_turns(25, db=str(db), send_interval_s=5.0)
    telemetry.shutdown()  # no flush first: close itself sends and waits
    assert len(_rows(db)) == sum(span_count(r) for r in records)


def test_a_submitted_turn_keeps_nothing_of_itself_on_the_proxys_heap(tmp_path: Path) -> None:
    # The queue holds packed bytes: the record (and the request body it references) go as
    # soon as the turn is submitted, not when the sender thread ships it.
    process = TurnExportProcess(semconv.SERVICE_PROXY, db=str(tmp_path / "heap.duckdb"),
                                send_interval_s=5.0)
    telemetry = ProxyTelemetry(None, export_process=process)
    try:
        record = _turns(telemetry, 1)[0]
        spans = span_count(record)
        body = record.boundary_source
        before = sys.getrefcount(record), sys.getrefcount(body)
        telemetry.finish_turn(record)
        assert (sys.getrefcount(record), sys.getrefcount(body)) == before
        assert telemetry.telemetry_counts()["pending_turns"] == 1  # still queued, as bytes
    finally:
        telemetry.shutdown()
    assert len(_rows(tmp_path / "heap.duckdb")) == spans


def test_the_export_process_serves_after_the_proxy_at_its_lower_priority(tmp_path: Path) -> None:
    # Lowered once it is ready (its imports and store open run at the proxy's own priority, so
    # a busy host does not hold the proxy's start back), then kept for as long as it runs.
    process = TurnExportProcess(semconv.SERVICE_PROXY, db=str(tmp_path / "nice.duckdb"))
    try:
        pid = process._process.pid
        assert pid is not None
        deadline = time.monotonic() + 10
        expected = min(os.getpriority(os.PRIO_PROCESS, 0) + CHILD_NICE, 19)
        while os.getpriority(os.PRIO_PROCESS, pid) != expected:
            assert time.monotonic() < deadline, os.getpriority(os.PRIO_PROCESS, pid)
            time.sleep(0.01)
    finally:
        process.close()


def test_a_locked_store_fails_at_start_with_the_store_error(tmp_path: Path) -> None:
    db = tmp_path / "locked.duckdb"
    holder = setup_telemetry(semconv.SERVICE_PROXY, db=str(db))  # this process holds the lock
    try:
        with pytest.raises(StoreLockedError, match="locked"):
            TurnExportProcess(semconv.SERVICE_PROXY, db=str(db))
    finally:
        holder.shutdown()


def test_a_dead_export_process_costs_spans_not_turns(tmp_path: Path) -> None:
    process = TurnExportProcess(semconv.SERVICE_PROXY, db=str(tmp_path / "dead.duckdb"),
                                send_interval_s=0.005)
    telemetry = ProxyTelemetry(None, export_process=process)
    try:
        process._process.kill()
        process._process.join(10)
        records = _turns(telemetry, 30)
        deadline = time.monotonic() + 10
        for record in records:
            telemetry.finish_turn(record)  # never raises
        while telemetry.dropped_spans() < sum(map(span_count, records)):
            assert time.monotonic() < deadline, telemetry.telemetry_counts()
            time.sleep(0.01)
        assert telemetry.dropped_spans() == sum(map(span_count, records))
        assert not telemetry.flush(1)
        turns = sum(sample.value for family in telemetry.metrics.registry.collect()
                    for sample in family.samples if sample.name == "kvscope_proxy_turns_total")
        assert turns == len(records)  # metrics go on
    finally:
        telemetry.shutdown()


def test_sigterm_makes_the_export_process_store_what_it_received(tmp_path: Path) -> None:
    db = tmp_path / "term.duckdb"
    process, telemetry, records = _finish_turns(20, db=str(db), send_interval_s=0.005)
    deadline = time.monotonic() + 30
    while process.counts()["queued_spans"] < sum(map(span_count, records)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pid = process._process.pid
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    process._process.join(30)
    assert process._process.exitcode == 0
    telemetry.shutdown()
    assert len(_rows(db)) == sum(map(span_count, records))


def test_a_sigterm_that_stops_the_proxy_too_keeps_the_turns_it_still_ends(
        tmp_path: Path) -> None:
    """A stop of the whole process group (systemd's default KillMode) signals the child with
    the proxy: the proxy says it is stopping, still ends its turns in flight (aiohttp waits for
    them) and closes the child, which receives them all before it flushes. Before, the child
    stopped at its signal and those turns were lost."""
    db = tmp_path / "group.duckdb"
    process = TurnExportProcess(semconv.SERVICE_PROXY, db=str(db), send_interval_s=0.005)
    telemetry = ProxyTelemetry(None, export_process=process)
    records = _turns(telemetry, 20)
    for record in records[:10]:
        telemetry.finish_turn(record)
    telemetry.stopping()
    pid = process._process.pid
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    time.sleep(3.0)  # past the child's wait for the proxy's word
    assert process._process.is_alive()
    for record in records[10:]:  # the turns that were in flight end now
        telemetry.finish_turn(record)
    telemetry.shutdown()
    assert process._process.exitcode == 0
    assert process.stats.dropped_records == 0
    assert len(_rows(db)) == sum(map(span_count, records))


def test_turns_finishing_after_close_are_dropped_and_counted(tmp_path: Path) -> None:
    db = tmp_path / "late.duckdb"
    process = TurnExportProcess(semconv.SERVICE_PROXY, db=str(db))
    telemetry = ProxyTelemetry(None, export_process=process)
    records = _turns(telemetry, 10)
    for record in records[:4]:
        telemetry.finish_turn(record)
    telemetry.shutdown()
    for record in records[4:]:  # e.g. streams still ending while the proxy shuts down
        telemetry.finish_turn(record)
    assert process.stats.dropped_records == 6
    assert telemetry.dropped_spans() == sum(map(span_count, records[4:]))
    assert len(_rows(db)) == sum(map(span_count, records[:4]))


def test_an_unreachable_otlp_endpoint_costs_counted_spans_only() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from upstream_stub import free_port

    process = TurnExportProcess(semconv.SERVICE_PROXY,
                                otlp_endpoint=f"http://127.0.0.1:{free_port()}")
    telemetry = ProxyTelemetry(None, export_process=process)
    try:
        records = _turns(telemetry, 12)
        for record in records:
            telemetry.finish_turn(record)
        telemetry.flush(60)  # the exporter gives up on the dead endpoint
        deadline = time.monotonic() + 60
        while telemetry.dropped_spans() < sum(map(span_count, records)):
            assert time.monotonic() < deadline, telemetry.telemetry_counts()
            time.sleep(0.05)
        assert telemetry.telemetry_counts()["exported_spans"] == 0
    finally:
        telemetry.shutdown()
