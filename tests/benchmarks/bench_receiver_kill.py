"""Acknowledged vs stored spans over repeated SIGKILLs of ``kvscope serve``, both ways of acking.

Run: ``.venv/bin/python tests/benchmarks/bench_receiver_kill.py [--rounds 10]``

Each round starts the receiver on one store file, sends spans with unique ids from raw
OTLP/HTTP senders, a raw OTLP/gRPC sender and the official ``OTLPSpanExporter`` at once, and
SIGKILLs it a seeded random 0.5-2 s after the first answer (``tests/collector/receiver_kill.py``).
Afterwards every acknowledged id is looked up in the store. ``queued`` is the earlier
acknowledgement (answered once rows are queued), ``durable`` the current one (answered after
they are committed). It prints the counts; it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "collector"))

from receiver_kill import kill_trials  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="kills per way of acking")
    parser.add_argument("--spans-per-request", type=int, default=2048)
    args = parser.parse_args(argv)
    print(f"{'ack':<8} {'round':>5} {'acknowledged':>13} {'stored':>9} {'lost':>7}")
    for ack in ("queued", "durable"):
        with tempfile.TemporaryDirectory(prefix="kvscope-kill-") as tmp:
            trials = kill_trials(Path(tmp) / "killed.duckdb", args.rounds, ack=ack,
                                 spans_per_request=args.spans_per_request)
        for k, (acknowledged, stored) in enumerate(trials, start=1):
            print(f"{ack:<8} {k:>5} {acknowledged:>13,} {stored:>9,} {acknowledged - stored:>7,}")
        total = sum(a for a, _ in trials)
        lost = sum(a - s for a, s in trials)
        hit = sum(1 for a, s in trials if a != s)
        print(f"{ack:<8} {'all':>5} {total:>13,} {total - lost:>9,} {lost:>7,}"
              f"  (rounds with a loss: {hit} of {len(trials)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
