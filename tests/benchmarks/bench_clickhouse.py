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
    table      DuckDB: ``kvscope ledger`` (``ledger_units.update(full=True)``) on a copy of
               the store (``--work-dir``), then every analysis over the table it wrote
               (``stored_ledger``), all of them in one fresh process after the build's own
               (each analysis alone: bench_analyses.py); time, peak RSS and the largest
               the store's temporary folder grew (DuckDB's spill and the build's scratch
               database), and the copy's growth. A large store's build writes each partition's
               rows as they come (analysis/ledger.py ``build_table``). The copy is removed.
               chdb: ``kvscope ledger --clickhouse`` (``rebuild_clickhouse``) on the folder
               itself (its ``kvscope_ledger`` table replaced): time and peak RSS (the
               folder's size moves with ClickHouse's background merges); a partitioned
               build writes each partition's rows to the server as they come
               (``build_clickhouse_table``). Then every analysis, which reads
               that table while its stamp matches the spans (``StoredLedger``), a fresh process.
    load       nothing more: the data made and loaded into chdb (to measure later, idle).

Larger than simulation allows (``--replicate K``, issue 20 part 6's 10M turns): the store of
``--turns`` N is then made by replicate.py from the simulated store of N/K turns (generated as
above when missing): K copies with distinct ids, one after the other in time, cached as
``ledger-<N>-s<seed>-rep<K>x<N/K>.duckdb`` and ``chdb-<N>-s<seed>-rep<K>x<N/K>/`` so that nobody
takes them for simulated ones. ``--phases`` picks what runs after the data exists (``per_turn``
or ``extract`` alone show whether the engine's part fits before the ledger is tried);
``--rss-limit-mib`` stops a phase whose resident memory passes the limit and says so instead of
a figure.

Where the work runs: on both engines the engine runs the ledger's per-turn query (its joins and
aggregations; one row per turn comes back, analysis/ledger.py ``TURN_QUERY``); outcomes and
the analyses run in polars in this process. The ``per_turn`` phase times that query alone, and
``extract``, for comparison, the span rows the ledger no longer brings back (its extraction
queries, which the live ledger still reads), each in a fresh process.

Run:  .venv/bin/python tests/benchmarks/bench_clickhouse.py [--turns 100000,1000000]
      [--cache-dir DIR] [--seed 1] [--engines duckdb,chdb] [--replicate K]
      [--phases analyse,extract,table] [--rss-limit-mib MIB] [--work-dir DIR]
      [--ledger-partitions N] [--partition-turns N]
e.g.  ... --turns 10000000 --replicate 10 --phases extract --rss-limit-mib 8192
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue as queue_module
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent.parent)]  # bench_ledger, tests.store.otelcol

import bench_ledger  # noqa: E402  (after the path above)
import replicate  # noqa: E402

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


