"""Benchmark: what ``kvscope proxy`` and its telemetry add per turn, side by side in one run.

Four ways to serve the same turns against one fast upstream (prefill + decode stubs in their own
process, 16 output tokens, no artificial delay):

    direct      the client calls prefill, then streams from decode itself (no proxy)
    proxy-off   through the proxy with telemetry disabled (the ``ProxyTelemetry`` that
                ``--no-telemetry`` runs)
    proxy-on    through the proxy writing spans to a DuckDB file as ``kvscope proxy --db`` does:
                records go to the export process, which builds, converts and inserts the spans
    in-process  the same, but spans built and written inside the proxy's process (the
                ``ProxyTelemetry(setup_telemetry(...))`` embedding; for comparison: a process
                of its own, so its difference from proxy-off carries the process effect below)

proxy-off and proxy-on are one proxy process, switched before each round (``POST /bench/mode``, a
route only this script adds): for a proxy-on round it starts the telemetry ``kvscope proxy --db``
starts (export process, sender thread), for a proxy-off round it closes it again and serves with the
``ProxyTelemetry`` that ``--no-telemetry`` runs. Two separate processes would differ on their own:
two identical telemetry proxies, side by side over 12 rounds at 64 conversations, differed by a
median -1.22 ms (interval -2.17 .. +0.07), and by -0.16 ms (-0.74 .. +0.75) with ``PYTHONHASHSEED``
fixed, so a process's own hash seed, among others, moves its p50 by about as much as telemetry does;
one process, with telemetry's whole machinery there in proxy-on rounds only, leaves telemetry the
one difference. The in-process proxy and the upstream run in their own processes. For 1, 16 and 64
concurrent conversations the modes are run in alternating rounds (so drift on a shared machine hits
all of them alike): proxy-off and proxy-on next to each other in alternating order (see
``_round_order``). Each round first runs ``--warmup`` seconds unmeasured (1.5 s): telemetry's
pipeline holds up to ~1.25 s of turns (250 ms in the proxy's queue, up to 1 s of rows in the export
process), so that in the measured seconds the export process does the work of as many turns as are
served, as under sustained load; without it a round's last second of telemetry work fell into its
catch-up, unmeasured. After its round a telemetry proxy is let catch up (its backlog at the end of a
round, printed, would otherwise run in the next mode's round). The upstream stub keeps nothing of
what it serves (``StubState(keep=False)``). The script prints turns/s and p50/p99 of TTFT (first
body byte) and of the whole turn, then the p50 that telemetry adds (on − off) and that the proxy
adds (off − direct): over all rounds pooled, and as the median of the per-round differences with a
distribution-free 95% interval; and the CPU a turn took in each process in each mode's rounds
(client, upstream, the proxy, proxy-on's export process; from ``/proc``, catch-up included), which
shows where the machine's two cores go. It also times the telemetry work a turn does on the event
loop (record → spans → queue) in-process.

Run:  .venv/bin/python tests/benchmarks/bench_proxy.py [--seconds 2] [--warmup 1.5] [--rounds 4]
      [--concurrency 1 16 64] [--gc]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "collector"))

from upstream_stub import StubState, decode_app, free_port, prefill_app  # noqa: E402

from kvscope import semconv  # noqa: E402
from kvscope.collector.otel import setup_telemetry  # noqa: E402
from kvscope.collector.proxy import (  # noqa: E402
    ProxyConfig,
    ProxyTelemetry,
    Upstream,
)
from kvscope.collector.proxy.app import Proxy, configure_serving_gc  # noqa: E402
from kvscope.collector.proxy.export_process import TurnExportProcess  # noqa: E402

OUTPUT_TOKENS = 16
MODES = ("direct", "proxy-off", "proxy-on", "in-process")


# --- server processes -----------------------------------------------------------------------------
def _serve_upstream(p_port: int, d_port: int) -> None:
    async def main() -> None:
        runners = []
        for app, port in ((prefill_app(StubState(tokens=OUTPUT_TOKENS, keep=False)), p_port),
                          (decode_app(StubState(tokens=OUTPUT_TOKENS, keep=False)), d_port)):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
            runners.append(runner)
        await asyncio.Event().wait()

    asyncio.run(main())


# In a proxy process: the mode the current round measures (set by the benchmark's /bench/mode).
_MODE = ["?"]


def _record_gc(path: str) -> None:
    """Count this process's garbage collections and their seconds, per mode measured and per
    generation, into the JSON file ``path`` (rewritten every 0.25 s) for ``--gc``."""
    counts: dict[str, list[list[float]]] = {}
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            per_mode = counts.setdefault(_MODE[0], [[0, 0.0] for _ in range(3)])
            count = per_mode[info["generation"]]
            count[0] += 1
            count[1] += time.perf_counter() - started[0]

    def dump() -> None:
        while True:
            time.sleep(0.25)
            Path(path + ".tmp").write_text(json.dumps(counts))
            os.replace(path + ".tmp", path)

    gc.callbacks.append(callback)
    threading.Thread(target=dump, daemon=True).start()


def _gc_counts(path: Path, mode: str) -> list[list[float]]:
    time.sleep(0.6)  # a fresh dump
    counts: dict[str, list[list[float]]] = json.loads(path.read_text())
    return counts.get(mode, [[0, 0.0] for _ in range(3)])


def _serve_proxy(port: int, p_port: int, d_port: int, db: str, process: bool,
                 gc_log: str | None = None) -> None:
    """A proxy as ``kvscope proxy --db`` runs it (``process``), serving the modes proxy-on and
    proxy-off: before each round the benchmark switches it (``POST /bench/mode``), starting the
    telemetry ``kvscope proxy --db`` starts (its export process and sender thread) for a
    proxy-on round and closing it again for proxy-off, which then serves with the
    ``ProxyTelemetry`` that ``--no-telemetry`` runs (see the module docstring); or the
    in-process embedding, serving the mode in-process."""
    if gc_log is not None:
        _record_gc(gc_log)
    config = ProxyConfig([Upstream("127.0.0.1", p_port)], [Upstream("127.0.0.1", d_port)])
    ttl = config.router_ttl_s
    if not process:
        _MODE[0] = "in-process"
        proxy = Proxy(config, ProxyTelemetry(setup_telemetry(semconv.SERVICE_PROXY, db=db),
                                             router_ttl_s=ttl))
        app = proxy.application()
    else:
        _MODE[0] = "proxy-off"
        off = ProxyTelemetry(None, router_ttl_s=ttl)
        proxy = Proxy(config, off)
        app = proxy.application()

        async def switch(request: web.Request) -> web.Response:
            """Serve the mode named in the body; answer the export process's pid (proxy-on)
            and the counts of the telemetry just closed (proxy-off). Blocks the loop: no round
            runs meanwhile."""
            mode = await request.text()
            answer: dict[str, Any] = {}
            if mode == "proxy-on" and proxy.telemetry is off:
                proxy.telemetry = ProxyTelemetry(None, router_ttl_s=ttl, export_process=(
                    TurnExportProcess(semconv.SERVICE_PROXY, db=db, router_ttl_s=ttl)))
            elif mode == "proxy-off" and proxy.telemetry is not off:
                closing, proxy.telemetry = proxy.telemetry, off
                closing.shutdown()  # flushes and stops the export process and sender thread
                answer["closed"] = closing.telemetry_counts()
            export = proxy.telemetry.export_process
            answer["export_pid"] = export._process.pid if export is not None else None
            _MODE[0] = mode
            return web.json_response(answer)

        app.router.add_post("/bench/mode", switch)
    app.on_startup.append(configure_serving_gc)  # as kvscope proxy does
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=1024)


# --- client ---------------------------------------------------------------------------------------
@dataclass
class Sample:
    ttft_s: list[float] = field(default_factory=list)
    turn_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    served: int = 0  # turns served, the warm-up's included

    def extend(self, other: Sample) -> None:
        self.ttft_s += other.ttft_s
        self.turn_s += other.turn_s
        self.wall_s += other.wall_s
        self.served += other.served


async def _timed_stream(resp: aiohttp.ClientResponse, t0: float) -> float:
    first: float | None = None
    async for chunk in resp.content.iter_any():
        if first is None and chunk:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


async def _turn(session: aiohttp.ClientSession, mode: str, urls: dict[str, str],
                conversation: str, messages: list[dict[str, str]], sample: Sample | None
                ) -> None:
    body: dict[str, Any] = {"model": "m", "messages": messages, "stream": True,
                            "max_tokens": OUTPUT_TOKENS}
    t0 = time.perf_counter()
    if mode == "direct":
        prefill_body = dict(body, stream=False, max_tokens=1)
        async with session.post(urls["prefill"] + "/v1/chat/completions",
                                data=json.dumps(prefill_body)) as resp:
            answer = await resp.json()
        decode_body = dict(body, kv_transfer_params=answer["kv_transfer_params"])
        async with session.post(urls["decode"] + "/v1/chat/completions",
                                data=json.dumps(decode_body)) as resp:
            ttft = await _timed_stream(resp, t0)
    else:
        async with session.post(urls[mode] + "/v1/chat/completions",
                                data=json.dumps(dict(body, conversation_id=conversation))) as resp:
            assert resp.status == 200
            ttft = await _timed_stream(resp, t0)
    if sample is not None:  # None: a warm-up turn
        sample.ttft_s.append(ttft)
        sample.turn_s.append(time.perf_counter() - t0)


async def _conversation(session: aiohttp.ClientSession, mode: str, urls: dict[str, str],
                        n: int, measure_from: float, deadline: float, sample: Sample) -> None:
    messages = [{"role": "user", "content": f"conversation {n} starts with a task"}]
    turn = 0
    while (now := time.perf_counter()) < deadline:
        await _turn(session, mode, urls, f"bench-{n}", messages,
                    sample if now >= measure_from else None)
        sample.served += 1
        turn += 1
        # Keep prompts short and bounded: the upstream is meant to be fast.
        messages = messages[:1] + [{"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": f"tool result {turn}"}]


async def _measure(mode: str, urls: dict[str, str], concurrency: int, seconds: float,
                   warmup_s: float = 0.0) -> Sample:
    """Run ``concurrency`` conversations for ``warmup_s`` unmeasured, then measure the turns
    that start in the next ``seconds``."""
    sample = Sample()
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        measure_from = time.perf_counter() + warmup_s
        deadline = measure_from + seconds
        await asyncio.gather(*(_conversation(session, mode, urls, n, measure_from, deadline,
                                             sample)
                               for n in range(concurrency)))
        sample.wall_s = time.perf_counter() - measure_from
    return sample


async def _wait_ready(urls: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        for name in ("proxy-off", "proxy-on", "in-process"):
            for _ in range(200):
                try:
                    async with session.get(urls[name] + "/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)


async def _switch(urls: dict[str, str], mode: str) -> dict[str, Any]:
    """Make the proxy serving ``mode`` serve it (proxy-on and proxy-off share one process); its
    answer (see ``_serve_proxy``)."""
    if mode in ("direct", "in-process"):
        return {}
    async with aiohttp.ClientSession() as session, \
            session.post(urls[mode] + "/bench/mode", data=mode) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def _health(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
        return dict(await resp.json())


SETTLE_TIMEOUT_S = 15.0


async def _settle(url: str) -> tuple[int, float]:
    """Wait until the telemetry proxy at ``url`` has stored every span of the turns it served:
    nothing queued in the proxy, every span built also exported, and the count unchanged over
    0.3 s (a batch still in the pipe would change it). Spans built meanwhile, and seconds."""
    start = time.perf_counter()
    first = last = None
    async with aiohttp.ClientSession() as session:
        while time.perf_counter() - start < SETTLE_TIMEOUT_S:
            async with session.get(url + "/health") as resp:
                counts = (await resp.json())["telemetry"]
            built = counts["queued_spans"]
            first = built if first is None else first
            if (counts.get("pending_turns", 0) == 0 and built == counts["exported_spans"]
                    and built == last):
                break
            last = built
            await asyncio.sleep(0.3)
    return (last or 0) - (first or 0), time.perf_counter() - start


def _median_interval(values: list[float]) -> tuple[float, float, float]:
    """Median of ``values`` and a distribution-free ~95% interval for it (order statistics of
    the binomial(n, 1/2); the whole range when n < 6)."""
    ordered = sorted(values)
    n = len(ordered)
    k = 0  # largest k with P(Binomial(n, 1/2) < k) <= 2.5%
    while k < n and sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n <= 0.025:
        k += 1
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    return median, ordered[k - 1 if k else 0], ordered[n - k if k else n - 1]


# --- in-process CPU cost of a turn's telemetry -------------------------------------------------
def telemetry_cost_us(db: str, process: bool, turns: int = 5000
                      ) -> tuple[float, float, float]:
    """CPU µs per turn: on the calling (event-loop) thread, and in the whole proxy process.

    The first is begin_turn + record fill + finish_turn (with the export process, the record
    packed there); the second adds the proxy process's other threads, measured after a flush:
    in-process, the exporter thread's conversion to rows and the DuckDB insert; with the export
    process, only the sender thread (packed records → one batch → pipe). The third is the
    export process's own CPU, 0 in-process.
    """
    from kvscope.collector.proxy.conversation import ConversationId

    if process:
        telemetry = ProxyTelemetry(None, export_process=TurnExportProcess(
            semconv.SERVICE_PROXY, db=db, router_ttl_s=450.0))
    else:
        telemetry = ProxyTelemetry(setup_telemetry(semconv.SERVICE_PROXY, db=db),
                                   router_ttl_s=450.0)
    loop_cpu = 0.0
    process_start = time.process_time()
    for i in range(turns):
        t0 = time.thread_time()
        record = telemetry.begin_turn("/v1/chat/completions", f"req-{i}", None, None)
        telemetry.conversation_started(record, ConversationId(f"c{i % 64}", "body"))
        now = record.arrival_ns
        record.lookup = semconv.ROUTER_HIT
        record.prefill_start_ns, record.prefill_end_ns = now + 10, now + 20
        record.decode_start_ns, record.first_token_ns = now + 21, now + 22
        record.decode_end_ns = record.end_ns = now + 30
        record.prompt_tokens, record.chunks = 100, 17
        record.boundary_hashes = ",".join(f"{n:016x}" for n in range(6))
        telemetry.finish_turn(record)
        loop_cpu += time.thread_time() - t0
    assert telemetry.flush(60)
    process_cpu = time.process_time() - process_start
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    telemetry.shutdown()  # joins the export process: its CPU is now in RUSAGE_CHILDREN
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    child_cpu = (children.ru_utime + children.ru_stime
                 - children_before.ru_utime - children_before.ru_stime)
    return loop_cpu / turns * 1e6, process_cpu / turns * 1e6, child_cpu / turns * 1e6


def _round_order(r: int) -> tuple[str, ...]:
    """The modes of round ``r``: proxy-off and proxy-on last and next to each other (their
    per-round difference is the estimate; adjacent rounds share more of the machine's drift),
    in alternating order, as are direct and in-process before them. Over four rounds every
    combination runs once."""
    others = ("direct", "in-process") if r % 2 == 0 else ("in-process", "direct")
    pair = ("proxy-off", "proxy-on") if r // 2 % 2 == 0 else ("proxy-on", "proxy-off")
    return others + pair


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (Linux ``/proc``; None when
    it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# Whose CPU each mode's rounds are charged with (besides the client, this process).
_CPU_OF = {"direct": ("upstream",), "proxy-off": ("upstream", "proxy"),
           "proxy-on": ("upstream", "proxy", "export child"),
           "in-process": ("upstream", "in-process")}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one round")
    parser.add_argument("--warmup", type=float, default=1.5,
                        help="seconds each round first runs unmeasured: long enough for the "
                        "telemetry pipeline (250 ms in the proxy's queue, up to 1 s of rows in "
                        "the export process) to be doing its steady-state work when measured")
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternating rounds per mode (a multiple of 4 balances the order)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--gc", action="store_true",
                        help="also count each proxy process's garbage collections while measured")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    p_port, d_port, proxy_port, inproc_port = (free_port() for _ in range(4))
    ctx = mp.get_context("spawn")
    # One file per proxy process; proxy-on and proxy-off are counted apart in theirs.
    gc_files = {"proxy": tmp / "gc-proxy.json", "in-process": tmp / "gc-in-process.json"}
    gc_of = {"proxy-off": "proxy", "proxy-on": "proxy", "in-process": "in-process"}

    def gc_log(process: str) -> str | None:
        return str(gc_files[process]) if args.gc else None

    procs = [
        ctx.Process(target=_serve_upstream, args=(p_port, d_port), daemon=True),
        # Not a daemon: it starts its own export process.
        ctx.Process(target=_serve_proxy, args=(proxy_port, p_port, d_port,
                                               str(tmp / "on.duckdb"), True, gc_log("proxy"))),
        ctx.Process(target=_serve_proxy,
                    args=(inproc_port, p_port, d_port, str(tmp / "inproc-on.duckdb"), False,
                          gc_log("in-process")),
                    daemon=True),
    ]
    for proc in procs:
        proc.start()
    urls = {"prefill": f"http://127.0.0.1:{p_port}", "decode": f"http://127.0.0.1:{d_port}",
            "proxy-off": f"http://127.0.0.1:{proxy_port}",
            "proxy-on": f"http://127.0.0.1:{proxy_port}",
            "in-process": f"http://127.0.0.1:{inproc_port}"}
    try:
        asyncio.run(_wait_ready(urls))
        for mode in MODES:  # warm up connections and imports
            asyncio.run(_switch(urls, mode))
            asyncio.run(_measure(mode, urls, 4, 0.5))
        asyncio.run(_switch(urls, "proxy-off"))  # the warm-up's telemetry closed, uncounted
        gc_before = ({mode: _gc_counts(gc_files[gc_of[mode]], mode) for mode in gc_of}
                     if args.gc else {})
        served = dict.fromkeys(MODES, 0)
        print(f"kvscope proxy benchmark: {OUTPUT_TOKENS} output tokens/turn, fast local upstream, "
              f"{args.rounds} alternating rounds x {args.seconds:g}s (after {args.warmup:g}s "
              f"unmeasured) per mode and level")
        header = (f"{'conc':>4} {'mode':<10} {'turns/s':>8} {'ttft p50':>9} {'ttft p99':>9} "
                  f"{'turn p50':>9} {'turn p99':>9}   (ms)")
        print(header)
        pids: dict[str, int | None] = {
            "client": os.getpid(), "upstream": procs[0].pid, "proxy": procs[1].pid,
            "in-process": procs[2].pid, "export child": None}
        # The proxy-on telemetry's counters, summed over its rounds (each round has its own).
        closed: dict[str, int] = {"queued_spans": 0, "exported_spans": 0, "dropped_spans": 0}

        def switch(mode: str) -> None:
            answer = asyncio.run(_switch(urls, mode))
            for key, value in answer.get("closed", {}).items():
                if key in closed:
                    closed[key] += value
            pids["export child"] = answer.get("export_pid")

        for concurrency in args.concurrency:
            results = {mode: Sample() for mode in MODES}
            # CPU seconds each process used in each mode's rounds (and its catch-up after).
            cpu: dict[str, dict[str, float | None]] = {mode: {} for mode in MODES}
            # Per round, each telemetry mode's p50 turn minus proxy-off's p50 turn in the same
            # round: drift between rounds cancels in these paired differences.
            paired: dict[str, list[float]] = {"proxy-on": [], "in-process": []}
            # Spans a telemetry proxy built after its round ended, and seconds to catch up.
            backlog: dict[str, list[tuple[int, float]]] = {"proxy-on": [], "in-process": []}
            for r in range(args.rounds):
                round_p50 = {}
                for mode in _round_order(r):
                    switch(mode)
                    before = {name: _cpu_seconds(pid) for name, pid in pids.items() if pid}
                    sample = asyncio.run(_measure(mode, urls, concurrency, args.seconds,
                                                  args.warmup))
                    round_p50[mode] = _pct(sample.turn_s, .5)
                    results[mode].extend(sample)
                    served[mode] += sample.served
                    if mode in backlog:
                        backlog[mode].append(asyncio.run(_settle(urls[mode])))
                    for name, start in before.items():
                        end = _cpu_seconds(pids[name] or 0)
                        used = cpu[mode].get(name, 0.0)
                        cpu[mode][name] = (None if start is None or end is None or used is None
                                           else used + end - start)
                for mode, diffs in paired.items():
                    diffs.append((round_p50[mode] - round_p50["proxy-off"]) * 1e3)
            print(f"{concurrency:>4} per-round p50 turn, proxy-on − proxy-off (ms): "
                  + " ".join(f"{d:+.1f}" for d in paired["proxy-on"]))
            for mode in MODES:
                s = results[mode]
                print(f"{concurrency:>4} {mode:<10} {len(s.turn_s) / s.wall_s:>8.0f} "
                      f"{_pct(s.ttft_s, .5) * 1e3:>9.2f} {_pct(s.ttft_s, .99) * 1e3:>9.2f} "
                      f"{_pct(s.turn_s, .5) * 1e3:>9.2f} {_pct(s.turn_s, .99) * 1e3:>9.2f}")
            for mode in MODES:
                turns = max(results[mode].served, 1)
                parts = [(name, cpu[mode].get(name)) for name in ("client", *_CPU_OF[mode])]
                print(f"{concurrency:>4} {mode:<10} CPU us/turn: " + ", ".join(
                    f"{name} " + ("not measured" if used is None else f"{used / turns * 1e6:.0f}")
                    for name, used in parts))
            off, direct = results["proxy-off"], results["direct"]
            for mode in ("proxy-on", "in-process"):
                on = results[mode]
                tel_turn = (_pct(on.turn_s, .5) - _pct(off.turn_s, .5)) * 1e3
                tel_ttft = (_pct(on.ttft_s, .5) - _pct(off.ttft_s, .5)) * 1e3
                thr = (len(on.turn_s) / on.wall_s) / (len(off.turn_s) / off.wall_s)
                median, low, high = _median_interval(paired[mode])
                spans = [b for b, _ in backlog[mode]]
                waits = [w for _, w in backlog[mode]]
                print(f"{concurrency:>4} telemetry ({mode}) adds p50 turn {tel_turn:+.2f} ms, "
                      f"p50 TTFT {tel_ttft:+.2f} ms, throughput on/off {thr:.2f}x; per round "
                      f"(paired with proxy-off, {len(paired[mode])} rounds) median "
                      f"{median:+.2f} ms, "
                      f"{'95% interval' if len(paired[mode]) >= 6 else 'range'} "
                      f"{low:+.2f} .. {high:+.2f} ms; "
                      f"after its rounds it built {min(spans)}..{max(spans)} more spans and "
                      f"caught up in {min(waits):.1f}..{max(waits):.1f} s")
            proxy_turn = (_pct(off.turn_s, .5) - _pct(direct.turn_s, .5)) * 1e3
            print(f"{concurrency:>4} proxy (off) adds p50 turn {proxy_turn:+.2f} ms vs direct")
        switch("proxy-off")  # closes the last proxy-on telemetry: its counts join the sums
        print(f"proxy-on telemetry over its rounds: {closed['queued_spans']} spans built, "
              f"{closed['exported_spans']} stored, {closed['dropped_spans']} dropped")
        health = asyncio.run(_health(urls["in-process"]))
        print(f"in-process telemetry counters at the end: {health['telemetry']}")
        for mode in gc_of if args.gc else ():
            after = _gc_counts(gc_files[gc_of[mode]], mode)
            n = [after[g][0] - gc_before[mode][g][0] for g in range(3)]
            seconds = sum(after[g][1] - gc_before[mode][g][1] for g in range(3))
            print(f"garbage collection in the proxy while {mode} was measured: {seconds:.3f} s "
                  f"({n[0]:.0f} young, {n[1]:.0f} middle, {n[2]:.0f} full) over {served[mode]} "
                  f"turns: {seconds / max(served[mode], 1) * 1e6:.1f} us/turn")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(5)
    loop_us, process_us, child_us = telemetry_cost_us(str(tmp / "cost-process.duckdb"), True)
    # The export process's start-up and shutdown alone (no turn), taken off its per-turn CPU.
    _, _, idle_us = telemetry_cost_us(str(tmp / "cost-idle.duckdb"), True, turns=1)
    child_us -= idle_us / 5000
    print(f"telemetry CPU per turn in the proxy's process, export process, mean of 5000 turns: "
          f"{loop_us:.1f} us on the event loop thread (record -> packed -> queue); "
          f"{process_us:.1f} us "
          f"in the whole process (+ sender thread: batch -> pipe); {child_us:.1f} us in "
          f"the export process (spans -> rows -> DuckDB, start-up taken off)")
    loop_us, process_us, _ = telemetry_cost_us(str(tmp / "cost-inproc.duckdb"), False)
    print(f"telemetry CPU per turn in the proxy's process, in-process, mean of 5000 turns: "
          f"{loop_us:.1f} us on the event loop thread (record -> 4 spans -> queue); "
          f"{process_us:.1f} us in the whole process (+ exporter thread: rows, Arrow, DuckDB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
