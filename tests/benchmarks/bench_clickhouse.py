"""Benchmark: the ledger and every registered analysis on chdb (ClickHouse in-process) vs DuckDB.

The same simulated turns in both engines (issue 20, part 6): wall time and peak RSS of one
fresh process per engine, side by side, at each size asked for.

Phases, each in its own fresh (spawned) process so each peak RSS (``ru_maxrss``) is its own:

    generate   as ``bench_ledger.py``: ~``--turns`` synthetic turns simulated as a feature-ON and
               a feature-OFF run into a DuckDB store cached outside the repository
               (``~/.cache/kvscope-bench/ledger-<turns>-s<seed>.duckdb``; shared with
               bench_ledger.py, reused when present). Not part of the figures compared.
    load       the OpenTelemetry Collector exporter's own tables (tests/store/otelcol.py)
               created in a chdb data folder beside it (``chdb-<turns>-s<seed>/``, database
               ``otel``) and the DuckDB store's raw tables copied in (``load_store``). Timed and
               printed, not part of the figures compared; reused when complete.
    analyse    per engine: ``AnalysisContext.open(source)`` -> ``ctx.ledger()`` -> every analysis
               of ``registry.iter_analyses()`` with default parameters. The process's peak RSS
               includes chdb's engine, which runs inside it.

Where the work runs: on both engines the engine runs the ledger's per-turn query (its joins and
aggregations; one row per turn comes back, analysis/ledger.py ``TURN_QUERY``); outcomes and
the analyses run in polars in this process. Two more fresh processes per engine time the
per-turn query alone and, for comparison, the span rows the ledger no longer brings back
(its extraction queries, which the live ledger still reads).

Run:  .venv/bin/python tests/benchmarks/bench_clickhouse.py [--turns 100000,1000000]
      [--cache-dir DIR] [--seed 1] [--engines duckdb,chdb]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent.parent)]  # bench_ledger, tests.store.otelcol

import bench_ledger  # noqa: E402  (after the path above)

DATABASE = "otel"
_COMPLETE = "LOADED"


def _load(db: Path, folder: Path) -> dict[str, Any]:
    """The exporter's tables in chdb at ``folder``, filled from the DuckDB store ``db``."""
    from tests.store.otelcol import load_into_chdb

    start = time.perf_counter()
    copied = load_into_chdb(str(db), str(folder), DATABASE)
    (folder / _COMPLETE).write_text(repr(copied))
    return {"copied": copied, "load_s": time.perf_counter() - start,
            "peak_rss_mib": bench_ledger._peak_rss_mib(),
            "folder_mib": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            / 2**20}


def _extract(source: Any) -> dict[str, Any]:
    """Only the ledger's extraction queries (span rows per kind) in a fresh process: the part of
    the ledger step the engine does."""
    from kvscope.analysis.ledger import load_spans
    from kvscope.store.reader import StoreReader

    start = time.perf_counter()
    reader = StoreReader.open(source, time_limit_s=None)
    try:
        frames = load_spans(reader)
    finally:
        reader.close()
    return {"extract_s": time.perf_counter() - start,
            "rows": sum(f.height for f in frames.values()),
            "peak_rss_mib": bench_ledger._peak_rss_mib()}


def _per_turn(source: Any) -> dict[str, Any]:
    """Only the ledger's engine part (``ledger.turn_rows``: the joins and aggregations run in
    the engine, one row per turn back) in a fresh process."""
    from kvscope.analysis.ledger import turn_rows
    from kvscope.store.reader import StoreReader

    start = time.perf_counter()
    reader = StoreReader.open(source, time_limit_s=None)
    try:
        rows = turn_rows(reader)
    finally:
        reader.close()
    return {"extract_s": time.perf_counter() - start, "rows": rows.height,
            "peak_rss_mib": bench_ledger._peak_rss_mib()}


def _source(folder: Path) -> Any:
    from kvscope.store.clickhouse import ClickHouseSource

    return ClickHouseSource(f"chdb:{folder}", database=DATABASE)


