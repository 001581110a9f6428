"""Benchmark: each registered analysis alone, over a store whose ledger ``kvscope ledger`` built.

Each analysis runs in a fresh process (its peak RSS is its own), as ``kvscope analyze NAME``
would: a context on the store, the analysis with its default parameters. Two ways side by side:

    columns   the analysis reads the ledger columns it names (``LEDGER_COLUMNS``; the stored
              table read a few columns at a time), and the stored queries' tables
              (``analysis/stored_queries.py``) that ``kvscope ledger`` keeps
    spans     the same, but the stored queries run on the span rows, as before their tables
    whole     every analysis given every ledger column, as before analyses named theirs (and
              the stored queries' tables)

and the ratio of their peak RSS. With ``--rss-limit-mib`` a process past that is stopped (a
figure that does not fit is printed as such, not as a time).

Run:  .venv/bin/python tests/benchmarks/bench_analyses.py STORE [--only NAME,NAME]
      [--ways columns,spans,whole] [--rss-limit-mib 10000] [--clickhouse-database otel]
STORE must hold a current ``kvscope_ledger`` table (run ``kvscope ledger STORE`` first; the
benchmark says so otherwise). STORE ``chdb:/folder``: a chdb data folder's database (``otel``,
bench_clickhouse.py's; ``kvscope ledger --clickhouse chdb:/folder``; there ``spans`` is as
``columns``: ClickHouse keeps no stored queries). Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent.parent)]  # bench_clickhouse, tests.analysis

import bench_clickhouse  # noqa: E402  (after the path above)
import bench_ledger  # noqa: E402

WAYS = ("columns", "spans", "whole")


def _one(db: Any, name: str, way: str) -> dict[str, Any]:
    """``name`` over ``db`` in this (fresh) process; seconds, rows and peak RSS."""
    from kvscope.analysis import registry
    from kvscope.store.source import open_reader
    from tests.analysis.test_ledger_columns import WholeLedgerContext

    if way == "spans":
        from kvscope.analysis import stored_queries

        stored_queries.STORED_QUERIES.clear()
    start = time.perf_counter()
    context = WholeLedgerContext if way == "whole" else registry.AnalysisContext
    with context(open_reader(db, time_limit_s=None)) as ctx:
        try:
            rows: int | str = registry.run(ctx, name).height
        except registry.AnalysisError as exc:
            rows = f"says: {str(exc)[:60]}"
    return {"s": time.perf_counter() - start, "rows": rows,
            "peak_rss_mib": bench_ledger._peak_rss_mib()}


def _stored(db: Any) -> dict[str, Any]:
    from kvscope.analysis import ledger_units
    from kvscope.store.source import open_reader

    reader = open_reader(db)
    try:
        return {"stored": ledger_units.stored_columns(reader) is not None}
    finally:
        reader.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--clickhouse-database", default="otel",
                        help="the database of a chdb:/folder STORE")
    parser.add_argument("--only", default="", help="comma-separated analysis names")
    parser.add_argument("--ways", default="columns,whole",
                        help="comma-separated: columns, spans, whole (the first is the base of "
                        "the peak ratios)")
    parser.add_argument("--rss-limit-mib", type=float, default=None)
    args = parser.parse_args()
    from kvscope.analysis import registry
    from kvscope.store.clickhouse import CHDB_SCHEME, ClickHouseSource

    db: Any = args.store
    if db.startswith(CHDB_SCHEME + ":"):
        db = ClickHouseSource(db, database=args.clickhouse_database)
    if not bench_ledger._in_process(_stored, db)["stored"]:
        print(f"{args.store}: no current kvscope_ledger table; run `kvscope ledger` on it first")
        return 2
    names = [n for n in args.only.split(",") if n] or [a.name for a in registry.iter_analyses()]
    ways = [w for w in args.ways.split(",") if w in WAYS]
    print(f"{args.store}: each analysis in a fresh process ({', '.join(ways)})")
    print(f"{'analysis':<20}" + "".join(f"{w + ' s':>10}{w + ' peak MiB':>18}" for w in ways)
          + "".join(f"{w + '/' + ways[0]:>16}" for w in ways[1:]))
    for name in names:
        cells, peaks = [], []
        for way in ways:
            out = bench_clickhouse._in_process_capped(args.rss_limit_mib, _one, db, name, way)
            if "stopped_at_rss_mib" in out:
                stopped = f"stopped at {out['stopped_at_rss_mib']:.0f}"
                cells.append(f"{'-':>10}{stopped:>18}")
                peaks.append(None)
                continue
            cells.append(f"{out['s']:>10.1f}{out['peak_rss_mib']:>18.0f}")
            peaks.append(out["peak_rss_mib"])
        ratio = "".join(
            f"{peak / peaks[0]:>15.2f}x" if peak is not None and peaks[0] is not None
            else f"{'-':>16}" for peak in peaks[1:])
        print(f"{name:<20}" + "".join(cells) + ratio, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
