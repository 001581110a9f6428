"""Benchmark: the ledger and every registered analysis on a large simulated store (issue 6).

Target (issue 6, part 7): ledger build plus every analysis on 1M turns produced by the
virtual-time simulator in <= 30 s and <= 4 GiB peak memory on the development machine.

Two phases, each in its own fresh (spawned) process so each peak RSS (``ru_maxrss``) is its own:

    generate   ``synthetic.generate(...)`` sized to half of ``--turns``, simulated twice with
               default :class:`SimulationSettings`, feature ON and OFF (the pair ``compare``
               needs; the ledger holds both runs' turns), into a cache file outside the repository
               (``~/.cache/kvscope-bench/ledger-<turns>-s<seed>.duckdb``), written under a
               temporary name and renamed when complete; reused when present (``--regenerate``
               rebuilds it). Its time is reported separately and is not part of the target.
    analyse    ``AnalysisContext.open(db)`` -> ``ctx.ledger()`` -> ``registry.run(ctx, name)``
               for every analysis of ``registry.iter_analyses()`` with default parameters,
               printing seconds per step, the total and the peak RSS. An analysis that refuses
               the store (say, one that needs two runs) prints its one-line error instead of a
               time; it is not counted as done.

Run:  .venv/bin/python tests/benchmarks/bench_ledger.py [--turns 1000000] [--regenerate]
      [--cache-dir DIR] [--seed 1] [--rounds 1] [--partition-turns N]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time
from pathlib import Path
from typing import Any

# Mean turns per synthetic conversation with the generator's defaults (seed 1), as in
# bench_simulator.py: only sizes the workload; the simulated count is printed.
_SYNTHETIC_TURNS_PER_CONVERSATION = 31.1
_DEFAULT_CACHE = Path.home() / ".cache" / "kvscope-bench"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _generate(db: Path, turns: int, seed: int) -> dict[str, Any]:
    """Simulate ~``turns`` synthetic turns, as an ON and an OFF run of one workload, into ``db``.

    Atomic: the runs go to a temporary file that is renamed when both are complete.
    """
    from kvscope.emulator import simulator
    from kvscope.emulator.workloads import synthetic

    start = time.perf_counter()
    conversations = max(1, round(turns / 2 / _SYNTHETIC_TURNS_PER_CONVERSATION))
    workload = synthetic.generate(conversations=conversations, seed=seed)
    build_s = time.perf_counter() - start
    partial = db.with_name(db.name + ".partial")
    for stale in (partial, partial.with_name(partial.name + ".wal")):
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    simulated = spans = 0
    for label, on in (("on", True), ("off", False)):
        result = simulator.simulate(workload, partial, simulator.SimulationSettings(
            label=f"bench-{label}", prefill_bidirectional_kv_xfer=on,
            decode_bidirectional_kv_xfer=on, seed=seed))
        simulated += result.turns
        spans += result.spans
    simulate_s = time.perf_counter() - start
    os.replace(partial, db)
    return {"turns": simulated, "spans": spans, "build_s": build_s,
            "simulate_s": simulate_s, "peak_rss_mib": _peak_rss_mib(),
            "file_mib": db.stat().st_size / 2**20}


class _SpillWatch:
    """The largest size DuckDB's spill folder (``<db>.tmp``) reaches, sampled every 0.2 s."""

    def __init__(self, db: Any) -> None:
        import threading

        # A chdb source spills in its own folder: 0 here, "not measured" in the output.
        self.measured = isinstance(db, Path)
        self.folder = db.with_name(db.name + ".tmp") if self.measured else Path("/nonexistent")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            try:
                size = sum(f.stat().st_size for f in self.folder.iterdir())
            except OSError:
                continue
            self.peak = max(self.peak, size)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20 if self.measured else None


