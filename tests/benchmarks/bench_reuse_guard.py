"""What ``kvscope proxy --reuse-guard`` costs in reuse, and what it prevents, on shipped traces.

Each workload is simulated twice in one run, guard off and on, with the same seed (the same
arrivals, gaps and faults), and the ground truth of both is printed side by side: later turns,
turns that reused decode's KV validly, turns that loaded KV not matching their prompt
(``reused_invalid``) with the tokens loaded, valid remote tokens, and TTFT p50 / p90.

Run: ``.venv/bin/python tests/benchmarks/bench_reuse_guard.py [--weka-conversations N]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvscope.emulator.simulator import SimulationSettings, iter_truth, simulate
from kvscope.emulator.workloads import synthetic, weka
from kvscope.emulator.workloads.model import Workload
from kvscope.reuse import outcomes


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(workload: Workload, guard: bool, profile: str) -> dict[str, Any]:
    """Simulate ``workload`` once and summarise its ground truth."""
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-guard-") as tmp:
        result = simulate(workload, Path(tmp) / "g.duckdb", SimulationSettings(
            profile=profile, label=f"guard={guard}", reuse_guard=guard, seed=7))
        truth = list(iter_truth(result))
    later = [t for t in truth if t["turn_index"] >= 2]
    valid = [t for t in later if t["outcome"] in (outcomes.REUSED_REMOTE, outcomes.REUSED_LOCAL,
                                                  outcomes.PARTIAL)]
    invalid = [t for t in later if t["outcome"] == outcomes.REUSED_INVALID]
    ttft = [t["ttft_ms"] for t in truth if t["ttft_ms"] is not None]
    reusable = sum(t["reusable_tokens"] for t in later)
    reused = sum(t["local_hit_tokens"] + t["remote_reused_tokens"] for t in later)
    return {
        "later turns": len(later),
        "valid reuse turns": len(valid),
        "reused_invalid turns": len(invalid),
        "prefix_diverged turns": sum(t["outcome"] == outcomes.PREFIX_DIVERGED for t in later),
        "valid reused tokens": reused,
        "token reuse rate": reused / reusable if reusable else None,
        "TTFT p50 ms": statistics.median(ttft) if ttft else None,
        "TTFT p90 ms": _quantile(ttft, 0.9),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "not measured"
    if isinstance(value, float):
        return f"{value:.4f}" if value < 10 else f"{value:,.1f}"
    return f"{value:,}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weka-conversations", type=int, default=None,
                        help="conversations of the shipped WEKA traces (all by default)")
    args = parser.parse_args(argv)
    workloads = {
        "weka (shipped traces)": (weka.load_csv(conversations=args.weka_conversations),
                                  "qwen3-32b"),
        "synthetic, resets 5%": (synthetic.generate(conversations=60, seed=3,
                                                    reset_probability=0.05), "qwen3-32b"),
    }
    for name, (workload, profile) in workloads.items():
        off, on = measure(workload, False, profile), measure(workload, True, profile)
        print(f"\n{name}: {workload.summary()}")
        print(f"  {'':24} {'guard off':>14} {'guard on':>14}")
        for key in off:
            print(f"  {key:24} {_fmt(off[key]):>14} {_fmt(on[key]):>14}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
