"""Benchmark: the virtual-time simulator on large workloads, written to a fresh DuckDB file.

Two workloads, each simulated with default :class:`SimulationSettings` (profile ``qwen3-32b``,
prefix caching on at P and D) into a new DuckDB file in a temporary directory:

    synthetic   ``synthetic.generate(conversations=N, seed=...)`` sized to ~100k turns (the
                issue's target: 100k turns simulated and written in <= 20 s on this machine)
    weka        the full shipped WEKA CSV (~49k turns of ~122k-token prompts)

Each workload runs three times per round, alternating: as ``simulate`` does by default (from
``PROCESS_ROWS_MIN_TURNS`` turns, the turn and engine records go to a span process, which builds
the spans, converts and inserts them while this one simulates; "convert" is then the pickling
and sending of record batches, blocked while the span process is behind, and "insert wait" the
wait for the span process to start and, at the end, to finish), the same without labelling each
turn's truth ("/no truth": ``kvscope simulate`` without ``--truth``; the store is the same), and
with every span built and written in the simulating process ("/rows here"). Each round prints
the ratio of the run without truth to the default. Each (workload, round) runs in its own
process, so peak RSS (``ru_maxrss``) belongs to that workload alone (the span process's is
"writer RSS"); with ``--rounds 2`` (the default) the best time of the rounds is reported, since
the machine is shared. Per run it prints the workload build seconds, the simulate seconds split
into the reuse model + span building and row appends ("model+spans"), row → Arrow conversion
("convert") and the time spent waiting for DuckDB inserts ("insert wait"; the inserts run on a
writer thread while the next batch is simulated), turns/s, µs/turn, spans written, file size,
peak RSS, and the CPU seconds of the simulating process and of the span process ("cpu here",
"cpu child": on 2 cores the wall time cannot fall below half their sum).

First it prints the prefix cache micro-benchmark of the emulated HTTP servers' shape: one
lookup + two touches of a 7,556-block prompt of random chained hashes (every consecutive-id run
one block long), for the cache's per-block form, its run form forced on the same sequence, and
the per-block OrderedDict LRU it replaced, side by side (the run form on these sequences was
the ~10x regression the per-block form fixes).

With ``--split`` it also runs the workload with rows left out ("no rows": spans shaped, nothing
kept) and with spans left out too ("model only": the reuse model and event loop alone).

Run:  .venv/bin/python tests/benchmarks/bench_simulator.py [--turns 100000] [--rounds 2]
      [--only synthetic|weka|cache] [--weka-conversations N] [--split]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

# Mean turns per synthetic conversation with the generator's defaults (sub-agents included),
# measured with seed 1 (the default here): ~31.1. Only sizes the workload; the count is printed.
_SYNTHETIC_TURNS_PER_CONVERSATION = 31.1


def _bench_prefix_cache(blocks: int = 7_556, repeats: int = 15) -> None:
    """Print ms per (lookup + two touches) of a server-shaped prompt, per cache form."""
    import random
    from collections import OrderedDict

    from kvscope.emulator.reuse_model import PrefixCache
    from kvscope.emulator.tokens import BlockSeq

    class _OrderedDictLru:
        """The cache before stamps: one OrderedDict entry per block, moved tail first."""

        def __init__(self) -> None:
            self.lru: OrderedDict[int, None] = OrderedDict()

        def longest_hit_blocks(self, seq: BlockSeq) -> int:
            i, hashes = 0, seq.block_hashes
            while i < len(hashes) and hashes[i] in self.lru:
                i += 1
            return i

        def touch(self, seq: BlockSeq) -> None:
            for block in reversed(seq.block_hashes):
                if block in self.lru:
                    self.lru.move_to_end(block)
                else:
                    self.lru[block] = None

    rng = random.Random(7)
    tokens = [rng.randrange(1 << 31) for _ in range((blocks + 40) * 16)]
    # Each round a fresh, slightly longer sequence (as a new turn's prompt is): nothing cached
    # on the sequence object (its runs) carries over.
    prompts = [BlockSeq.from_tokens(tokens[: (blocks - repeats + i) * 16 + 5])
               for i in range(repeats)]
    outputs = [p.extend(tokens[len(tokens) - 300 :]) for p in prompts]

    def per_block() -> Any:
        return PrefixCache(1 << 20)

    def run_form() -> Any:
        cache = PrefixCache(1 << 20)
        cache._per_block = False  # force the run walk on run-less sequences (the regression)
        return cache

    results: dict[str, float] = {}
    for name, make in (("per-block", per_block), ("runs (forced)", run_form),
                       ("OrderedDict", _OrderedDictLru)):
        cache = make()
        best = float("inf")
        for prompt, output in zip(prompts, outputs, strict=True):
            prompt = BlockSeq(prompt.block_hashes, prompt.num_tokens, prompt.tail)
            output = BlockSeq(output.block_hashes, output.num_tokens, output.tail)
            start = time.perf_counter()
            cache.longest_hit_blocks(prompt)
            cache.touch(prompt)
            cache.touch(output)
            best = min(best, time.perf_counter() - start)
        results[name] = best * 1e3
    base = results["per-block"]
    print(f"prefix cache, {blocks}-block prompt of random chained hashes, "
          f"lookup + 2 touches (best of {repeats}):")
    for name, ms in results.items():
        print(f"  {name:<14} {ms:>7.2f} ms  ({ms / base:>5.1f}x per-block)")


def _timed(fn: Any, bucket: dict[str, float], key: str) -> Any:
    """Wrap ``fn`` so the seconds spent inside it accumulate in ``bucket[key]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket[key] += time.perf_counter() - start

    return wrapper


