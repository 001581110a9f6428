"""Soak: the proxy writing a store (``--db``) and the proxy exporting to ``kvscope serve``, at a
steady rate for many minutes; per interval, what each process costs as its store grows.

Processes (all on 127.0.0.1):

    upstream     prefill and decode stubs (``tests/collector/upstream_stub.py``), one process
    proxy-db     ``kvscope proxy --db A``: its export child builds the spans and inserts the rows
    proxy-otlp   ``kvscope proxy --otlp-endpoint``: its export child sends OTLP to ...
    serve        ``kvscope serve --db B`` (a subprocess: the command itself)

The two proxies are built exactly as ``kvscope proxy`` builds itself (its argument parser,
``config_from_args``, ``telemetry_from_args``, ``configure_serving_gc``, ``SERVER_OPTIONS``), in
processes of this script that add one read-only route, ``GET /soak/counts``: the export
child's counters (``TurnExportProcess.counts``: spans exported, store writes and the time waited
for them) and its pid. The client runs agent-like conversations (a system prompt, the task, then
each turn the assistant's reply and a tool result; a new conversation after ``--turns-per-
conversation``), streaming, at ``--rate`` turns a second to each proxy, paced on a fixed
schedule (a late turn does not make the next one early).

Every ``--interval`` seconds (60; ``--short``: 10) it prints one line per process: RSS, CPU
microseconds per turn served in that interval (from ``/proc``), and for the export children the
spans exported, the store's size (file + WAL) and the mean store write latency (rows converted and
inserted: the child waits for each write). ``serve``'s insert latency is not exposed by the
receiver and reads "not measured". The end prints the per-interval curve of the export
child's CPU per turn, the number the soak exists to follow (issue 22: it grew with the store).

``--seed-spans N`` first fills store A with N spans through the export child's own row path
(records as the proxy sends them), so that a shortened soak starts where a long one would be; the
seeding's own CPU is not counted.

``--write-sizes 25 125`` measures instead what one store write costs by its size (the export
child's row path, in this process, sizes in alternating rounds): the figure behind the export
child's write interval (``STORE_INTERVAL_S``).

Run:  .venv/bin/python tests/benchmarks/bench_soak.py [--minutes 30] [--rate 100] [--short]
      [--seed-spans 0] [--keep DIR]
      .venv/bin/python tests/benchmarks/bench_soak.py --write-sizes 25 125
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "collector"))

from upstream_stub import StubState, decode_app, free_port, prefill_app  # noqa: E402

from kvscope.tables import NOT_MEASURED  # noqa: E402

OUTPUT_TOKENS = 16
SYSTEM_PROMPT = "You are a careful coding agent. Follow the repository's conventions. " * 24


# --- processes ------------------------------------------------------------------------------------
def _serve_upstream(p_port: int, d_port: int) -> None:
    async def main() -> None:
        for app, port in ((prefill_app(StubState(tokens=OUTPUT_TOKENS, keep=False)), p_port),
                          (decode_app(StubState(tokens=OUTPUT_TOKENS, keep=False)), d_port)):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def _serve_proxy(argv: list[str]) -> None:
    """``kvscope proxy`` as ``kvscope.cli.proxy.run_proxy`` builds it, plus ``GET /soak/counts``."""
    from kvscope.cli.proxy import config_from_args, telemetry_from_args
    from kvscope.cli.proxy import configure as add_proxy_arguments
    from kvscope.collector.proxy.app import SERVER_OPTIONS, build_app, configure_serving_gc

    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    telemetry = telemetry_from_args(args, config.router_ttl_s)
    process = telemetry.export_process
    assert process is not None, "the soak's proxies store spans"
    app = build_app(config, telemetry)

    async def counts(request: web.Request) -> web.Response:
        return web.json_response({**process.counts(), "pid": process._process.pid})

    async def close(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, telemetry.shutdown)

    app.router.add_get("/soak/counts", counts)
    app.on_startup.append(configure_serving_gc)
    app.on_cleanup.append(close)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None,
                **SERVER_OPTIONS)


def _seed(db: str, spans: int) -> None:
    """Fill ``db`` with about ``spans`` proxy spans through the export child's row path."""
    from kvscope import semconv
    from kvscope.child import pack, unpack
    from kvscope.collector.proxy.export_process import (
        _RowExport,
        record_from_tuple,
        record_to_tuple,
        resolve_boundaries,
    )
    from kvscope.collector.proxy.telemetry import ProxyTelemetry

    maker = ProxyTelemetry(None)
    export = _RowExport(semconv.SERVICE_PROXY, db, 450.0)
    built = i = 0
    while built < spans:
        record = _served_turn(maker, f"seed-{i}", f"seed-{i % 256}", 900 + i % 512,
                              _body(i % 256, i // 256 % 20, "seed"))
        maker.finish_turn(record)
        received = record_from_tuple(unpack(pack(record_to_tuple(record))))
        resolve_boundaries(received, maker.boundary_key)
        built += export.add(received)
        i += 1
        if i % 2000 == 0:
            export.sync()
    export.shutdown()


def _records(n: int, start: int = 0) -> list[Any]:
    """``n`` finished turn records as the export child receives them (boundaries hashed)."""
    from kvscope.child import pack, unpack
    from kvscope.collector.proxy.export_process import (
        record_from_tuple,
        record_to_tuple,
        resolve_boundaries,
    )
    from kvscope.collector.proxy.telemetry import ProxyTelemetry

    maker = ProxyTelemetry(None)
    records = []
    for i in range(start, start + n):
        record = _served_turn(maker, f"w-{i}", f"w-{i % 64}", 900,
                              _body(i % 64, i // 64 % 20, "w"))
        maker.finish_turn(record)
        received = record_from_tuple(unpack(pack(record_to_tuple(record))))
        resolve_boundaries(received, maker.boundary_key)
        records.append(received)
    return records


def write_sizes(turns_per_write: list[int], writes: int, rounds: int, tmp: Path) -> None:
    """CPU a store write costs in the export child's row path, by its size, side by side.

    One fresh store per size, in one process; rounds alternate the sizes (drift on a shared
    machine hits all alike). Each round adds ``writes`` writes of that many turns' rows, each
    written and waited for as ``_RowExport`` does; the records are made before the clock starts.
    Prints the median CPU per write and per turn (building the rows included) over the rounds.
    """
    from kvscope import semconv
    from kvscope.collector.proxy.export_process import _RowExport

    exports = {n: _RowExport(semconv.SERVICE_PROXY, str(tmp / f"w{n}.duckdb"), 450.0)
               for n in turns_per_write}
    per_write: dict[int, list[float]] = {n: [] for n in turns_per_write}
    made = 0
    for r in range(rounds):
        order = turns_per_write if r % 2 == 0 else list(reversed(turns_per_write))
        for n in order:
            records = _records(n * writes, made)
            made += n * writes
            export = exports[n]
            started = time.process_time()
            for w in range(writes):
                for record in records[w * n:(w + 1) * n]:
                    export.add(record)
                export.sync()
            per_write[n].append((time.process_time() - started) / writes)
    for export in exports.values():
        export.shutdown()
    print(f"store writes by size ({writes} writes x {rounds} rounds each, medians; "
          f"CPU of this process: rows built, converted, inserted):")
    for n, values in per_write.items():
        values.sort()
        median = values[len(values) // 2]
        print(f"  {n:>5} turns a write: {median * 1e3:7.2f} ms a write, "
              f"{median / n * 1e6:7.1f} us a turn")


# --- load -----------------------------------------------------------------------------------------
def _body(conversation: int, turn: int, prefix: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"task {conversation}: make the failing test pass"},
    ]
    for k in range(turn):
        messages.append({"role": "assistant", "content": f"step {k}: ran the tests " * 6})
        messages.append({"role": "tool", "content": f"{k} passed, 1 failed " * 12})
    return {"model": "stub", "messages": messages, "stream": True, "max_tokens": OUTPUT_TOKENS,
            "conversation_id": f"{prefix}-{conversation}"}


def _served_turn(maker: Any, request_id: str, conversation: str, prompt_tokens: int,
                 body: Any) -> Any:
    """A turn record as the proxy fills it for a router HIT (2 ms prefill, first token at
    3 ms, end at 9 ms, 16 output tokens), its message boundaries hashed."""
    from kvscope import semconv
    from kvscope.collector.proxy.conversation import ConversationId

    record = maker.begin_turn("/v1/chat/completions", request_id, None, None)
    maker.conversation_started(record, ConversationId(conversation, "body"))
    now = record.arrival_ns
    record.lookup = semconv.ROUTER_HIT
    record.prefill_start_ns, record.prefill_end_ns = now + 10, now + 2_000_000
    record.decode_start_ns, record.first_token_ns = now + 2_000_010, now + 3_000_000
    record.decode_end_ns = record.end_ns = now + 9_000_000
    record.prompt_tokens, record.output_tokens, record.chunks = prompt_tokens, 16, 17
    maker.message_boundaries(record, body)
    return record


@dataclass
class Load:
    """Turns served and failed per proxy."""

    served: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)


async def _drive(session: aiohttp.ClientSession, name: str, url: str, rate: float,
                 turns_per_conversation: int, stop: asyncio.Event, load: Load) -> None:
    """Start one turn every 1/rate s on a fixed schedule; each conversation's turns in order."""
    load.served[name] = load.failed[name] = 0
    interval = 1.0 / rate
    started = time.monotonic()
    busy: set[int] = set()
    tasks: set[asyncio.Task[None]] = set()
    n = 0
    conversations = max(int(rate), 1)  # about one second between a conversation's turns

    async def turn(conversation: int, index: int) -> None:
        body = _body(conversation, index % turns_per_conversation,
                     f"{name}-{conversation}-{index // turns_per_conversation}")
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        busy.discard(conversation)
        if ok:
            load.served[name] += 1
        else:
            load.failed[name] += 1

    turns_of: dict[int, int] = {}
    while not stop.is_set():
        delay = started + n * interval - time.monotonic()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except TimeoutError:
                pass
        conversation = n % conversations
        n += 1
        if conversation in busy:  # its previous turn is still running: skip, counted as late
            continue
        busy.add(conversation)
        index = turns_of.get(conversation, 0)
        turns_of[conversation] = index + 1
        task = asyncio.create_task(turn(conversation, index))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


# --- measurement ----------------------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return float("nan")


def _store_mib(db: Path) -> float:
    size = 0
    for path in (db, db.with_name(db.name + ".wal")):
        try:
            size += path.stat().st_size
        except OSError:
            pass
    return size / 2**20


async def _counts(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/soak/counts") as resp:
        return dict(await resp.json())


async def _wait_http(session: aiohttp.ClientSession, url: str, path: str,
                     timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(url + path) as resp:
                if resp.status < 500:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up in {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


def _fmt(value: float, spec: str) -> str:
    return NOT_MEASURED if value != value else format(value, spec)  # NaN: not measured


async def _soak(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    p_port, d_port, db_port, otlp_port, serve_port, grpc_port = (free_port() for _ in range(6))
    store_a, store_b = tmp / "proxy-db.duckdb", tmp / "serve.duckdb"
    ctx = mp.get_context("spawn")
    if args.seed_spans:
        t0 = time.monotonic()
        seeder = ctx.Process(target=_seed, args=(str(store_a), args.seed_spans))
        seeder.start()
        seeder.join()
        print(f"seeded {store_a.name} with {args.seed_spans:,} spans in "
              f"{time.monotonic() - t0:.0f} s ({_store_mib(store_a):.1f} MiB)", flush=True)
    upstream = ctx.Process(target=_serve_upstream, args=(p_port, d_port), daemon=True)
    upstream.start()
    env = {**os.environ, "XDG_STATE_HOME": str(tmp / "state")}
    serve_log = (tmp / "serve.log").open("w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "serve", "--db", str(store_b), "--port",
         str(serve_port), "--grpc-port", str(grpc_port)], env=env, stdout=serve_log,
        stderr=subprocess.STDOUT)
    common = ["--prefiller-host", "127.0.0.1", "--prefiller-port", str(p_port),
              "--decoder-host", "127.0.0.1", "--decoder-port", str(d_port), "--no-log-turns"]
    os.environ["XDG_STATE_HOME"] = str(tmp / "state")  # the proxies' boundary hash key
    proxies = {
        "proxy-db": (ctx.Process(target=_serve_proxy, args=(
            ["--port", str(db_port), "--db", str(store_a), *common],)), db_port),
        "proxy-otlp": (ctx.Process(target=_serve_proxy, args=(
            ["--port", str(otlp_port), "--otlp-endpoint", f"http://127.0.0.1:{serve_port}",
             *common],)), otlp_port),
    }
    try:
        return await _measure(args, proxies, serve, store_a, store_b, serve_port)
    finally:
        for process, _ in proxies.values():
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGINT)  # kvscope proxy's orderly stop
            process.join(60)
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
        serve_log.close()
        upstream.terminate()


async def _measure(args: argparse.Namespace, proxies: dict[str, tuple[Any, int]],
                   serve: subprocess.Popen[bytes], store_a: Path, store_b: Path,
                   serve_port: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await _wait_http(session, f"http://127.0.0.1:{serve_port}", "/")
        for process, _ in proxies.values():
            process.start()
        urls = {name: f"http://127.0.0.1:{port}" for name, (_, port) in proxies.items()}
        for url in urls.values():
            await _wait_http(session, url, "/health")
        children = {name: (await _counts(session, url))["pid"] for name, url in urls.items()}
        pids = {"proxy-db": proxies["proxy-db"][0].pid, "child-db": children["proxy-db"],
                "proxy-otlp": proxies["proxy-otlp"][0].pid, "child-otlp": children["proxy-otlp"],
                "serve": serve.pid}
        load = Load()
        stop = asyncio.Event()
        drivers = [asyncio.create_task(_drive(session, name, url, args.rate,
                                              args.turns_per_conversation, stop, load))
                   for name, url in urls.items()]
        turns_of = {"proxy-db": "proxy-db", "child-db": "proxy-db", "proxy-otlp": "proxy-otlp",
                    "child-otlp": "proxy-otlp", "serve": "proxy-otlp"}
        began = time.monotonic()
        previous_cpu = {name: _cpu_s(pid) for name, pid in pids.items()}
        previous_served = {name: 0 for name in urls}
        previous_counts = {name: await _counts(session, url) for name, url in urls.items()}
        print(f"soak: {args.minutes:g} min at {args.rate:g} turns/s to each proxy, a line every "
              f"{args.interval:g} s; stores {store_a} and {store_b}", flush=True)
        print(f"{'t s':>6} {'process':<11} {'turns':>7} {'failed':>6} {'RSS MiB':>8} "
              f"{'CPU us/turn':>11} {'spans stored':>12} {'store MiB':>9} {'write ms':>8}",
              flush=True)
        while time.monotonic() - began < args.minutes * 60:
            await asyncio.sleep(min(args.interval,
                                    args.minutes * 60 - (time.monotonic() - began)))
            now = time.monotonic() - began
            counts = {name: await _counts(session, url) for name, url in urls.items()}
            served = dict(load.served)
            for name, pid in pids.items():
                cpu = _cpu_s(pid)
                proxy = turns_of[name]
                turns = served[proxy] - previous_served[proxy]
                row: dict[str, Any] = {
                    "t_s": round(now), "process": name, "turns": turns,
                    "failed": load.failed[proxy], "rss_mib": _rss_mib(pid),
                    "cpu_us_per_turn": ((cpu - previous_cpu[name]) / turns * 1e6 if turns
                                        else float("nan")),
                    "spans_stored": float("nan"), "store_mib": float("nan"),
                    "write_ms": float("nan"),
                }
                previous_cpu[name] = cpu
                if name.startswith("child-"):
                    now_c, before_c = counts[proxy], previous_counts[proxy]
                    row["spans_stored"] = now_c["exported_spans"]
                    writes = now_c["store_writes"] - before_c["store_writes"]
                    if writes:
                        row["write_ms"] = (now_c["store_write_ns"]
                                           - before_c["store_write_ns"]) / writes / 1e6
                if name == "child-db":
                    row["store_mib"] = _store_mib(store_a)
                if name == "serve":
                    row["store_mib"] = _store_mib(store_b)
                rows.append(row)
                print(f"{row['t_s']:>6} {name:<11} {turns:>7} {row['failed']:>6} "
                      f"{_fmt(row['rss_mib'], '8.0f'):>8} "
                      f"{_fmt(row['cpu_us_per_turn'], '11.1f'):>11} "
                      f"{_fmt(float(row['spans_stored']), '12,.0f'):>12} "
                      f"{_fmt(row['store_mib'], '9.1f'):>9} {_fmt(row['write_ms'], '8.1f'):>8}",
                      flush=True)
            previous_served = served
            previous_counts = counts
        stop.set()
        await asyncio.gather(*drivers)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the soak (30)")
    parser.add_argument("--rate", type=float, default=100.0,
                        help="turns a second sent to each proxy (100)")
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds between reports (60; --short: 10)")
    parser.add_argument("--short", action="store_true",
                        help="a smoke run: 1 minute, 20 turns/s, a line every 10 s")
    parser.add_argument("--turns-per-conversation", type=int, default=20)
    parser.add_argument("--seed-spans", type=int, default=0,
                        help="spans put in the proxy's store before the soak (0)")
    parser.add_argument("--write-sizes", type=int, nargs="*", default=None, metavar="TURNS",
                        help="instead of the soak: CPU per store write of that many turns each "
                        "(e.g. 25 125: one write a second, and one every 5 s, at 25 turns/s)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the stores and the per-interval rows (JSON) in this folder")
    args = parser.parse_args()
    if args.short:
        args.minutes, args.rate = min(args.minutes, 1.0), min(args.rate, 20.0)
    args.interval = args.interval or (10.0 if args.short else 60.0)
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-soak-"))
    if args.write_sizes is not None:
        try:
            write_sizes(args.write_sizes or [25, 125], writes=40, rounds=6, tmp=tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    try:
        rows = asyncio.run(_soak(args, tmp))
        curve = [r for r in rows if r["process"] == "child-db"]
        print("\nexport child (--db) CPU per turn by interval, us: "
              + " ".join(_fmt(r["cpu_us_per_turn"], ".0f") for r in curve))
        print("its store write latency by interval, ms: "
              + " ".join(_fmt(r["write_ms"], ".1f") for r in curve))
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / "soak.json").write_text(json.dumps(rows, indent=1))
            for store in tmp.glob("*.duckdb"):
                shutil.copy(store, args.keep / store.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