def _load_part(db: Path, folder: Path, window: tuple[int, int] | None) -> dict[str, Any]:
    """One part of a load in parts: ``window`` (epoch ns, end excluded) picks the span rows and
    gauge samples copied, as ``load_store`` copies them (its flat SELECT, batches of 1M rows,
    ``insert_arrow``); ``None`` creates the exporter's tables and copies the runs."""
    import duckdb

    from kvscope.store.clickhouse import RUNS_DDL, ClickHouseReader, _flat_select
    from kvscope.store.schema import GAUGE_COLUMNS, GAUGE_TABLE, TRACES_COLUMNS, TRACES_TABLE
    from tests.store.otelcol import GAUGE_DDL, TRACES_DDL, create_database, render

    start = time.perf_counter()
    if window is None:
        create_database(folder, DATABASE)
    reader = ClickHouseReader.connect(_source(folder))
    con = duckdb.connect(str(db), read_only=True)
    copied: dict[str, int] = {}
    sources: list[tuple[str, str, list[int]]]
    try:
        con.execute("SET enable_progress_bar = false")
        # DuckDB keeps the blocks it reads cached up to its memory limit (default 80 % of RAM):
        # a whole-file scan would hold the file in this process.
        con.execute("SET memory_limit = '1GB'")
        if window is None:
            reader.engine.command(render(TRACES_DDL, DATABASE, TRACES_TABLE))
            reader.engine.command(render(GAUGE_DDL, DATABASE, GAUGE_TABLE))
            reader.engine.command(RUNS_DDL)
            sources = [("kvscope_runs", "SELECT run_id, label, CAST(settings AS VARCHAR) AS "
                                        "settings, started_at, ended_at FROM kvscope_runs", [])]
        else:
            sources = [
                (table, f"SELECT * FROM ({_flat_select(table, columns)}) "
                        f"WHERE {time_column} >= make_timestamp_ns(?) "
                        f"AND {time_column} < make_timestamp_ns(?)",  # row groups skipped
                 list(window))
                for table, columns, time_column in (
                    (TRACES_TABLE, TRACES_COLUMNS, '"Timestamp"'),
                    (GAUGE_TABLE, GAUGE_COLUMNS, '"TimeUnix"'))
            ]
        for table, sql, params in sources:
            copied[table] = 0
            for batch in con.sql(sql, params=params).to_arrow_reader(1_000_000) or ():
                if batch.num_rows:
                    reader.engine.insert_arrow(table, pa.Table.from_batches([batch]))
                    copied[table] += batch.num_rows
    finally:
        con.close()
        reader.close()
    return {"copied": copied, "load_s": time.perf_counter() - start,
            "peak_rss_mib": bench_ledger._peak_rss_mib()}


