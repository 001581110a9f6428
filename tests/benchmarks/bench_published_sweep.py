"""Benchmark: the published bidirectional-KV sweep, simulated, beside the published numbers.

Runs ``kvscope simulate --workload sweep``'s runs (1P1D, prefix caching off on P, the feature ON
and OFF, ``qwen3-32b`` and ``glm-5-fp8``, shared prefixes 2k → 24k, 10 chats × 10 turns of 150
new and 300 output tokens) into a fresh DuckDB file and prints the ``published_sweep`` analysis:
per model, feature and prompt length the simulated mean TTFT, prefill leg and D→P read time, the
published value (:mod:`kvscope.published`; only the two ends of each sweep were published) and
the ratio simulated / published, then, for every point outside ±15 %, which part of the cost
model misses and why. Last, the wall time of the runs.

The cost profiles are solved from these same published ends (``emulator/cost_model.py``), over
the mean composition of the sweep's own turns (history re-sent, first turns pull nothing), so no
published point is held out of the calibration: a match at the ends tests that the simulator
composes the costs as the fit did, not the cost model's extrapolation between or beyond them.

With ``--cost-model physics`` the runs are timed by ``emulator/physics.py`` (fitted on the
published prefill and read points, not on TTFT; decode at the HBM floor), so the TTFT column
shows what the physics leaves out of the D leg.

Run:  .venv/bin/python tests/benchmarks/bench_published_sweep.py [--prefix-tokens 2000,24000]
      [--cost-model physics]
Not a test: nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    from kvscope import published
    from kvscope.analysis import registry
    from kvscope.cli.simulate import SWEEP_COLUMNS, run_each, sweep_rows
    from kvscope.emulator.simulator import COST_FITTED, COST_MODELS, SimulationSettings
    from kvscope.emulator.sweeps import DEFAULT_PREFIX_TOKENS, sweep_runs
    from kvscope.tables import format_rows

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix-tokens", default=",".join(map(str, DEFAULT_PREFIX_TOKENS)))
    parser.add_argument("--cost-model", choices=COST_MODELS, default=COST_FITTED,
                        help="physics: the physics model fitted on all 12 published prefill "
                             "and read points (in-sample here too)")
    args = parser.parse_args()
    prefixes = [int(v) for v in args.prefix_tokens.split(",")]

    runs = sweep_runs(SimulationSettings(label="bench", cost_model=args.cost_model), None,
                      prefixes)
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-sweep-") as tmp:
        db = Path(tmp) / "sweep.duckdb"
        start = time.perf_counter()
        results = list(run_each([(r.settings, r.workload) for r in runs], db))
        wall = time.perf_counter() - start
        with registry.AnalysisContext.open(db) as ctx:
            table = registry.run(ctx, "published_sweep")
    print(format_rows(list(SWEEP_COLUMNS), sweep_rows(table), "table"), end="")
    compared = table.filter(table["within_15pct"].is_not_null())
    print(f"\n{compared['within_15pct'].sum()} of {compared.height} published points within "
          "±15 % on every published quantity (TTFT, prefill, transfer where published)")
    print("(every published point was used to solve the profiles: none is held out)")
    for row in compared.filter(~compared["within_15pct"]).iter_rows(named=True):
        print(f"- {row['model']} {row['feature'].upper()} {row['prompt_tokens']:,}: {row['why']}")
    turns = sum(r.turns for r in results)
    print(f"\n{len(results)} runs, {turns:,} turns simulated and stored in {wall:.1f} s")
    print(f"published: {published.SOURCE}")


if __name__ == "__main__":
    main()
