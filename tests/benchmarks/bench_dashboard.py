"""Dashboard page latency on a large store: each page's first render and a filter change.

Usage: ``python tests/benchmarks/bench_dashboard.py [--turns 1000000] [--cache DIR]``.

The store (feature ON and OFF over one synthetic workload, virtual-time simulator) is generated
once into ``--cache`` (default ``~/.cache/kvscope-bench``, outside the repository) and reused.
The script prints, side by side: opening the data version (ledger from raw spans, once per
version), then per page the first render with every run, and the render after a filter change
(one run unticked), each against the 1 s target. Times are measured, never asserted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvscope.dashboards.data import Filters, open_data
from kvscope.dashboards.pages import (
    compare,
    conversations,
    missed,
    overview,
    retention,
    task_time,
    whatif,
)

TARGET_S = 1.0
TURNS_PER_CONVERSATION = 43  # the synthetic generator's mean at its defaults (measured)


def make_store(turns: int, cache: Path) -> Path:
    """The cached store of about ``turns`` turns per run, generated when absent."""
    from kvscope.emulator.simulator import SimulationSettings, simulate
    from kvscope.emulator.workloads import synthetic

    db = cache / f"dashboard-{turns}.duckdb"
    if db.exists():
        return db
    cache.mkdir(parents=True, exist_ok=True)
    partial = db.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    workload = synthetic.generate(conversations=max(1, turns // TURNS_PER_CONVERSATION), seed=1)
    for label, on in (("feature ON", True), ("feature OFF", False)):
        started = time.perf_counter()
        result = simulate(workload, partial, SimulationSettings(
            profile="qwen3-32b", label=label, prefill_bidirectional_kv_xfer=on,
            decode_bidirectional_kv_xfer=on, seed=1))
        print(f"simulated {label}: {result.turns:,} turns in "
              f"{time.perf_counter() - started:.1f} s")
    partial.rename(db)
    return db


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1_000_000, help="turns per run")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvscope-bench")
    args = parser.parse_args()
    db = make_store(args.turns, args.cache)
    data = open_data(db)
    open_s = timed(lambda: data.ledger())
    turns = data.ledger().height
    from kvscope.dashboards.app import warm

    warm_s = timed(lambda: warm(data))
    runs = data.runs()["run_id"].to_list()
    narrowed = Filters(runs=tuple(runs[:1]))
    pick = conversations.options(data, Filters())[0]
    value = pick[0]["value"] if pick else None
    page_renders: dict[str, Callable[[Filters], Any]] = {
        "overview": lambda f: overview.content(data, f),
        "conversations": lambda f: (conversations.options(data, f),
                                    conversations.content(data, f, value)),
        "missed": lambda f: missed.content(data, f),
        "retention": lambda f: retention.content(data, f),
        "task_time": lambda f: task_time.content(data, f),
        "whatif": lambda f: whatif.content(data, f, None, None),
        "compare": lambda f: compare.content(data, f, None, None),
    }
    print(f"\nstore {db} ({db.stat().st_size / 1e6:.0f} MB), {turns:,} turns, "
          f"{len(runs)} runs")
    print(f"open data version (ledger from raw spans, once per version): {open_s:.2f} s")
    print(f"warm every page's unfiltered results (file mode, at start-up): {warm_s:.2f} s\n")
    print(f"{'page':<14} {'first render':>13} {'filter change':>14} {'repeat':>8}   "
          f"(target {TARGET_S:g} s)")
    for name, render in page_renders.items():
        first = timed(lambda: render(Filters()))  # noqa: B023 (called before the next loop)
        change = timed(lambda: render(narrowed))  # noqa: B023
        again = timed(lambda: render(narrowed))  # noqa: B023
        flag = "" if max(first, change) <= TARGET_S else "  over target"
        print(f"{name:<14} {first:>12.3f}s {change:>13.3f}s {again:>7.3f}s{flag}")
    data.close()


if __name__ == "__main__":
    main()