def _windows(db: Path, parts: int) -> list[tuple[int, int]]:
    """``parts`` equal windows of time (epoch ns) that together hold every span and sample."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        con.execute("SET memory_limit = '1GB'")
        lo, hi = con.execute(
            "SELECT min(t), max(t) FROM (SELECT epoch_ns(\"Timestamp\") AS t FROM otel_traces "
            "UNION ALL SELECT epoch_ns(\"TimeUnix\") FROM otel_metrics_gauge)").fetchall()[0]
    finally:
        con.close()
    width = (int(hi) - int(lo)) // parts + 1
    return [(int(lo) + i * width, int(lo) + (i + 1) * width) for i in range(parts)]


def _load_in_parts(db: Path, folder: Path, parts: int,
                   rss_limit_mib: float | None) -> dict[str, Any]:
    """The load of ``_load``, in ``parts`` windows of time, each in a fresh process: a process's
    memory grows with what it has loaded (10M turns: past 8 GiB at a fifth of the rows)."""
    start = time.perf_counter()
    copied: dict[str, int] = {}
    peaks = []
    for window in [None, *_windows(db, parts)]:
        part = _in_process_capped(rss_limit_mib, _load_part, db, folder, window)
        if "stopped_at_rss_mib" in part:
            return part
        peaks.append(part["peak_rss_mib"])
        for table, rows in part["copied"].items():
            copied[table] = copied.get(table, 0) + rows
        print(f"  load part {len(peaks) - 1}/{parts}: {part['copied']} in "
              f"{part['load_s']:.1f} s, peak RSS {part['peak_rss_mib']:.0f} MiB", flush=True)
    (folder / _COMPLETE).write_text(repr(copied))
    return {"copied": copied, "load_s": time.perf_counter() - start,
            "peak_rss_mib": max(peaks),
            "folder_mib": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            / 2**20}


def _read_alone(source: Any, what: str) -> dict[str, Any]:
    """One read of the ledger's alone, in a fresh process: ``span_rows`` (its extraction
    queries, span rows per kind: what the ledger brought back before) or ``per_turn``
    (``ledger.turn_rows``: the joins and aggregations in the engine, one row per turn back)."""
    from kvscope.analysis.ledger import load_spans, turn_rows
    from kvscope.store.source import open_reader

    start = time.perf_counter()
    reader = open_reader(source, time_limit_s=None)
    try:
        if what == "per_turn":
            rows = turn_rows(reader).height
        else:
            rows = sum(frame.height for frame in load_spans(reader).values())
    finally:
        reader.close()
    return {"extract_s": time.perf_counter() - start, "rows": rows,
            "peak_rss_mib": bench_ledger._peak_rss_mib()}


def _source(folder: Path) -> Any:
    from kvscope.store.clickhouse import ClickHouseSource

    return ClickHouseSource(f"chdb:{folder}", database=DATABASE)


def _table(db: Path, partitions: int | None = None) -> dict[str, Any]:
    """``kvscope ledger`` on ``db`` (a copy): the whole table built and written
    (``partitions``: ``kvscope ledger --partitions``)."""
    import logging

    from kvscope.analysis import ledger_units

    # The build's steps and partitions, as it goes (a 10M-turn build runs for minutes).
    logging.basicConfig(level=logging.INFO, format="    %(asctime)s %(message)s")
    spill = bench_ledger._SpillWatch(db)
    before = db.stat().st_size
    start = time.perf_counter()
    done = ledger_units.update(db, full=True, partitions=partitions)
    return {"table_s": time.perf_counter() - start, "rows": done.rows,
            "peak_rss_mib": bench_ledger._peak_rss_mib(), "spill_mib": spill.stop(),
            "grew_mib": (db.stat().st_size - before) / 2**20}


def _run_table(db: Path, work: Path, turns: int, limit: float | None,
               partitions: int | None) -> None:
    """The ``table`` phase: ``kvscope ledger`` on a copy of ``db``, then the analyses on it."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvscope-bench-table-", dir=work) as tmp:
        copy = Path(tmp) / db.name
        start = time.perf_counter()
        shutil.copyfile(db, copy)
        print(f"\n{turns} turns ({db.name}): copied in {time.perf_counter() - start:.1f} s; "
              "kvscope ledger, then every analysis on its table (a fresh process each)",
              flush=True)
        built = _capped("kvscope ledger", limit, _table, copy, partitions)
        if built is None:
            return
        print(f"  kvscope ledger: {built['rows']} rows in {built['table_s']:.1f} s, peak RSS "
              f"{built['peak_rss_mib']:.0f} MiB, temporary folder at most "
              f"{bench_ledger._spill(built)}, store +{built['grew_mib']:.0f} MiB "
              f"(store {db.stat().st_size / 2**20:.0f} MiB)", flush=True)
        _analyses_on_table(copy, built, limit)


def _chdb_table(folder: Path, partitions: int | None = None) -> dict[str, Any]:
    """``kvscope ledger --clickhouse chdb:<folder>`` (``partitions``: its ``--partitions``)."""
    import logging

    from kvscope.analysis import ledger_units

    logging.basicConfig(level=logging.INFO, format="    %(asctime)s %(message)s")
    start = time.perf_counter()
    rows = ledger_units.rebuild_clickhouse(_source(folder), partitions=partitions)
    return {"table_s": time.perf_counter() - start, "rows": rows,
            "peak_rss_mib": bench_ledger._peak_rss_mib()}


def _run_chdb_table(folder: Path, turns: int, limit: float | None,
                    partitions: int | None) -> None:
    """The ``table`` phase on chdb: ``kvscope ledger --clickhouse`` on the loaded folder."""
    print(f"\n{turns} turns ({folder.name}): kvscope ledger --clickhouse", flush=True)
    built = _capped("kvscope ledger --clickhouse", limit, _chdb_table, folder, partitions)
    if built is None:
        return
    print(f"  kvscope ledger --clickhouse: {built['rows']} rows in {built['table_s']:.1f} s, "
          f"peak RSS {built['peak_rss_mib']:.0f} MiB (the scratch database's size: its log's "
          "\"staged in\" line)", flush=True)
    _analyses_on_table(_source(folder), built, limit)


