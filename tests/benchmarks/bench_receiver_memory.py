"""Peak resident memory of ``kvscope serve`` under concurrent big one-span requests.

Run: ``.venv/bin/python tests/benchmarks/bench_receiver_memory.py [--requests 24] [--mib 60]``

The issue's load (24 concurrent one-span requests of 60 MiB each, ``max_request_bytes`` at its
64 MiB default) against the real receiver process, with ``max_inflight_bytes`` at its default
(128 MiB) and effectively off (64 GiB: every body admitted at once, as before the bound), in two
shapes (``tests/collector/receiver_memory.py``): ``stored``, the bytes are one attribute
the store keeps (what DuckDB holds for 1.4 GB of rows is then part of the peak), and
``skipped``, the bytes are a field OTLP does not define (the receiver reads and decodes them
but stores a few bytes: the peak is what it holds for requests). It prints baseline and peak
RSS (VmHWM), the most bytes admitted at once, and every final answer other than 200 (a 503 is
retried, as the exporters do); it asserts nothing. Linux only; needs about
5 GB of free memory for the unbounded stored run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "collector"))

from receiver_memory import big_body_load  # noqa: E402

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--mib", type=int, default=60, help="MiB per request")
    parser.add_argument("--max-request-mib", type=int, default=64)
    parser.add_argument("--budget-mib", type=int, default=128, help="max_inflight_bytes, MiB")
    parser.add_argument("--transports", default="http,grpc",
                        help="comma-separated: http, grpc (OTLP/HTTP, OTLP/gRPC)")
    parser.add_argument("--idle-s", type=float, default=5.0,
                        help="seconds after the load at which the idle RSS is read")
    parser.add_argument("--no-unbounded", action="store_true",
                        help="skip the runs with the budget effectively off (they need GBs)")
    args = parser.parse_args(argv)
    print(f"{args.requests} concurrent one-span requests of {args.mib} MiB, "
          f"max_request_bytes {args.max_request_mib} MiB\n")
    print(f"{'via':<5} {'shape':<8} {'max_inflight':>13} {'base MiB':>9} {'peak MiB':>9} "
          f"{'growth':>8} {'idle MiB':>9} {'admitted MiB':>13} {'503s':>5} {'200s':>5} "
          f"{'seconds':>8}")
    budgets = [args.budget_mib] if args.no_unbounded else [64 * 1024, args.budget_mib]
    for transport in args.transports.split(","):
        for stored in (False, True):
            for budget in budgets:
                with tempfile.TemporaryDirectory(prefix="kvscope-mem-") as tmp:
                    load = big_body_load(Path(tmp) / "big.duckdb", requests=args.requests,
                                         big_bytes=args.mib * MIB,
                                         max_request_bytes=args.max_request_mib * MIB,
                                         max_inflight_bytes=budget * MIB, stored=stored,
                                         transport=transport, idle_s=args.idle_s)
                label = "off" if budget == 64 * 1024 else f"{budget} MiB"
                print(f"{transport:<5} {'stored' if stored else 'skipped':<8} {label:>13} "
                      f"{load.baseline_rss_mib:9.0f} {load.peak_rss_mib:9.0f} "
                      f"{load.peak_rss_mib - load.baseline_rss_mib:8.0f} "
                      f"{load.idle_rss_mib:9.0f} "
                      f"{load.peak_inflight_bytes / MIB:13.0f} {load.retried_503:>5} "
                      f"{load.answered_200:>5} {load.seconds:8.1f}", flush=True)
                for answer, count in load.other_answers.items():
                    print(f"{'':<14} {count} x {answer}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
