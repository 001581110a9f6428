"""Benchmark: ``kvscope ledger`` brought up to date incrementally vs rebuilt whole (issue 31).

The cached store (bench_ledger.py's, or replicate.py's) is copied; its last ``--tail`` span rows
(by rowid, as they were written: whole conversations plus the spans of conversations still
running) are held back, the table is built whole on the rest, then the tail is appended and the
table is brought up to date two ways, each in a fresh process on its own copy: the incremental
update (:func:`kvscope.analysis.ledger_units.update`, only the touched conversations) and a full
rebuild (``update(full=True)``). Prints time and peak RSS side by side, and checks both tables
hold the same rows.

Run:  .venv/bin/python tests/benchmarks/bench_ledger_update.py STORE [--tail 20000]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent.parent)]  # bench_ledger, kvscope from the tree

from bench_ledger import _in_process, _peak_rss_mib  # noqa: E402  (after the path above)


def _prepare(source: Path, target: Path, tail: int) -> dict[str, Any]:
    """``target``: ``source`` less its last ``tail`` span rows, its ledger built whole; the tail
    rows kept beside it in ``target``.tail.parquet."""
    import duckdb

    from kvscope.analysis.ledger_units import update

    shutil.copy(source, target)
    con = duckdb.connect(str(target))
    high = con.execute("SELECT max(rowid) FROM otel_traces").fetchall()[0][0]
    cut = high - tail
    con.execute(f"COPY (SELECT * FROM otel_traces WHERE rowid > {cut} ORDER BY rowid) "
                f"TO '{target}.tail.parquet' (FORMAT parquet)")
    con.execute(f"DELETE FROM otel_traces WHERE rowid > {cut}")
    con.execute("CHECKPOINT")
    con.close()
    started = time.perf_counter()
    done = update(target, full=True)
    return {"rows": done.rows, "seconds": time.perf_counter() - started}


def _append_and_update(target: Path, full: bool) -> dict[str, Any]:
    import duckdb

    from kvscope.analysis.ledger_units import update

    con = duckdb.connect(str(target))
    con.execute(f"INSERT INTO otel_traces SELECT * FROM '{target}.tail.parquet'")
    con.close()
    started = time.perf_counter()
    done = update(target, full=full)
    seconds = time.perf_counter() - started
    con = duckdb.connect(str(target), read_only=True)
    digest = con.execute(
        "SELECT count(*), sum(hash(run_id, conversation_id, turn_index, x_request_id, outcome, "
        "evidence, reusable_tokens, remote_reused_tokens, local_hit_tokens)) "
        "FROM kvscope_ledger").fetchall()[0]
    con.close()
    return {"seconds": seconds, "peak_rss_mib": _peak_rss_mib(), "units": done.units,
            "rows": done.rows, "digest": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--tail", type=int, default=20_000, help="span rows appended")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--base", type=Path, default=None,
                        help="a base.duckdb an earlier run prepared (same --tail), reused")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(dir=args.work_dir))
    base = folder / "base.duckdb"
    if args.base is not None:
        shutil.copy(args.base, base)
        shutil.copy(f"{args.base}.tail.parquet", f"{base}.tail.parquet")
        print(f"{args.store.name}: prepared base reused; {args.tail} span rows appended")
    else:
        prep = _in_process(_prepare, args.store, base, args.tail)
        print(f"{args.store.name}: full build of the first part: {prep['rows']} turns in "
              f"{prep['seconds']:.1f} s; then {args.tail} span rows appended", flush=True)
    results = {}
    for name, full in (("incremental", False), ("full rebuild", True)):
        copy = folder / f"{name.replace(' ', '_')}.duckdb"
        shutil.copy(base, copy)
        shutil.copy(f"{base}.tail.parquet", f"{copy}.tail.parquet")
        results[name] = r = _in_process(_append_and_update, copy, full)
        print(f"  {name}: {r['seconds']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB",
              flush=True)
        copy.unlink()
    inc, full_r = results["incremental"], results["full rebuild"]
    print("                 seconds  peak RSS MiB  conversations recomputed  turns")
    for name, r in results.items():
        units = "all" if r["units"] is None else str(r["units"])
        print(f"  {name:<14} {r['seconds']:8.2f}  {r['peak_rss_mib']:12.0f}  {units:>24}  "
              f"{r['rows']}")
    print(f"  full/incremental: time x{full_r['seconds'] / inc['seconds']:.1f}, peak RSS "
          f"x{full_r['peak_rss_mib'] / inc['peak_rss_mib']:.2f}; same rows: "
          f"{inc['digest'] == full_r['digest']}")
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
