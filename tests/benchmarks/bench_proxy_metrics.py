"""Benchmark: the proxy's Prometheus metrics per turn and per scrape, side by side in one run.

Times ``ProxyTelemetry._observe`` (what a finished turn costs the event loop for metrics) and one
``/metrics`` rendering, for this tree's metrics layer (``prometheus_client``,
:mod:`kvscope.collector.proxy.metrics`) and, with ``--baseline REV``, for the ``telemetry.py`` of a
git revision loaded next to it (580feb7: the hand-written exposition it replaced). Rounds alternate
between the two, so drift on a shared machine hits both alike. Turns are varied like real ones:
3 models, 2 prefill and 2 decode instances, router hits and misses, 1 in 20 failed.

Run:  .venv/bin/python tests/benchmarks/bench_proxy_metrics.py [--baseline 580feb7] [--turns 20000]
      [--rounds 7]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from kvscope import semconv
from kvscope.collector.proxy import telemetry as current

ROOT = Path(__file__).resolve().parents[2]


def load_revision(rev: str) -> ModuleType:
    """``collector/proxy/telemetry.py`` as it was at ``rev``, imported under its own name."""
    source = subprocess.run(["git", "show", f"{rev}:collector/proxy/telemetry.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_telemetry.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_telemetry", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def records(module: ModuleType, n: int) -> list[Any]:
    out = []
    base = 1_767_225_600_000_000_000
    for i in range(n):
        r = module.TurnRecord(f"req-{i}", "/v1/chat/completions", base + i * 1_000_000, i + 1,
                              3 * i + 1, 3 * i + 2, 3 * i + 3)
        r.model = ("qwen3-32b", "llama-70b", "mistral")[i % 3]
        r.prefill_instance = f"10.0.0.{1 + i % 2}:8100"
        r.decode_instance = f"10.0.1.{1 + i % 2}:8200"
        r.lookup = semconv.ROUTER_HIT if i % 4 else semconv.ROUTER_MISS
        r.prefill_start_ns, r.prefill_end_ns = r.arrival_ns + 10_000, r.arrival_ns + 40_000_000
        r.decode_start_ns = r.prefill_end_ns + 100_000
        r.first_token_ns = r.decode_start_ns + 5_000_000 + (i % 97) * 1_000_000
        r.decode_end_ns = r.first_token_ns + 200_000_000
        r.end_ns = r.decode_end_ns + 50_000
        if i % 20 == 0:
            r.fail(semconv.LEG_DECODE, semconv.ERROR_CONNECT, 502, "x")
        out.append(r)
    return out


def observe_us(module: ModuleType, turns: list[Any]) -> float:
    telemetry = module.ProxyTelemetry(None)
    start = time.perf_counter()
    for r in turns:
        telemetry._observe(r)
    return (time.perf_counter() - start) / len(turns) * 1e6


def scrape_us(module: ModuleType, turns: list[Any], scrapes: int = 50) -> tuple[float, int]:
    telemetry = module.ProxyTelemetry(None)
    for r in turns:
        telemetry._observe(r)
    start = time.perf_counter()
    for _ in range(scrapes):
        if module is current:
            body, _ = telemetry.render_metrics(lambda: 100)
        else:
            body = telemetry.render_metrics(100).encode()
    return (time.perf_counter() - start) / scrapes * 1e6, len(body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    parser.add_argument("--turns", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    modules = {"prometheus_client (this tree)": current}
    if args.baseline:
        modules[f"hand-written ({args.baseline})"] = load_revision(args.baseline)
    turns = {name: records(module, args.turns) for name, module in modules.items()}
    per_turn: dict[str, list[float]] = {name: [] for name in modules}
    per_scrape: dict[str, list[float]] = {name: [] for name in modules}
    size: dict[str, int] = {}
    for round_index in range(args.rounds):
        order = list(modules) if round_index % 2 == 0 else list(reversed(modules))
        for name in order:
            per_turn[name].append(observe_us(modules[name], turns[name]))
            us, size[name] = scrape_us(modules[name], turns[name][:2000])
            per_scrape[name].append(us)
    print(f"proxy metrics: {args.turns} turns x {args.rounds} alternating rounds "
          f"(python {sys.version.split()[0]})")
    for name in modules:
        print(f"  {name:34s} observe: median {statistics.median(per_turn[name]):6.2f} us/turn "
              f"(min {min(per_turn[name]):.2f}); /metrics: median "
              f"{statistics.median(per_scrape[name]) / 1e3:6.2f} ms/scrape, {size[name]} bytes")
    if len(modules) == 2:
        new, old = (statistics.median(per_turn[n]) for n in modules)
        print(f"  difference per turn: {new - old:+.2f} us (ratio {new / old:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
