"""Benchmark: where the simulator's span process spends its CPU, stage by stage, on one
captured run.

``simulate`` (from ``PROCESS_ROWS_MIN_TURNS`` turns) ships each batch of turn and engine records
to a :class:`~kvscope.emulator.span_process.SpanProcess`, which rebuilds them, builds the spans
as store rows (``ProxyTelemetry.spans_for``, ``EngineTelemetry.emit``), converts each batch to
Arrow (``rows_to_arrow``) and inserts it on a writer thread (a Parquet file read by DuckDB).
Timed inside that process, the stages overlap (the writer thread runs beside the next batch)
and share the machine with the simulating process; so this benchmark first simulates the
workload once as ``kvscope simulate`` does (no truth labelled) and keeps the shipped batches,
then replays them here, alone, in four cumulative ways, each in a fresh process:

    unpack   the batches unpacked and each record rebuilt (named tuples, turn records)
    spans    + every span built as a row tuple (the rows dropped at each batch)
    arrow    + each batch converted by ``rows_to_arrow`` (then dropped)
    insert   + inserted into a fresh store through ``RowSink``, as the span process does

and prints each way's CPU seconds (this process's, the writer thread included) and the
difference to the way before: what each stage costs. The replay continues the run's span id
streams, so its rows are the span process's. The work is the same every run, its CPU seconds are
not (on the project's shared 2-core machine, whole runs minutes apart were up to 1.3x apart):
``--rounds`` repeats each way and reports the least CPU; compare stages within one run.

Run:  .venv/bin/python tests/benchmarks/bench_span_process.py [--turns 100000] [--rounds 2]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile

_WAYS = ("unpack", "spans", "arrow", "insert")
TURNS_PER_CONVERSATION = 31.1  # the synthetic generator's mean with its defaults


def _capture(conversations: int, path: str) -> None:
    """Simulate as ``kvscope simulate`` does and keep the span process's spec and batches."""
    from kvscope.child import pack
    from kvscope.emulator import span_process
    from kvscope.emulator.simulator import simulate
    from kvscope.emulator.workloads import synthetic

    captured: dict[str, object] = {"batches": []}
    batches: list[bytes] = captured["batches"]  # type: ignore[assignment]

    cls = span_process.SpanProcess
    init, flush = cls.__init__, cls.flush

    def capturing_init(self: span_process.SpanProcess, db: str,
                       spec: span_process.TelemetrySpec, batch: int = 8192) -> None:
        captured["spec"] = spec
        init(self, db, spec, batch)

    def capturing_flush(self: span_process.SpanProcess) -> None:
        if self._items:
            batches.append(pack(self._items))
        flush(self)

    # On the class: the simulator holds its own reference to it.
    cls.__init__ = capturing_init  # type: ignore[method-assign]
    cls.flush = capturing_flush  # type: ignore[method-assign]
    work = synthetic.generate(conversations=conversations, seed=1)
    with tempfile.TemporaryDirectory() as folder:
        result = simulate(work, os.path.join(folder, "run.duckdb"), truth=False)
    captured["turns"] = result.turns
    with open(path, "wb") as out:
        pickle.dump(captured, out)


def _replay(path: str, way: str) -> float:
    """Replay the captured batches up to ``way``; this process's CPU seconds."""
    import random
    import resource

    from kvscope.child import unpack
    from kvscope.collector.engine_telemetry import ENGINE_RECORDS
    from kvscope.collector.proxy.export_process import record_from_tuple
    from kvscope.collector.span_rows import RowSink, cyclic_gc_per_batch, rows_to_arrow
    from kvscope.emulator.span_process import _TURN, telemetry
    from kvscope.store.database import open_store
    from kvscope.store.writer import ROW_GROUP_ROWS

    with open(path, "rb") as source:
        captured = pickle.load(source)
    spec, batches = captured["spec"], captured["batches"]
    if spec.engine_random is not None:
        random.setstate(spec.engine_random)

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    with tempfile.TemporaryDirectory() as folder:
        con = open_store(os.path.join(folder, "replay.duckdb"), threads=1)
        sink = RowSink(con, insert_rows=ROW_GROUP_ROWS)
        if way != "insert":
            def drop() -> None:  # the sink's flush, replaced: the batch stops here
                if way == "arrow":
                    rows_to_arrow(sink._rows)
                sink._rows.clear()
            sink.flush = drop  # type: ignore[method-assign]
        spans_for, engines = telemetry(sink, spec, direct=True)
        emits = [engine.emit for engine in engines]
        started = cpu()
        with cyclic_gc_per_batch():
            for data in batches:
                items = unpack(data)
                if way == "unpack":
                    for index, code, values in items:
                        if index == _TURN:
                            record_from_tuple(values)
                        else:
                            ENGINE_RECORDS[code]._make(values)
                    continue
                for index, code, values in items:
                    if index == _TURN:
                        spans_for(record_from_tuple(values))
                    else:
                        emits[index](ENGINE_RECORDS[code]._make(values))
            if way == "insert":
                sink.close()
        spent = cpu() - started
        if way != "insert":
            sink.abort()
        con.close()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replay", nargs=2, help=argparse.SUPPRESS)  # the child's entry
    args = parser.parse_args()
    if args.replay:
        print(_replay(*args.replay))
        return
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "batches.pickle")
        _capture(round(args.turns / TURNS_PER_CONVERSATION), path)
        with open(path, "rb") as source:
            captured = pickle.load(source)
        print(f"captured {captured['turns']:,} turns in {len(captured['batches'])} batches "
              f"({sum(map(len, captured['batches'])) / 2**20:.0f} MiB)")
        best = {way: float("inf") for way in _WAYS}
        for _ in range(args.rounds):
            for way in _WAYS:  # alternating, each in a fresh process
                done = subprocess.run([sys.executable, __file__, "--replay", path, way],
                                      capture_output=True, text=True, check=True)
                best[way] = min(best[way], float(done.stdout.split()[-1]))
    before = 0.0
    print(f"{'way':8} {'cpu s':>7} {'stage s':>8}")
    for way in _WAYS:
        print(f"{way:8} {best[way]:7.2f} {best[way] - before:8.2f}")
        before = best[way]


if __name__ == "__main__":
    main()
