"""Benchmark: the simulator's wall time on ~100k synthetic turns against a baseline checkout,
side by side in one run, with the A/A noise of the current code against itself.

The machine is shared, so an absolute time says little: each round runs, each in its own
process, the baseline, the current code and the current code again (order rotated per round),
simulating the same ``synthetic.generate(conversations=N, seed=1)`` workload with default
settings into a fresh DuckDB file. It prints each time, the median ratio current / baseline and
the median A/A ratio (current / current): a difference within the A/A spread is no difference.

The baseline is a package tree importable as ``kvscope`` (the repo's layout maps collector,
analysis, emulator and dashboards under it), made from a commit with::

    git archive <commit> | tar -x -C /tmp/base
    mkdir -p /tmp/basepkg && cp -r /tmp/base/kvscope /tmp/basepkg/ && \\
      for d in collector analysis emulator dashboards; do \\
        cp -r /tmp/base/$d /tmp/basepkg/kvscope/$d; done

With ``--no-truth`` the current code runs as ``kvscope simulate`` without ``--truth`` does
(``simulate(..., truth=False)``: no true outcome labelled; the store is the same), the baseline
as its ``simulate`` runs by default (issue 29's "13.8-15.0 s today" labelled the truth: there
was no other way then).

Run:  .venv/bin/python tests/benchmarks/bench_simulator_ratio.py --baseline /tmp/basepkg
      [--turns 100000] [--rounds 3] [--no-truth]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import sys, time, tempfile, os, resource
from kvscope.emulator.simulator import simulate
from kvscope.emulator.workloads import synthetic
work = synthetic.generate(conversations=int(sys.argv[1]), seed=1)
db = os.path.join(tempfile.mkdtemp(), "bench.duckdb")
# "no-truth": as kvscope simulate without --truth (a keyword older code does not take).
options = {"truth": False} if sys.argv[2] == "no-truth" else {}
started, cpu = time.perf_counter(), time.process_time()
result = simulate(work, db, **options)
wall = time.perf_counter() - started
child = resource.getrusage(resource.RUSAGE_CHILDREN)
# CPU seconds of this process and its span process: on a loaded machine wall time mostly
# measures the other tenants; CPU time is what the code itself cost.
print(result.turns, wall, time.process_time() - cpu + child.ru_utime + child.ru_stime)
"""
TURNS_PER_CONVERSATION = 31.1  # the generator's mean with its defaults (bench_simulator.py)


def _run(pythonpath: str | None, conversations: int, truth: str = "default"
         ) -> tuple[int, float, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(conversations), truth],
                              env=env,
                              cwd=cwd, capture_output=True, text=True, check=True)
    turns, seconds, cpu = done.stdout.split()[-3:]
    return int(turns), float(seconds), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="package tree of the baseline")
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-truth", action="store_true",
                        help="the current code without labelling the truth, as kvscope simulate "
                             "without --truth (the baseline runs its default)")
    args = parser.parse_args()
    conversations = round(args.turns / TURNS_PER_CONVERSATION)
    times: dict[str, list[float]] = {"baseline": [], "current": [], "current again": []}
    cpus: dict[str, list[float]] = {kind: [] for kind in times}
    kinds = list(times)
    for number in range(args.rounds):
        order = kinds[number % 3:] + kinds[:number % 3]
        for kind in order:
            turns, seconds, cpu = _run(
                args.baseline if kind == "baseline" else None, conversations,
                "no-truth" if args.no_truth and kind != "baseline" else "default")
            times[kind].append(seconds)
            cpus[kind].append(cpu)
            print(f"round {number + 1} {kind:>13}: {turns:,} turns in {seconds:.2f} s "
                  f"({cpu:.2f} CPU s)", flush=True)
    ratio = [c / b for c, b in zip(times["current"], times["baseline"], strict=True)]
    noise = [c / a for c, a in zip(times["current"], times["current again"], strict=True)]
    print(f"median seconds: baseline {statistics.median(times['baseline']):.2f}, current "
          f"{statistics.median(times['current']):.2f}, current again "
          f"{statistics.median(times['current again']):.2f}")
    print(f"ratio current / baseline: median {statistics.median(ratio):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratio)})")
    print(f"A/A current / current: median {statistics.median(noise):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in noise)})")
    cpu_ratio = [c / b for c, b in zip(cpus["current"], cpus["baseline"], strict=True)]
    cpu_noise = [c / a for c, a in zip(cpus["current"], cpus["current again"], strict=True)]
    print(f"CPU ratio current / baseline: median {statistics.median(cpu_ratio):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in cpu_ratio)}); A/A median "
          f"{statistics.median(cpu_noise):.3f}")


if __name__ == "__main__":
    main()
