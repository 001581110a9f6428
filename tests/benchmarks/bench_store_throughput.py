"""Store throughput, side by side: raw Arrow insert, the in-process exporter, and the receiver.

Run: ``.venv/bin/python tests/benchmarks/bench_store_throughput.py [--spans 100000]``

The same SDK spans (``kvscope.turn``-like: 10 attributes and a ``first_token`` event) are made
once and then written to a fresh store file per path:

  raw          prebuilt Arrow table, ``insert_arrow`` per 8192-row slice (DuckDB's ceiling: the
               writer's route, through a temporary Parquet file), and the same slices through
               DuckDB's Arrow scan (``insert_arrow_scan``), the route the Parquet file replaced
  in-process   ``DuckDBSpanExporter.export`` per 8192 spans, then ``writer.flush()``
  receiver     ``kvscope serve`` in its own process on 127.0.0.1; the official
               ``OTLPSpanExporter`` (protobuf, 8192 spans per request) from 1 or 2 sender threads,
               timed until the receiver reports every row written; and the same requests
               pre-encoded, which leaves out the client's encoding and measures the receiver.
               Each receiver path runs twice, side by side: ``ack=queued`` (answered once rows
               are queued: the receiver before issue 22, which a SIGKILL could lose rows from)
               and ``ack=durable`` (answered once they are committed, with group commit)

It prints spans/s and the ratio to raw, plus where the time goes per stage (CPU seconds of
one thread). Nothing here asserts a time: numbers depend on the machine, ratios are the point.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvscope import semconv
from kvscope.collector.convert import spans_to_rows
from kvscope.collector.exporters import DuckDBSpanExporter
from kvscope.collector.otlp_decode import decode_trace_bytes
from kvscope.store.database import open_store
from kvscope.store.writer import (
    ROW_GROUP_ROWS,
    StoreWriter,
    insert_arrow,
    insert_arrow_scan,
)

BATCH = 8192
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "collector"))

from served import Served  # noqa: E402

ACKS = ("queued", "durable")


def make_spans(n: int) -> list[ReadableSpan]:
    """``n`` finished SDK spans shaped like the proxy's ``kvscope.turn`` spans."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": semconv.SERVICE_PROXY, semconv.RUN_ID: "bench-run"}
        )
    )
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(semconv.SCOPE_NAME, "0.1")
    lookups = ("hit", "miss", "stale", "consumed")
    for i in range(n):
        conversation = i // 20
        with tracer.start_as_current_span(
            semconv.SPAN_TURN,
            kind=SpanKind.SERVER,
            attributes={
                semconv.GEN_AI_CONVERSATION_ID: f"conv-{conversation:06d}",
                semconv.TURN_INDEX: i % 20 + 1,
                semconv.GEN_AI_REQUEST_MODEL: "meta-llama/Llama-3.1-8B-Instruct",
                semconv.GEN_AI_USAGE_INPUT_TOKENS: 2000 + 350 * (i % 20) + i % 7,
                semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 120 + i % 90,
                semconv.ROUTER_LOOKUP: lookups[i % 4],
                semconv.ROUTER_ENTRY_AGE_S: (i % 600) / 3.0,
                semconv.PREFILL_INSTANCE: f"10.0.0.{i % 2 + 1}:8100",
                semconv.DECODE_INSTANCE: f"10.0.1.{i % 2 + 1}:8200",
                semconv.X_REQUEST_ID: f"req-{i:08x}",
            },
        ) as span:
            span.add_event(semconv.EVENT_FIRST_TOKEN)
    provider.shutdown()
    return list(memory.get_finished_spans())


def _batches(items: Sequence[ReadableSpan]) -> list[Sequence[ReadableSpan]]:
    return [items[i : i + BATCH] for i in range(0, len(items), BATCH)]


def bench_raw(spans: list[ReadableSpan], workdir: Path, insert: Any = insert_arrow) -> float:
    table = spans_to_rows(spans).to_arrow()
    con = open_store(workdir / f"raw-{insert.__name__}.duckdb")
    start = time.perf_counter()
    for offset in range(0, table.num_rows, BATCH):
        insert(con, "otel_traces", table.slice(offset, BATCH))
    elapsed = time.perf_counter() - start
    con.close()
    return elapsed