def _run_one(kind: str, turns: int, weka_conversations: int | None, seed: int,
             rows_here: bool, stub: str | None = None, truth: bool = True) -> dict[str, Any]:
    """Build one workload, simulate it into a fresh file, and return the measurements.

    ``rows_here``: build, convert and insert the spans in this process even when the workload
    is large enough for the span process (the simulator's default from
    ``PROCESS_ROWS_MIN_TURNS`` turns).
    """
    from kvscope.collector import span_rows
    from kvscope.emulator import simulator
    from kvscope.emulator import span_process as span_process_module
    from kvscope.emulator.workloads import synthetic, weka

    if rows_here or stub:
        simulator.PROCESS_ROWS_MIN_TURNS = 2**62
    if stub:
        _stub_stages(stub)
    phases = {"convert": 0.0, "insert": 0.0}
    # Split the simulate time without touching the simulator: time rows -> Arrow conversion
    # (the direct row path's column batches; spans_to_rows too, should the SDK span path run)
    # and the main thread's waits for the writer thread's DuckDB inserts (which otherwise
    # overlap). Appending each span's row happens inside model+spans.
    span_rows.spans_to_rows = _timed(span_rows.spans_to_rows, phases, "convert")
    span_rows.rows_to_arrow = _timed(span_rows.rows_to_arrow, phases, "convert")
    sink = span_rows.RowSink
    sink._wait = _timed(sink._wait, phases, "insert")
    # With the span process, this process only pickles and sends record batches ("convert":
    # blocked when the span process is behind) and waits for it to start (what is left after
    # the block view is built) and, at the end, to finish ("insert").
    span_process = span_process_module.SpanProcess
    span_process.flush = _timed(span_process.flush, phases, "convert")
    span_process.ready = _timed(span_process.ready, phases, "insert")
    span_process.close = _timed(span_process.close, phases, "insert")

    start = time.perf_counter()
    if kind == "synthetic":
        conversations = max(1, round(turns / _SYNTHETIC_TURNS_PER_CONVERSATION))
        workload = synthetic.generate(conversations=conversations, seed=seed)
    else:
        workload = weka.load_csv(conversations=weka_conversations)
    build_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory(prefix="kvscope-bench-sim-") as tmp:
        db = Path(tmp) / "sim.duckdb"
        cpu_here = time.process_time()
        start = time.perf_counter()
        result = simulator.simulate(workload, db, simulator.SimulationSettings(), truth=truth)
        simulate_s = time.perf_counter() - start
        cpu_here = time.process_time() - cpu_here
        wal = db.with_name(db.name + ".wal")
        size = db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    writer_kib = children.ru_maxrss
    return {
        "workload": kind + (f"/{stub}" if stub else "/rows here" if rows_here
                            else "" if truth else "/no truth"),
        "conversations": len(workload.conversations),
        "turns": result.turns,
        "prompt_tokens": sum(t.prompt_tokens for c in workload.conversations for t in c.turns),
        "build_s": build_s,
        "simulate_s": simulate_s,
        "model_spans_s": simulate_s - phases["convert"] - phases["insert"],
        "convert_s": phases["convert"],
        "insert_s": phases["insert"],
        "spans": result.spans,
        "file_mib": size / 2**20,
        "peak_rss_mib": peak_kib / 1024,
        "writer_rss_mib": writer_kib / 1024 if not rows_here else 0.0,
        "cpu_here_s": cpu_here,
        "cpu_child_s": children.ru_utime + children.ru_stime,
    }