def _capped(label: str, limit: float | None, fn: Any, *args: Any) -> dict[str, Any] | None:
    """``fn(*args)`` in a fresh process under ``limit`` (:func:`_in_process_capped`); None,
    said under ``label``, when it passed the limit."""
    result = _in_process_capped(limit, fn, *args)
    stopped = _stopped(result, limit)
    if stopped:
        print(f"  {label}: {stopped}")
        return None
    return result


def _analyses_on_table(source: Any, built: dict[str, Any], limit: float | None) -> None:
    """Every analysis over the ledger table ``kvscope ledger`` just ``built`` in ``source``
    (a fresh process), printed with the build's figures added."""
    analysed = _capped("analyses on the table", limit, bench_ledger._analyse, source)
    if analysed is None:
        return
    steps = "; ".join(f"{name} {'-' if s is None else f'{s:.1f}'}"
                      for name, s, _ in analysed["steps"])
    print(f"  analyses on the table: {analysed['total_s']:.1f} s, peak RSS "
          f"{analysed['peak_rss_mib']:.0f} MiB ({steps})")
    print(f"  together: {built['table_s'] + analysed['total_s']:.1f} s, peak RSS "
          f"{max(built['peak_rss_mib'], analysed['peak_rss_mib']):.0f} MiB", flush=True)


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
    print(f"  {'DuckDB spill, most':<20}" + "".join(f" {bench_ledger._spill(r):>12}"
                                                    for r in results.values()))
    for engine, r in results.items():
        for name, seconds, note in r["steps"]:
            if seconds is None:
                print(f"  {engine} {name}: {note}")
    if len(engines) == 2:
        a, b = (results[e] for e in engines)
        print(f"  ratio {engines[1]}/{engines[0]}: time {b['total_s'] / a['total_s']:.2f}x, "
              f"peak RSS {b['peak_rss_mib'] / a['peak_rss_mib']:.2f}x")


def _print_growth(growth: list[tuple[int, str, dict[str, Any] | str]]) -> None:
    """Per engine, each size's ledger + analyses (time, peak RSS, DuckDB's spill) and its growth
    from the size before it (x turns, x time, x peak RSS)."""
    if len({turns for turns, _, _ in growth}) < 2:
        return
    print(f"\ngrowth (ledger and every analysis, a fresh process each)\n"
          f"  {'engine':<7} {'turns':>9} {'ledger rows':>11} {'total s':>9} {'peak RSS':>10} "
          f"{'spill':>10} {'x turns':>8} {'x time':>7} {'x RSS':>6}")
    for engine in dict.fromkeys(e for _, e, _ in growth):
        before: dict[str, Any] | None = None
        for turns, _, result in (g for g in growth if g[1] == engine):
            if isinstance(result, str):
                print(f"  {engine:<7} {turns:>9}  {result}")
                before = None
                continue
            ratios = ""
            if before is not None:
                ratios = (f"{result['turns'] / before['turns']:8.1f} "
                          f"{result['total_s'] / before['total_s']:7.1f} "
                          f"{result['peak_rss_mib'] / before['peak_rss_mib']:6.1f}")
            print(f"  {engine:<7} {turns:>9} {result['turns']:>11} {result['total_s']:9.1f} "
                  f"{result['peak_rss_mib']:6.0f} MiB {bench_ledger._spill(result):>10} "
                  f"{ratios}")
            before = result


