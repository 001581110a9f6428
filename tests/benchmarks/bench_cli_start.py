"""How long ``kvscope version`` and ``kvscope --help`` take to answer, and what they load.

Each case runs in a fresh interpreter, several times, alternating: the command as ``main`` runs
it now (only the chosen command's options are configured) and the same command after building
the full parser first (every command configured: what ``main`` did before). Prints the median
wall time and peak RSS side by side, and their ratio.

Run: ``.venv/bin/python tests/benchmarks/bench_cli_start.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASES = {
    "version (now)": "cli.main(['version'])",
    "version (full parser first)": "cli.build_parser(); cli.main(['version'])",
    "--help (now)": "cli.main(['--help'])",
    "--help (full parser first)": "cli.build_parser(); cli.main(['--help'])",
}
PROBE = """
import contextlib, io, json, resource, time
t = time.perf_counter()
from kvscope import cli
with contextlib.redirect_stdout(io.StringIO()):
    try:
        {code}
    except SystemExit:
        pass
elapsed = time.perf_counter() - t
print(json.dumps({{"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "ms": elapsed * 1000}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    got: dict[str, list[dict[str, float]]] = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, code in CASES.items():
            out = subprocess.run([sys.executable, "-c", PROBE.format(code=code)],
                                 capture_output=True, text=True, check=True)
            got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("ms", "rss_mb")}
           for name, runs in got.items()}
    print(f"{'case':32} {'median ms':>10} {'peak RSS MiB':>13}   ({rounds} rounds, alternating)")
    for name, m in med.items():
        print(f"{name:32} {m['ms']:10.0f} {m['rss_mb']:13.0f}")
    for cmd in ("version", "--help"):
        now, before = med[f"{cmd} (now)"], med[f"{cmd} (full parser first)"]
        time_ratio, rss_ratio = now["ms"] / before["ms"], now["rss_mb"] / before["rss_mb"]
        print(f"{cmd}: time {time_ratio:.2f}x, RSS {rss_ratio:.2f}x of building the full parser")


if __name__ == "__main__":
    main()