def _stub_stages(stub: str) -> None:
    """Leave out the later stages to split the simulating process's time (``--split``).

    "no rows": spans are shaped (``spans_for``, engine spans) but no row is kept or written;
    "model only": not even shaped. What remains is the reuse model and the event loop.
    """
    from kvscope.collector import span_rows
    from kvscope.collector.engine_telemetry import EngineTelemetry
    from kvscope.collector.proxy.telemetry import ProxyTelemetry

    def appender(self: Any) -> Any:
        def row(*args: Any) -> None:
            pass

        return row

    span_rows.RowSink._appender = appender
    span_rows.RowSink.flush = lambda self: None
    if stub == "model only":
        ProxyTelemetry.spans_for = lambda self, record: []
        EngineTelemetry.emit = lambda self, record: None


def _child(kind: str, turns: int, weka_conversations: int | None, seed: int, rows_here: bool,
           stub: str | None, truth: bool, queue: Any) -> None:
    queue.put(_run_one(kind, turns, weka_conversations, seed, rows_here, stub, truth))


def _in_process(kind: str, turns: int, weka_conversations: int | None, seed: int,
                rows_here: bool = False, stub: str | None = None,
                truth: bool = True) -> dict[str, Any]:
    """Run one measurement in a fresh process (spawned: no inherited heap in its peak RSS)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child,
                       args=(kind, turns, weka_conversations, seed, rows_here, stub, truth,
                             queue))
    proc.start()
    out: dict[str, Any] = queue.get()
    proc.join()
    return out


def _print(rows: list[dict[str, Any]]) -> None:
    header = (f"{'workload':<10} {'turns':>7} {'build s':>8} {'simulate s':>10} "
              f"{'model+spans':>11} {'convert':>8} {'ins.wait':>8} {'turns/s':>8} {'us/turn':>8} "
              f"{'spans':>8} {'file MiB':>8} {'peak RSS MiB':>12} {'writer RSS':>10} "
              f"{'cpu here':>8} {'cpu child':>9}")
    print(header)
    for r in rows:
        print(f"{r['workload']:<10} {r['turns']:>7} {r['build_s']:>8.2f} {r['simulate_s']:>10.2f} "
              f"{r['model_spans_s']:>11.2f} {r['convert_s']:>8.2f} {r['insert_s']:>8.2f} "
              f"{r['turns'] / r['simulate_s']:>8.0f} {r['simulate_s'] / r['turns'] * 1e6:>8.0f} "
              f"{r['spans']:>8} {r['file_mib']:>8.1f} {r['peak_rss_mib']:>12.0f} "
              f"{r['writer_rss_mib']:>10.0f} {r['cpu_here_s']:>8.1f} {r['cpu_child_s']:>9.1f}")


# (rows written in the simulating process, truth labelled) per measured mode.
_MODES = ((False, True), (False, False), (True, True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=100_000, help="synthetic turns (approx.)")
    parser.add_argument("--weka-conversations", type=int, default=None,
                        help="WEKA conversations to load (default: the whole CSV)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per workload; best is kept")
    parser.add_argument("--only", choices=("synthetic", "weka", "cache"), default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    parser.add_argument("--split", action="store_true",
                        help="also run with rows left out and with spans left out (one round "
                        "each): the simulating process's time by stage")
    args = parser.parse_args()

    _bench_prefix_cache()
    if args.only == "cache":
        return
    kinds = [args.only] if args.only else ["synthetic", "weka"]
    every: list[dict[str, Any]] = []
    best: list[dict[str, Any]] = []
    for kind in kinds:
        # The default (rows in the span process, each turn's truth labelled), the same
        # without the truth (kvscope simulate without --truth), and rows written in the
        # simulating process, alternating per round.
        runs: dict[tuple[bool, bool], list[dict[str, Any]]] = {mode: [] for mode in _MODES}
        for round_no in range(args.rounds):
            for rows_here, truth in _MODES:
                run = _in_process(kind, args.turns, args.weka_conversations, args.seed,
                                  rows_here, truth=truth)
                run["round"] = round_no
                runs[rows_here, truth].append(run)
                print(f"  {run['workload']} round {round_no + 1}/{args.rounds}: "
                      f"{run['simulate_s']:.2f} s simulate", flush=True)
        for mode_runs in runs.values():
            every.extend(mode_runs)
            best.append(min(mode_runs, key=lambda r: r["simulate_s"]))
        for a, b in zip(runs[False, True], runs[False, False], strict=True):
            print(f"  {kind} round {a['round'] + 1}: without truth / with: "
                  f"{b['simulate_s'] / a['simulate_s']:.2f}x wall, "
                  f"{b['cpu_here_s'] / a['cpu_here_s']:.2f}x cpu here")
        if args.split:
            for stub in ("no rows", "model only"):
                run = _in_process(kind, args.turns, args.weka_conversations, args.seed,
                                  stub=stub)
                every.append(run)
                best.append(run)
    print(f"\nbest of {args.rounds} run(s) per workload (each in its own process):")
    _print(best)
    if args.json is not None:
        args.json.write_text(json.dumps(every, indent=1))


if __name__ == "__main__":
    main()