def _status_kib(pid: int, field: str) -> int | None:
    """One ``/proc/<pid>/status`` figure in KiB (``VmRSS``: resident now)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _in_process_capped(rss_limit_mib: float | None, fn: Any, *args: Any) -> dict[str, Any]:
    """As ``bench_ledger._in_process``; with a limit, the fresh process is stopped once its
    resident memory passes ``rss_limit_mib`` (polled twice a second) and the result says so:
    ``{"stopped_at_rss_mib": ..., "after_s": ...}``. On a shared machine a phase that does not
    fit must not take the machine's memory from the others."""
    if rss_limit_mib is None:
        return bench_ledger._in_process(fn, *args)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=bench_ledger._child, args=(fn, args, results))
    start = time.perf_counter()
    proc.start()
    try:
        while True:
            try:
                out: dict[str, Any] = results.get(timeout=0.5)
                proc.join()
                return out
            except queue_module.Empty:
                pass
            rss_kib = _status_kib(proc.pid or 0, "VmRSS")
            if rss_kib is not None and rss_kib / 1024 > rss_limit_mib:
                proc.kill()
                proc.join()
                return {"stopped_at_rss_mib": rss_kib / 1024,
                        "after_s": time.perf_counter() - start}
            if not proc.is_alive():
                try:  # it may have put its result just before it ended
                    return dict(results.get(timeout=5))
                except queue_module.Empty:
                    raise RuntimeError(f"{getattr(fn, '__name__', fn)}: the process ended "
                                       f"with exit code {proc.exitcode} and no result") from None
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _stopped(result: dict[str, Any], limit: float | None) -> str | None:
    if "stopped_at_rss_mib" not in result:
        return None
    return (f"stopped after {result['after_s']:.1f} s at {result['stopped_at_rss_mib']:.0f} MiB "
            f"resident (--rss-limit-mib {limit:.0f}): does not fit; no figure")