def bench_insert_sizes(spans: list[ReadableSpan], workdir: Path, rows: int,
                       sizes: Sequence[int]) -> list[tuple[int, float, float]]:
    """Per insert size: CPU µs a span to insert ``rows`` rows (the spans' table repeated) into a
    fresh file with ``threads=1``, closing (the last checkpoint) included, and the file's MiB.

    An insert of a whole DuckDB row group (``ROW_GROUP_ROWS``) is written to the file at once;
    a smaller one goes through the write-ahead log and is written again at a checkpoint.
    """
    import pyarrow as pa

    one = spans_to_rows(spans).to_arrow()
    table = pa.concat_tables([one] * -(-rows // one.num_rows)).slice(0, rows).combine_chunks()
    out = []
    for size in sizes:
        path = workdir / f"sizes-{size}.duckdb"
        con = open_store(path, threads=1)
        start = time.process_time()
        for offset in range(0, rows, size):
            insert_arrow(con, "otel_traces", table.slice(offset, size))
        con.close()
        cpu = time.process_time() - start
        out.append((size, cpu / rows * 1e6, path.stat().st_size / 2**20))
        path.unlink()
    return out


def bench_in_process(spans: list[ReadableSpan], workdir: Path) -> tuple[float, int]:
    writer = StoreWriter.open(workdir / "in_process.duckdb")
    exporter = DuckDBSpanExporter(writer)
    retries = 0
    start = time.perf_counter()
    for batch in _batches(spans):
        # A full queue refuses the batch; wait for the writer and retry so that the number is
        # the sustainable rate, not the rate of dropping.
        while exporter.export(batch) is not SpanExportResult.SUCCESS:
            retries += 1
            writer.flush()
    writer.flush()
    elapsed = time.perf_counter() - start
    written = writer.stats.written_rows
    writer.close()
    assert written == len(spans), (written, len(spans))
    return elapsed, retries


class ServeProcess(Served):
    """A receiver with one way of acknowledging, in a child process; it counts rows written."""

    def written(self) -> int:
        return int(httpx.get(f"{self.url}/health").json()["rows_written"])

    def wait_written(self, expected: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.written() < expected:
            if time.monotonic() > deadline:
                raise RuntimeError("receiver did not write every row in time")
            time.sleep(0.005)


def _run_senders(senders: int, send: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=send, args=(k,)) for k in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def bench_receiver_exporter(
    spans: list[ReadableSpan], workdir: Path, senders: int, ack: str
) -> tuple[float, int]:
    serve = ServeProcess(workdir / f"receiver_exporter_{senders}_{ack}.duckdb", ack)
    try:
        batches = _batches(spans)
        failures = [0]

        def send(k: int) -> None:
            exporter = OTLPSpanExporter(endpoint=f"{serve.url}/v1/traces", timeout=120)
            for batch in batches[k::senders]:
                if exporter.export(batch) is not SpanExportResult.SUCCESS:
                    failures[0] += 1
            exporter.shutdown()

        start = time.perf_counter()
        _run_senders(senders, send)
        serve.wait_written(len(spans) if not failures[0] else 0)
        elapsed = time.perf_counter() - start
    finally:
        serve.stop()
    return elapsed, failures[0]


def bench_receiver_preencoded(
    spans: list[ReadableSpan], workdir: Path, senders: int, ack: str
) -> tuple[float, int]:
    bodies = [encode_spans(batch).SerializeToString() for batch in _batches(spans)]
    serve = ServeProcess(workdir / f"receiver_raw_{senders}_{ack}.duckdb", ack)
    busy = [0]
    try:

        def send(k: int) -> None:
            with httpx.Client(timeout=120) as client:
                for body in bodies[k::senders]:
                    while True:
                        response = client.post(
                            f"{serve.url}/v1/traces",
                            content=body,
                            headers={"Content-Type": "application/x-protobuf"},
                        )
                        if response.status_code != 503:
                            break
                        busy[0] += 1
                        time.sleep(0.01)
                    response.raise_for_status()

        start = time.perf_counter()
        _run_senders(senders, send)
        serve.wait_written(len(spans))
        elapsed = time.perf_counter() - start
    finally:
        serve.stop()
    return elapsed, busy[0]


def _cpu(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def stage_costs(spans: list[ReadableSpan]) -> list[tuple[str, float]]:
    """CPU seconds per stage for all spans, single-threaded (where the time goes)."""
    batches = _batches(spans)
    encoded = [encode_spans(b).SerializeToString() for b in batches]
    rows = [spans_to_rows(b) for b in batches]
    decoded = [decode_trace_bytes(body) for body in encoded]
    return [
        ("SDK spans -> rows (in-process convert)",
         _cpu(lambda: [spans_to_rows(b) for b in batches])),
        ("rows -> Arrow (TraceRows.to_arrow)", _cpu(lambda: [r.to_arrow() for r in rows])),
        ("OTLP protobuf encode (client exporter)",
         _cpu(lambda: [encode_spans(b).SerializeToString() for b in batches])),
        ("OTLP protobuf decode -> rows (receiver)",
         _cpu(lambda: [decode_trace_bytes(body) for body in encoded])),
        ("decoded rows -> Arrow (receiver)", _cpu(lambda: [d.to_arrow() for d in decoded])),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=100_000, help="spans per path")
    parser.add_argument(
        "--skip-exporter", action="store_true", help="skip the official-exporter receiver runs"
    )
    parser.add_argument("--sizes-rows", type=int, default=491_520,
                        help="rows inserted per insert size (0: skip that part)")
    args = parser.parse_args(argv)
    n = args.spans

    print(f"making {n} SDK spans ...", file=sys.stderr, flush=True)
    spans = make_spans(n)
    results: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp:
        workdir = Path(tmp)
        print("raw insert ...", file=sys.stderr, flush=True)
        raw = bench_raw(spans, workdir)
        results.append(("raw insert (Parquet file, the writer's)", raw, ""))
        scan = bench_raw(spans, workdir, insert_arrow_scan)
        results.append(("raw insert (DuckDB Arrow scan)", scan, ""))
        print("in-process exporter ...", file=sys.stderr, flush=True)
        elapsed, retries = bench_in_process(spans, workdir)
        results.append(("in-process DuckDBSpanExporter", elapsed, f"{retries} full-queue waits"))
        if not args.skip_exporter:
            for senders in (1, 2):
                for ack in ACKS:
                    print(f"receiver, official exporter x{senders}, ack={ack} ...",
                          file=sys.stderr, flush=True)
                    elapsed, failures = bench_receiver_exporter(spans, workdir, senders, ack)
                    results.append((f"receiver, OTLPSpanExporter x{senders}, {ack}", elapsed,
                                    f"{failures} failed"))
        for senders in (1, 2, 4):
            for ack in ACKS:
                print(f"receiver, pre-encoded x{senders}, ack={ack} ...", file=sys.stderr,
                      flush=True)
                elapsed, busy = bench_receiver_preencoded(spans, workdir, senders, ack)
                results.append((f"receiver, pre-encoded x{senders}, {ack}", elapsed,
                                f"{busy} x 503"))
        sizes: list[tuple[int, float, float]] = []
        if args.sizes_rows:
            print("insert sizes ...", file=sys.stderr, flush=True)
            sizes = bench_insert_sizes(spans, workdir, args.sizes_rows,
                                       (4_000, 20_000, ROW_GROUP_ROWS))
    print("stage costs ...", file=sys.stderr, flush=True)
    stages = stage_costs(spans)

    print(f"\n{n} spans, {BATCH} per batch, {os.cpu_count()} CPUs\n")
    print(f"{'path':<44} {'seconds':>8} {'spans/s':>10} {'vs raw':>7}  note")
    for name, seconds, note in results:
        rate = n / seconds
        print(f"{name:<44} {seconds:8.2f} {rate:10,.0f} {raw / seconds:7.2f}  {note}")
    if sizes:
        print(f"\n{args.sizes_rows} rows by insert size (one thread, CPU, close included)")
        print(f"{'rows per insert':>16} {'us/span':>8} {'file MiB':>9}")
        for size, us, mib in sizes:
            print(f"{size:>16,} {us:8.2f} {mib:9.1f}")
    print(f"\n{'stage (one thread, CPU time)':<40} {'seconds':>8} {'spans/s':>10}")
    for name, seconds in stages:
        print(f"{name:<40} {seconds:8.2f} {n / seconds:10,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
