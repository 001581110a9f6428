"""Span rows are idempotent under exporter retries: the ledger counts a resent span once.

OTLP delivery is at least once. When ``kvscope serve`` commits a request's rows and dies before
its answer reaches the exporter, the exporter sends the same spans again and the store holds
them twice (1,200 and 1,001 duplicate rows in two kill runs). The ledger's extraction queries
read each span once (``SELECT DISTINCT`` over columns that include its SpanId), so its turns
are those of a store that received every span once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from kvscope.analysis import ledger
from kvscope.collector.receiver import Receiver
from kvscope.store.source import open_reader
from tests.collector.test_receiver import _spans

ROOT = Path(__file__).resolve().parents[2]

# A receiver that SIGKILLs itself after its first request's rows are committed, before the
# request is answered.
_DIES_AFTER_COMMIT = textwrap.dedent("""
    import os, signal, sys, time
    from kvscope.collector import otlp_intake
    from kvscope.collector.receiver import Receiver

    commit = otlp_intake.Intake._commit

    async def commit_then_die(self, signal_kind, table):
        await commit(self, signal_kind, table)
        os.kill(os.getpid(), signal.SIGKILL)

    otlp_intake.Intake._commit = commit_then_die
    with Receiver(sys.argv[1]) as rx:
        print(rx.url, flush=True)
        time.sleep(120)
""")


def _ledger(path: Path) -> list[tuple[object, ...]]:
    reader = open_reader(path)
    try:
        frame = ledger.ledger(reader)
    finally:
        reader.close()
    return sorted(frame.select("conversation_id", "turn_index", "ttft_ms").rows())


def test_spans_resent_after_a_kill_between_commit_and_answer_count_once(tmp_path: Path) -> None:
    spans = _spans(3, "retried")
    store = tmp_path / "retried.duckdb"
    dying = subprocess.Popen([sys.executable, "-c", _DIES_AFTER_COMMIT, str(store)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert dying.stdout is not None
        url = dying.stdout.readline().strip()
        first = OTLPSpanExporter(endpoint=f"{url}/v1/traces", timeout=5)
        assert first.export(spans) is not SpanExportResult.SUCCESS  # no answer came
        assert dying.wait(30) == -signal.SIGKILL
    finally:
        if dying.poll() is None:
            dying.kill()
            dying.wait()
    # The exporter's retry reaches the restarted receiver.
    with Receiver(store) as rx:
        again = OTLPSpanExporter(endpoint=f"{rx.url}/v1/traces", timeout=5)
        assert again.export(spans) is SpanExportResult.SUCCESS
    once = tmp_path / "once.duckdb"
    with Receiver(once) as rx:
        assert OTLPSpanExporter(endpoint=f"{rx.url}/v1/traces").export(
            spans) is SpanExportResult.SUCCESS

    with duckdb.connect(str(store), read_only=True) as con:
        stored = con.execute("SELECT count(*), count(DISTINCT SpanId) FROM otel_traces")
        assert stored.fetchone() == (2 * len(spans), len(spans))  # committed before the kill
    turns = _ledger(store)
    assert turns == _ledger(once)
    assert [t[:2] for t in turns] == [("retried", 1), ("retried", 2), ("retried", 3)]