def _analyse(db: Any, partition_turns: int | None = None) -> dict[str, Any]:
    """Open ``db``, build the ledger, run every registered analysis; time each step.
    ``partition_turns``: the ledger's PARTITION_TURNS (turn spans per partition) for this run,
    and CLICKHOUSE_PARTITION_TURNS (the same threshold on ClickHouse)."""
    from kvscope.analysis import ledger as ledger_module
    from kvscope.analysis import registry

    if partition_turns is not None:
        ledger_module.PARTITION_TURNS = partition_turns
        ledger_module.CLICKHOUSE_PARTITION_TURNS = partition_turns
    spill = _SpillWatch(db)

    steps: list[tuple[str, float | None, str]] = []
    total_start = time.perf_counter()
    start = time.perf_counter()
    from kvscope.store.source import open_reader

    # No time limit: at 10M turns one query (the ledger's) runs past the readers' default 60 s.
    ctx = registry.AnalysisContext(open_reader(db, time_limit_s=None))
    steps.append(("open", time.perf_counter() - start, ""))
    with ctx:
        start = time.perf_counter()
        ledger = ctx.ledger()
        steps.append(("ledger", time.perf_counter() - start, f"{ledger.height} rows"))
        ledger_rss = _peak_rss_mib()
        for analysis in registry.iter_analyses():
            start = time.perf_counter()
            try:
                frame = registry.run(ctx, analysis.name)
            except Exception as exc:  # one failing analysis must not hide the others' figures
                steps.append((analysis.name, None, f"error: {type(exc).__name__}: {exc}"))
                continue
            steps.append((analysis.name, time.perf_counter() - start, f"{frame.height} rows"))
    return {"steps": steps, "total_s": time.perf_counter() - total_start,
            "turns": ledger.height, "ledger_rss_mib": ledger_rss,
            "peak_rss_mib": _peak_rss_mib(), "spill_mib": spill.stop(),
            "partitions": ledger_module.PARTITION_TURNS}


def _spill(result: dict[str, Any]) -> str:
    """The largest spill folder a run's sampler saw, or "not measured" (chdb)."""
    spill = result.get("spill_mib")
    return "not measured" if spill is None else f"{spill:.0f} MiB"


def _child(fn: Any, args: tuple[Any, ...], queue: Any) -> None:
    queue.put(fn(*args))


def _in_process(fn: Any, *args: Any) -> dict[str, Any]:
    """Run ``fn(*args)`` in a fresh spawned process and return its result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    proc.start()
    out: dict[str, Any] = queue.get()
    proc.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=1_000_000, help="synthetic turns (approx.)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=_DEFAULT_CACHE)
    parser.add_argument("--regenerate", action="store_true", help="rebuild the cached store")
    parser.add_argument("--rounds", type=int, default=1, help="analysis runs; best total kept")
    parser.add_argument("--partition-turns", type=int, default=None,
                        help="the ledger's turn spans per partition (default: the ledger's "
                             "PARTITION_TURNS; a number above the store's turns: one statement)")
    args = parser.parse_args()

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    db = args.cache_dir / f"ledger-{args.turns}-s{args.seed}.duckdb"
    if args.regenerate or not db.exists():
        print(f"generating {db} ...", flush=True)
        gen = _in_process(_generate, db, args.turns, args.seed)
        print(f"generate: {gen['turns']} turns, {gen['spans']} spans, workload "
              f"{gen['build_s']:.1f} s, simulate {gen['simulate_s']:.1f} s "
              f"({gen['simulate_s'] / gen['turns'] * 1e6:.0f} us/turn), file "
              f"{gen['file_mib']:.0f} MiB, peak RSS {gen['peak_rss_mib']:.0f} MiB", flush=True)
    else:
        print(f"using cached {db} ({db.stat().st_size / 2**20:.0f} MiB; --regenerate rebuilds)")

    runs = [_in_process(_analyse, db, args.partition_turns) for _ in range(args.rounds)]
    best = min(runs, key=lambda r: r["total_s"])
    print(f"\nanalyse (fresh process, best of {args.rounds}): {best['turns']} ledger rows")
    for name, seconds, note in best["steps"]:
        shown = f"{seconds:8.2f} s" if seconds is not None else "       - "
        print(f"  {name:<20} {shown}  {note}")
    failed = [name for name, seconds, _ in best["steps"] if seconds is None]
    print(f"  {'total':<20} {best['total_s']:8.2f} s  (target <= 30 s"
          f"{'; ' + str(len(failed)) + ' analysis(es) failed' if failed else ''})")
    print(f"  peak RSS {best['peak_rss_mib']:.0f} MiB (after the ledger: "
          f"{best['ledger_rss_mib']:.0f} MiB; target <= 4096 MiB); DuckDB's spill at most "
          f"{_spill(best)}; {best['partitions']} turn spans a partition")


if __name__ == "__main__":
    main()
