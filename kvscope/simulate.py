"""``kvscope simulate``: the virtual-time simulator on a workload, one run or a sweep, into a store.

The options, sweeps, workloads and progress are :mod:`kvscope.emulator.simulate_command`'s; this
module composes the command: the runs, the truth file, then a summary per run read back from the
store through the analysis registry (the ``verdict`` analysis: reuse, top miss causes, retained
GiB·s, TTFT p50 / p90), so its numbers are those ``kvscope report`` shows for the same store.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvscope import published
from kvscope.emulator.simulate_command import (
    base_settings,
    describe,
    expand,
    load_workload,
    parse_sweep,
    run_all,
    run_each,
    sweep_plans,
)
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, iter_truth
from kvscope.emulator.workloads.model import Workload
from kvscope.tables import NOT_MEASURED

SUMMARY_COLUMNS = ("label", "turns", "reuse", "top miss causes", "retained GiB·s",
                   "TTFT p50 ms", "TTFT p90 ms")


def _pct(value: float | None) -> str:
    # One decimal (the verdict rounds to whole percents): a planner compares settings here.
    return NOT_MEASURED if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int) -> str:
    return NOT_MEASURED if value is None else f"{value:,.{digits}f}"


def summary_rows(db: str | Path, run_ids: Sequence[str]) -> list[tuple[str, ...]]:
    """Per run: reuse, top miss causes, retained GiB·s, TTFT p50 / p90, from the ``verdict``
    analysis of the registry (the numbers ``kvscope report`` shows)."""
    from kvscope.analysis import registry
    from kvscope.analysis.verdict import TOP_CAUSES

    with registry.AnalysisContext.open(db, runs=list(run_ids)) as ctx:
        verdict = registry.run(ctx, "verdict")
    by_id = {row["run_id"]: row for row in verdict.iter_rows(named=True)}
    rows: list[tuple[str, ...]] = []
    for run_id in run_ids:
        row = by_id.get(run_id, {})
        causes = ", ".join(
            f"{row[f'cause_{i}']} {_pct(row[f'cause_{i}_share'])}"
            for i in range(1, TOP_CAUSES + 1) if row.get(f"cause_{i}")
        ) or ("none" if row else NOT_MEASURED)
        turns = row.get("turns")
        rows.append((str(row.get("label") or run_id),
                     NOT_MEASURED if turns is None else f"{turns:,}",
                     _pct(row.get("token_reuse_rate")), causes,
                     _num(row.get("retained_gib_s"), 1), _num(row.get("ttft_p50_ms"), 0),
                     _num(row.get("ttft_p90_ms"), 0)))
    return rows


def _write_truth(path: Path, results: Sequence[SimulationResult]) -> int:
    count = 0
    with path.open("w") as out:
        for result in results:
            for row in iter_truth(result):
                out.write(json.dumps(row) + "\n")
                count += 1
    return count


def main_simulate(args: argparse.Namespace) -> int:
    """Run ``kvscope simulate``: the runs, the truth file, then one summary row per run."""
    from kvscope.tables import format_rows

    base = base_settings(args)
    if args.workload == "sweep":
        return _main_published_sweep(args, base)
    plans = expand(base, [parse_sweep(s) for s in args.sweep])
    loaded: dict[int, Workload] = {}

    def workload_for(block_size: int) -> Workload:
        if block_size not in loaded:
            loaded[block_size] = load_workload(args, block_size)
            print(describe(loaded[block_size]), file=sys.stderr)
        return loaded[block_size]

    started = time.monotonic()
    stream = None if args.quiet else sys.stderr
    results = list(run_all(workload_for, plans, args.db, stream=stream))
    if args.truth:
        rows = _write_truth(Path(args.truth), results)
        print(f"truth: {rows:,} rows in {args.truth}", file=sys.stderr)
    print(f"{len(results)} run(s) into {args.db} in {time.monotonic() - started:.1f} s")
    sys.stdout.write(format_rows(list(SUMMARY_COLUMNS),
                                 summary_rows(args.db, [r.run_id for r in results]), "table"))
    print(f"report: kvscope report {args.db} -o report.html")
    return 0


def _main_published_sweep(args: argparse.Namespace, base: SimulationSettings) -> int:
    """``--workload sweep``: the published sweep's runs, then simulated vs published per run."""
    from kvscope.analysis import registry
    from kvscope.tables import format_rows

    runs = sweep_plans(args, base)
    started = time.monotonic()
    stream = None if args.quiet else sys.stderr
    results = list(run_each(runs, args.db, stream=stream))
    if args.truth:
        rows = _write_truth(Path(args.truth), results)
        print(f"truth: {rows:,} rows in {args.truth}", file=sys.stderr)
    print(f"{len(results)} run(s) into {args.db} in {time.monotonic() - started:.1f} s")
    with registry.AnalysisContext.open(args.db, runs=[r.run_id for r in results]) as ctx:
        table = registry.run(ctx, "published_sweep")
    sys.stdout.write(format_rows(list(SWEEP_COLUMNS), sweep_rows(table), "table"))
    print(f"published: {published.SOURCE}")
    print(f"report: kvscope report {args.db} -o report.html")
    return 0


SWEEP_COLUMNS = ("model", "feature", "prompt", "TTFT ms", "published", "ratio", "prefill ms",
                 "published", "ratio", "transfer ms", "published", "ratio")


def sweep_rows(table: Any) -> list[tuple[str, ...]]:
    """The ``published_sweep`` result as text rows (what the command and the benchmark print)."""
    def ms(value: float | None) -> str:
        return _num(value, 0)

    def ratio(value: float | None) -> str:
        return NOT_MEASURED if value is None else f"{value:.2f}"

    return [
        (str(r["model"]), str(r["feature"]), f"{r['prompt_tokens']:,}", ms(r["ttft_ms"]),
         ms(r["ttft_published_ms"]), ratio(r["ttft_ratio"]), ms(r["prefill_ms"]),
         ms(r["prefill_published_ms"]), ratio(r["prefill_ratio"]), ms(r["transfer_ms"]),
         ms(r["transfer_published_ms"]), ratio(r["transfer_ratio"]))
        for r in table.iter_rows(named=True)
    ]
