"""Benchmark: ``kvscope ingest`` of a run made without kvscope, kind by kind, then joined.

Writes, into a temporary folder, the three files a run of ``--conversations`` × ``--turns``
leaves, in the formats the parsers cite (vLLM 0.33.0): the benchmark's ``--stats-json-output``
(``json.dump(indent=2)`` of RequestStats records), vLLM's ``disagg_proxy_multiturn.py`` log
(HIT/MISS, "Prefill done", "cached D blocks", plus uvicorn's access line per request) and a
prefill server's log (``Skipping remote pull`` at DEBUG for one turn in five, a ``KV Transfer
metrics`` line per 100 requests, and an unrelated INFO line per request). Then, side by side in
one process:

    read <kind>   parse and check one file (``Kind.read``): lines/s and records/s
    ingest        all three as one run into a fresh store: parse, join, spans, one transaction
    ledger        the ledger of that store (``analysis.ledger.ledger``)

Each step prints wall seconds and, in brackets, this process's CPU seconds (on a shared machine
the wall time includes waiting for a core). Rates are per wall second.

Run:  .venv/bin/python tests/benchmarks/bench_ingest.py [--conversations 10000] [--turns 5]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path

_PROXY_FORMAT = logging.Formatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s",
                                  "%Y-%m-%d %H:%M:%S")
_SERVER_FORMAT = logging.Formatter("(%(vllm_process_name)s pid=%(process)d) %(levelname)s "
                                   "%(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s",
                                   "%m-%d %H:%M:%S")


def _line(formatter: logging.Formatter, at: float, level: int, msg: str, *args: object,
          **extra: object) -> str:
    record = logging.LogRecord("disagg_proxy", level, "x.py", 1, msg, args, None)
    record.created, record.msecs = at, 0.0
    record.__dict__.update(extra)
    return formatter.format(record)


def write_run(folder: Path, conversations: int, turns: int, seed: int) -> dict[str, Path]:
    """The run's three files; returns their paths."""
    rng = random.Random(seed)
    t0 = time.time() - 3600.0
    stats, proxy, server = [], [], []
    at = t0
    for turn in range(1, turns + 1):
        for c in range(conversations):
            conv, rid = f"CONV_ID_{c}", f"{c:06d}-{turn:03d}-{rng.getrandbits(32):08x}"
            latency = rng.uniform(0.2, 2.0)
            stats.append({
                "ttft_ms": rng.uniform(10, 300), "tpot_ms": 3.0, "latency_ms": latency * 1000,
                "start_time_ms": (at - t0) * 1000, "input_num_turns": 2 * turn - 1,
                "input_num_tokens": 300 * turn, "output_num_tokens": 40,
                "output_num_chunks": 39, "output_num_first_chunk_tokens": 1,
                "approx_cached_percent": 0.0, "conversation_id": conv, "client_id": 0})
            if turn == 1:
                proxy.append(_line(_PROXY_FORMAT, at, logging.INFO, "[%s] conv=%s: cache MISS",
                                   rid, conv))
            else:
                proxy.append(_line(_PROXY_FORMAT, at, logging.INFO,
                                   "conv=%s: cache HIT (age=%.1fs)", conv, 1.5))
                proxy.append(_line(_PROXY_FORMAT, at, logging.INFO, "[%s] conv=%s: sending D's "
                                   "cached blocks to P (remote_request_id=%s)", rid, conv,
                                   f"chatcmpl-{c}-{turn - 1}"))
            proxy.append(_line(_PROXY_FORMAT, at + 0.03, logging.INFO,
                               "[%s] Prefill done in %.0fms", rid, 30.0))
            proxy.append('INFO:     127.0.0.1:40000 - "POST /v1/chat/completions HTTP/1.1" 200')
            proxy.append(_line(_PROXY_FORMAT, at + latency, logging.INFO,
                               "conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)",
                               conv, f"chatcmpl-{rid}-abcd1234", 20))
            extra = {"vllm_process_name": "EngineCore_DP0", "process": 7, "fileinfo": "f.py"}
            server.append(_line(_SERVER_FORMAT, at, logging.INFO, "Added request %s.",
                                f"chatcmpl-{rid}-abcd1234", **extra))
            if turn > 1 and rng.random() < 0.2:
                server.append(_line(_SERVER_FORMAT, at, logging.DEBUG,
                                    "Skipping remote pull for %s: %d remote tokens < threshold %d",
                                    f"chatcmpl-{rid}-abcd1234", 40, 64, **extra))
            if len(stats) % 100 == 0:
                server.append(_line(_SERVER_FORMAT, at, logging.INFO, "KV Transfer metrics: %s",
                                    "Num successful transfers=80, Avg xfer time (ms)=1.5, "
                                    "Avg MB per transfer=4.0, Num failed transfers=0, "
                                    "Num KV expired reqs=0, Num notifs after expiry=0",
                                    **extra))
            at += 0.01
    paths = {"vllm-bench-stats": folder / "stats.json", "vllm-proxy-log": folder / "proxy.log",
             "vllm-prefill-log": folder / "prefill.log"}
    with paths["vllm-bench-stats"].open("w") as handle:
        json.dump(stats, handle, indent=2)
    last_end = t0 + max(s["start_time_ms"] + s["latency_ms"] for s in stats) / 1000
    os.utime(paths["vllm-bench-stats"], (last_end, last_end))
    paths["vllm-proxy-log"].write_text("\n".join(proxy) + "\n")
    paths["vllm-prefill-log"].write_text("\n".join(server) + "\n")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from kvscope.analysis import ledger
    from kvscope.collector.ingest import KINDS, ingest
    from kvscope.store.source import open_reader

    with tempfile.TemporaryDirectory(prefix="kvscope-bench-ingest-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        paths = write_run(folder, args.conversations, args.turns, args.seed)
        print(f"files written in {time.perf_counter() - start:.1f} s "
              f"({args.conversations} conversations x {args.turns} turns)")
        for kind, path in paths.items():
            lines = path.read_bytes().count(b"\n")
            start, cpu = time.perf_counter(), time.process_time()
            parsed = KINDS[kind].read(path)
            took, cpu = time.perf_counter() - start, time.process_time() - cpu
            print(f"read {kind:17s} {path.stat().st_size / 2**20:7.1f} MiB {lines:9,d} lines "
                  f"{took:6.2f} s [{cpu:5.2f}]  {lines / took:11,.0f} lines/s  "
                  f"{parsed.records / took:9,.0f} records/s")
        db = folder / "run.duckdb"
        start, cpu = time.perf_counter(), time.process_time()
        result = ingest(db, [str(paths["vllm-bench-stats"]), str(paths["vllm-proxy-log"]),
                             f"vllm-prefill-log:{paths['vllm-prefill-log']}"])
        took, cpu = time.perf_counter() - start, time.process_time() - cpu
        spans = sum(s.spans for s in result.sources)
        turns = result.sources[0].records
        print(f"ingest (3 files, one run)  {took:6.2f} s [{cpu:5.2f}]  "
              f"{turns / took:9,.0f} turns/s  {spans:,d} spans, {result.joined:,d} turns joined")
        start, cpu = time.perf_counter(), time.process_time()
        reader = open_reader(db)
        try:
            frame = ledger.ledger(reader)
        finally:
            reader.close()
        took, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"ledger                     {took:6.2f} s [{cpu:5.2f}]  "
              f"{frame.height / took:9,.0f} turns/s  "
              f"{frame.height:,d} rows")


if __name__ == "__main__":
    main()
