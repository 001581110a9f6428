"""What kvscope's vLLM plugin adds to a vLLM-like process: resident memory and import time.

Each case runs in a fresh interpreter, several times, alternating: a bare process, the plugin's
path as it is now (plugin, instrumentor, OTLP export set up, GPU sampler module), and that path
plus the store packages it loaded before the base install was split from the extras (``import
kvscope.store``: DuckDB, Arrow, polars). Prints the median peak RSS and the median time of the
imports and set-up, side by side.

Run: ``.venv/bin/python tests/benchmarks/bench_plugin_import.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PLUGIN = """
from kvscope.collector.vllm import plugin
from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor
from kvscope.collector.otel import setup_telemetry
from kvscope.collector import gpu
telemetry = setup_telemetry("vllm-prefill", otlp_endpoint="http://127.0.0.1:9")
"""
CASES = {
    "bare interpreter": "",
    "plugin path now": PLUGIN,
    "plugin path + store (before)": PLUGIN + "import kvscope.store\n",
}
PROBE = """
import resource, time, json
t = time.perf_counter()
{code}
elapsed = time.perf_counter() - t
print(json.dumps({{"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "import_ms": elapsed * 1000}}))
"""


def measure(code: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True,
                          text=True, check=True, timeout=120)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, code in CASES.items():  # alternating, so drift hits every case alike
            results[name].append(measure(code))
    print(f"{'':30} {'peak RSS MB':>12} {'import + set-up ms':>20}   (median of {args.rounds})")
    for name, runs in results.items():
        rss = statistics.median(r["rss_mb"] for r in runs)
        ms = statistics.median(r["import_ms"] for r in runs)
        print(f"{name:30} {rss:12.1f} {ms:20.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
