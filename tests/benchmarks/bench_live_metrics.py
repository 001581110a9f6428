"""Benchmark: ``kvscope serve``'s live ledger, a refresh after each batch against a full rebuild.

A simulated run (synthetic agentic workload) is written to a store, then copied into a second one
in ``--batches`` batches in the order it was written (as spans reach ``kvscope serve``). After each
batch the live ledger refreshes (:meth:`LiveLedger.refresh`: the new rows, and the conversations
they touch); the full rebuild (:func:`kvscope.analysis.ledger.ledger` on the whole store, what a
scrape would cost without the live ledger) is timed on the same store right after, so both see the
same rows. Prints both per batch and the ratio.

With ``--base STORE`` the live store starts as a copy of STORE (a large one: the ledger benchmark's
cached 1M-turn store, say): the live ledger's first refresh reads all of it (what ``kvscope
serve`` restarted on that store does at its first scrape; timed apart), the clock then moves past
``--idle-s`` so that those conversations leave memory, and the batches of the new run follow, each
refresh now over a store that large (the simulated run takes another seed: no id repeats).

With ``--source STORE`` the batches are STORE's spans instead of a new simulated run, in the order
they were written (a soak: the cached 1M-turn store streams its 6.9M spans through the live
ledger; with ``--idle-s`` finished conversations leave memory, and the resident set should stay
flat); ``--print-every K`` prints every K-th batch only.

With ``--idle-s S`` the live ledger lets conversations idle for S seconds (of a clock that moves
one second per batch) leave memory, and each line also shows what it holds (conversations, span
rows) and the process's resident memory; ``--no-rebuild`` skips the rebuilds (larger runs).

Run:  .venv/bin/python tests/benchmarks/bench_live_metrics.py [--conversations 400] [--batches 10]
      [--idle-s 3] [--no-rebuild] [--base STORE [--scrape]] [--step-rows N]
      [--source STORE] [--print-every K]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import duckdb
from prometheus_client import CollectorRegistry

from kvscope import semconv
from kvscope.analysis.ledger import ledger
from kvscope.analysis.live_metrics import PENDING_ROWS, LiveLedger, LiveMetrics, _Adapter
from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic
from kvscope.store.database import open_store
from kvscope.store.duckdb_reader import DuckDBReader


def _rss_mib() -> float:
    """This process's resident memory now (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _duckdb_mib(con: duckdb.DuckDBPyConnection) -> float:
    """What DuckDB's buffer manager holds now (its block cache of the store included)."""
    row = con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()
    return (row[0] or 0) / 2**20 if row else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--idle-s", type=float, default=None)
    parser.add_argument("--no-rebuild", action="store_true")
    parser.add_argument("--base", type=Path, default=None,
                        help="a store the live store starts as a copy of")
    parser.add_argument("--scrape", action="store_true",
                        help="with --base: the first refresh started by a scrape, as kvscope "
                             "serve's (the scrape's wait printed)")
    parser.add_argument("--step-rows", type=int, default=LiveLedger.step_rows,
                        help="span rows one step of a refresh reads at most")
    parser.add_argument("--source", type=Path, default=None,
                        help="stream this store's spans instead of a new simulated run")
    parser.add_argument("--print-every", type=int, default=1, help="print every K-th batch")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this many batches (a soak's first part)")
    parser.add_argument("--memory-limit", default=None,
                        help="DuckDB's memory limit on the live store (default DuckDB's)")
    args = parser.parse_args()
    tick = [0.0]
    folder = Path(tempfile.mkdtemp())
    if args.source is not None:
        source = args.source
        source_turns = duckdb.connect(str(source), read_only=True).execute(
            "SELECT count(*) FROM otel_traces WHERE SpanName = ?", [semconv.SPAN_TURN]
        ).fetchone()[0]
    else:
        source = folder / "source.duckdb"
        workload = synthetic.generate(seed=3, conversations=args.conversations, turns_p50=8,
                                      max_turns=20)
        source_turns = simulate(workload, source, SimulationSettings(
            profile="tiny", seed=1 if args.base is None else 7919)).turns
    if args.base is not None:
        shutil.copyfile(args.base, folder / "live.duckdb")
    con = open_store(folder / "live.duckdb", memory_limit=args.memory_limit)
    con.execute(f"ATTACH '{source}' AS src (READ_ONLY)")
    rows = con.execute("SELECT count(*) FROM src.otel_traces").fetchone()[0]
    live = LiveLedger(con, idle_s=args.idle_s, clock=lambda: tick[0])
    live.step_rows = args.step_rows
    if args.base is not None:
        base_spans = con.execute("SELECT count(*) FROM otel_traces").fetchone()[0]
        started = time.perf_counter()
        if args.scrape:
            # As kvscope serve's first scrape after a restart: the refresh in its thread, the
            # scrape answered after LiveMetrics.wait_s.
            metrics = LiveMetrics(con)
            metrics.ledger = live
            metrics.registry = CollectorRegistry(auto_describe=False)
            metrics.registry.register(_Adapter(live))
            body, _ = metrics(None)
            pending = [line for line in body.decode().splitlines()
                       if line.startswith(PENDING_ROWS)]
            print(f"first scrape answered in {time.perf_counter() - started:.2f} s: "
                  f"{pending}", flush=True)
            assert metrics._thread is not None
            metrics._thread.join()
            touched = live.recomputed_conversations
        else:
            touched = live.refresh()
        print(f"base: {base_spans} spans; first refresh {time.perf_counter() - started:.1f} s, "
              f"{touched} conversations, RSS {_rss_mib():.0f} MiB (peak "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f})", flush=True)
        tick[0] += (args.idle_s or 0.0) + 1.0  # the base's conversations are idle from now
    size = -(-rows // args.batches)
    print(f"live ledger: {source_turns} turns, {rows} spans in {args.batches} batches")
    print("batch  spans   refresh ms  conversations  rebuild ms  rebuild/refresh  "
          "resident conv  resident rows  RSS MiB  DuckDB MiB")
    refresh_total = rebuild_total = 0.0
    for i in range(args.batches if args.stop_after is None else args.stop_after):
        con.execute("INSERT INTO otel_traces SELECT * FROM src.otel_traces "
                    "WHERE rowid >= ? AND rowid < ?", [i * size, (i + 1) * size])
        tick[0] += 1
        started = time.perf_counter()
        touched = live.refresh()
        refresh_s = time.perf_counter() - started
        started = time.perf_counter()
        if not args.no_rebuild:
            ledger(DuckDBReader(con, time_limit_s=None))
        rebuild_s = time.perf_counter() - started
        refresh_total += refresh_s
        rebuild_total += rebuild_s
        spans = con.execute("SELECT count(*) FROM otel_traces").fetchone()[0]
        held = live.resident()
        rss = _rss_mib()
        if (i + 1) % args.print_every and i + 1 not in (args.batches, args.stop_after):
            continue
        print(f"{i + 1:5d}  {spans:6d}  {refresh_s * 1e3:10.1f}  {touched:13d}  "
              f"{rebuild_s * 1e3:10.1f}  {rebuild_s / refresh_s:14.1f}x  "
              f"{held['conversations']:13d}  {held['span_rows']:13d}  {rss:7.0f}  "
              f"{_duckdb_mib(con):10.0f}", flush=True)
    print(f"total: refreshes {refresh_total:.2f} s, rebuilds {rebuild_total:.2f} s "
          f"({rebuild_total / refresh_total:.1f}x)")
    con.close()
    duckdb.connect(":memory:").close()
    shutil.rmtree(folder, ignore_errors=True)  # the live copy (GBs with --base or --source)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