def _store(args: argparse.Namespace, turns: int) -> tuple[Path, Path]:
    """The DuckDB store of ``turns`` turns and its chdb folder, made when missing: simulated,
    or with ``--replicate K`` replicated from the simulated store of ``turns / K``."""
    simulated = turns // args.replicate
    db = args.cache_dir / f"ledger-{simulated}-s{args.seed}.duckdb"
    if not db.exists():
        print(f"generating {db} ...", flush=True)
        gen = bench_ledger._in_process(bench_ledger._generate, db, simulated, args.seed)
        print(f"generate: {gen['turns']} turns, {gen['spans']} spans, simulate "
              f"{gen['simulate_s']:.1f} s, file {gen['file_mib']:.0f} MiB", flush=True)
    if args.replicate == 1:
        return db, args.cache_dir / f"chdb-{turns}-s{args.seed}"
    name = replicate.replicated_name(simulated, args.seed, args.replicate)
    target = args.cache_dir / name
    if not target.exists():
        print(f"replicating {db} x{args.replicate} into {target} ...", flush=True)
        rep = _in_process_capped(args.rss_limit_mib, replicate.replicate, db, target,
                                 args.replicate)
        stopped = _stopped(rep, args.rss_limit_mib)
        if stopped:
            raise SystemExit(f"replicate: {stopped}")
        print(f"replicate x{args.replicate}: {rep['rows']} rows in {rep['replicate_s']:.1f} s, "
              f"time step {rep['step_ns'] / 3.6e12:.0f} h, file {rep['file_mib']:.0f} MiB",
              flush=True)
    stem = name.removeprefix("ledger-").removesuffix(".duckdb")
    return target, args.cache_dir / f"chdb-{stem}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", default="100000,1000000",
                        help="comma-separated sizes in synthetic turns (approx.)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=bench_ledger._DEFAULT_CACHE)
    parser.add_argument("--engines", default="duckdb,chdb", help="engines to run, in this order")
    parser.add_argument("--replicate", type=int, default=1,
                        help="make each size from the simulated store of size/K, K times over")
    parser.add_argument("--phases", default="analyse,per_turn,extract",
                        help="what runs on the data: any of analyse, per_turn, extract")
    parser.add_argument("--rss-limit-mib", type=float, default=None,
                        help="stop a phase whose resident memory passes this")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the table phase copies the store (default: the cache dir)")
    parser.add_argument("--ledger-partitions", type=int, default=None,
                        help="the table phase's kvscope ledger --partitions")
    parser.add_argument("--partition-turns", type=int, default=None,
                        help="the analyse phase's ledger builds in partitions above this many "
                             "turn spans, on either engine (default: the ledger's thresholds)")
    parser.add_argument("--load-parts", type=int, default=1,
                        help="load into chdb in this many windows of time, a process each")
    args = parser.parse_args()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    if args.replicate < 1 or not phases <= {"analyse", "per_turn", "extract", "table", "load"}:
        parser.error("--replicate takes K >= 1; --phases takes analyse, per_turn, extract, "
                     "table, load")

    growth: list[tuple[int, str, dict[str, Any] | str]] = []
    for turns in [int(t) for t in args.turns.split(",") if t.strip()]:
        db, folder = _store(args, turns)
        if "table" in phases and "duckdb" in engines:
            _run_table(db, args.work_dir or args.cache_dir, turns, args.rss_limit_mib,
                       args.ledger_partitions)
        if "chdb" in engines and not (folder / _COMPLETE).exists():
            if folder.exists():
                import shutil

                shutil.rmtree(folder)  # an incomplete load: start over
            if args.load_parts > 1:
                loaded = _load_in_parts(db, folder, args.load_parts, args.rss_limit_mib)
            else:
                loaded = _in_process_capped(args.rss_limit_mib, _load, db, folder)
            stopped = _stopped(loaded, args.rss_limit_mib)
            if stopped:
                raise SystemExit(f"load into chdb: {stopped}")
            print(f"load into chdb: {loaded['copied']} in {loaded['load_s']:.1f} s, folder "
                  f"{loaded['folder_mib']:.0f} MiB (DuckDB file {db.stat().st_size / 2**20:.0f} "
                  f"MiB), peak RSS {loaded['peak_rss_mib']:.0f} MiB", flush=True)
        if "table" in phases and "chdb" in engines:
            _run_chdb_table(folder, turns, args.rss_limit_mib, args.ledger_partitions)
        if "analyse" in phases:
            results: dict[str, dict[str, Any]] = {}
            for engine in engines:
                source = db if engine == "duckdb" else _source(folder)
                results[engine] = _in_process_capped(args.rss_limit_mib, bench_ledger._analyse,
                                                     source, args.partition_turns)
            stopped_any = {e: _stopped(r, args.rss_limit_mib) for e, r in results.items()}
            growth.extend((turns, e, stopped_any[e] or r) for e, r in results.items())
            for engine, note in stopped_any.items():
                if note:
                    print(f"\n{turns} turns, {engine} analyse: {note}")
            if not any(stopped_any.values()):
                _print_side_by_side(turns, results)
        # What the ledger brings back (per-turn rows, joined in the engine) against what it
        # would if every span row came back (the extraction queries, as the live ledger reads).
        for phase, what, label, unit in (("per_turn", "per_turn", "per-turn query", "rows"),
                                         ("extract", "span_rows", "span rows alone",
                                          "span rows")):
            if phase not in phases:
                continue
            alone: dict[str, dict[str, Any]] = {}
            for engine in engines:
                source = db if engine == "duckdb" else _source(folder)
                alone[engine] = _in_process_capped(args.rss_limit_mib, _read_alone, source,
                                                   what)
            notes = {e: _stopped(r, args.rss_limit_mib) for e, r in alone.items()}
            if any(notes.values()):
                for engine, note in notes.items():
                    print(f"  {engine} {label}: " + (
                        note or f"{alone[engine]['extract_s']:.2f} s, peak RSS "
                                f"{alone[engine]['peak_rss_mib']:.0f} MiB"))
                continue
            if "analyse" not in phases:
                print(f"\n{turns} turns ({db.name})")
                print(f"  {'step':<20}" + "".join(f"{e:>12}" for e in alone))
            print(f"  {label:<20}"
                  + "".join(f"{e['extract_s']:10.2f} s" for e in alone.values())
                  + f"   ({next(iter(alone.values()))['rows']} {unit}; fresh process each)")
            print(f"  {'its peak RSS':<20}"
                  + "".join(f"{e['peak_rss_mib']:8.0f} MiB" for e in alone.values()))
    _print_growth(growth)


if __name__ == "__main__":
    main()