def _print_side_by_side(turns: int, results: dict[str, dict[str, Any]]) -> None:
    engines = list(results)
    print(f"\n{turns} turns requested; ledger rows: "
          + ", ".join(f"{e} {r['turns']}" for e, r in results.items()))
    print(f"  {'step':<20}" + "".join(f"{e:>12}" for e in engines))
    # The same steps in the same order on every engine (the ledger, then each analysis; the
    # analysis called "ledger" is the registered one, served from the context's cache).
    for i, (name, _, _) in enumerate(results[engines[0]]["steps"]):
        label = "ledger (analysis)" if name == "ledger" and i > 1 else name
        cells = []
        for engine in engines:
            seconds = results[engine]["steps"][i][1]
            cells.append(f"{seconds:10.2f} s" if seconds is not None else f"{'failed':>12}")
        print(f"  {label:<20}" + "".join(cells))
    print(f"  {'total':<20}" + "".join(f"{r['total_s']:10.2f} s" for r in results.values()))
    print(f"  {'peak RSS':<20}" + "".join(f"{r['peak_rss_mib']:8.0f} MiB"
                                          for r in results.values()))
    print(f"  {'RSS after ledger':<20}" + "".join(f"{r['ledger_rss_mib']:8.0f} MiB"
                                                  for r in results.values()))
    for engine, r in results.items():
        for name, seconds, note in r["steps"]:
            if seconds is None:
                print(f"  {engine} {name}: {note}")
    if len(engines) == 2:
        a, b = (results[e] for e in engines)
        print(f"  ratio {engines[1]}/{engines[0]}: time {b['total_s'] / a['total_s']:.2f}x, "
              f"peak RSS {b['peak_rss_mib'] / a['peak_rss_mib']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", default="100000,1000000",
                        help="comma-separated sizes in synthetic turns (approx.)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=bench_ledger._DEFAULT_CACHE)
    parser.add_argument("--engines", default="duckdb,chdb", help="engines to run, in this order")
    args = parser.parse_args()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]

    for turns in [int(t) for t in args.turns.split(",") if t.strip()]:
        db = args.cache_dir / f"ledger-{turns}-s{args.seed}.duckdb"
        if not db.exists():
            print(f"generating {db} ...", flush=True)
            gen = bench_ledger._in_process(bench_ledger._generate, db, turns, args.seed)
            print(f"generate: {gen['turns']} turns, {gen['spans']} spans, simulate "
                  f"{gen['simulate_s']:.1f} s, file {gen['file_mib']:.0f} MiB", flush=True)
        folder = args.cache_dir / f"chdb-{turns}-s{args.seed}"
        if "chdb" in engines and not (folder / _COMPLETE).exists():
            if folder.exists():
                import shutil

                shutil.rmtree(folder)  # an incomplete load: start over
            loaded = bench_ledger._in_process(_load, db, folder)
            print(f"load into chdb: {loaded['copied']} in {loaded['load_s']:.1f} s, folder "
                  f"{loaded['folder_mib']:.0f} MiB (DuckDB file {db.stat().st_size / 2**20:.0f} "
                  f"MiB), peak RSS {loaded['peak_rss_mib']:.0f} MiB", flush=True)
        results: dict[str, dict[str, Any]] = {}
        extraction: dict[str, dict[str, Any]] = {}
        per_turn: dict[str, dict[str, Any]] = {}
        for engine in engines:
            source = db if engine == "duckdb" else _source(folder)
            results[engine] = bench_ledger._in_process(bench_ledger._analyse, source)
            per_turn[engine] = bench_ledger._in_process(_per_turn, source)
            extraction[engine] = bench_ledger._in_process(_extract, source)
        _print_side_by_side(turns, results)
        # What the ledger brings back (per-turn rows, joined in the engine) against what it
        # would if every span row came back (the extraction queries, as the live ledger reads).
        for label, phase, unit in (("per-turn query", per_turn, "rows"),
                                   ("span rows alone", extraction, "span rows")):
            print(f"  {label:<20}"
                  + "".join(f"{e['extract_s']:10.2f} s" for e in phase.values())
                  + f"   ({next(iter(phase.values()))['rows']} {unit}; fresh process each)")
            print(f"  {'its peak RSS':<20}"
                  + "".join(f"{e['peak_rss_mib']:8.0f} MiB" for e in phase.values()))


if __name__ == "__main__":
    main()
