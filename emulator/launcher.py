"""``kvscope emulate``: N prefill + M decode emulated vLLM servers in one process on 127.0.0.1.

:class:`EmulatedCluster` is the library form (tests, the demo): it starts the servers on their
own event loop in a background thread, on fixed or ephemeral ports, and gives their URLs. All
nodes share one :class:`~kvscope.emulator.servers.Emulation` (clock, side-channel fabric, truth
recorder). Telemetry goes to a DuckDB file through one in-process writer shared by the prefill
and decode services (the run and every setting, ``time_scale`` included, are recorded with
:func:`kvscope.store.begin_run`), or to a kvscope receiver over OTLP. Ground truth is written
next to the store (``<db>.truth.jsonl``) or to ``--truth PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web
from opentelemetry.metrics import CallbackOptions, Observation

from kvscope import semconv, settings
from kvscope.collector.engine_telemetry import EngineTelemetry
from kvscope.collector.otel import Telemetry, setup_telemetry
from kvscope.emulator.cost_model import PROFILES
from kvscope.emulator.faults import FAULTS, FaultMix
from kvscope.emulator.ground_truth import TruthRecorder
from kvscope.emulator.servers import (
    DEFAULT_MODEL,
    DecodeServer,
    Emulation,
    EmulatorConfig,
    PrefillServer,
)
from kvscope.errors import SettingError
from kvscope.reuse import params as reuse_params
from kvscope.store import StoreWriter, begin_run, end_run

logger = logging.getLogger(__name__)


class EmulatedCluster:
    """Prefill and decode servers on 127.0.0.1, run in a background thread (context manager)."""

    def __init__(
        self,
        config: EmulatorConfig | None = None,
        *,
        prefill: int = 1,
        decode: int = 1,
        host: str = "127.0.0.1",
        prefill_port: int = 0,
        decode_port: int = 0,
        db: str | Path | None = None,
        otlp_endpoint: str | None = None,
        writer: StoreWriter | None = None,
        truth_path: str | Path | None = None,
        run_label: str = "emulate",
        proxy: bool = False,
        router_ttl_s: float | None = None,
        reuse_guard: bool = False,
        run_settings: Mapping[str, Any] | None = None,
    ) -> None:
        if prefill < 1 or decode < 1:
            raise SettingError("kvscope emulate needs at least one prefill and one decode server")
        self.config = config or EmulatorConfig()
        self.host = host
        self._counts = (prefill, decode)
        self._ports = (prefill_port, decode_port)
        self._db = str(db) if db is not None else None
        self._otlp = otlp_endpoint
        self.writer = writer
        self._owns_writer = False
        self._truth_path = truth_path
        self.run_label = run_label
        self.run_id = uuid.uuid4().hex[:16]
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        # The kvscope proxy in front, on the same loop (tests, the demo); its router TTL is in
        # wall seconds, so it shrinks by time_scale like decode's TTL.
        self._with_proxy = proxy
        self._reuse_guard = reuse_guard
        # Recorded with the run beside the emulator's own settings (the workload, for baselines).
        self._run_settings = dict(run_settings or {})
        self.router_ttl_s = (
            router_ttl_s if router_ttl_s is not None
            else settings.resolve("router_ttl") / self.config.time_scale
        )
        self.proxy_url: str | None = None
        self.emulation: Emulation | None = None
        self._telemetry: list[Telemetry] = []
        self._engine_telemetry: list[EngineTelemetry] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    # -- set-up --------------------------------------------------------------------------------
    def _start_telemetry(self) -> None:
        if self._db is not None and self.writer is None:
            self.writer = StoreWriter.open(self._db)
            self._owns_writer = True
        if self.writer is not None:
            cursor = self.writer.connection.cursor()
            try:
                begin_run(cursor, self.run_label, {**self.config.settings(), **self._run_settings},
                          self.run_id)
            finally:
                cursor.close()
        if self.writer is None and self._otlp is None:
            return
        services = [semconv.SERVICE_PREFILL, semconv.SERVICE_DECODE]
        if self._with_proxy:
            services.append(semconv.SERVICE_PROXY)
        for service in services:
            self._telemetry.append(setup_telemetry(
                service,
                writer=self.writer,
                otlp_endpoint=None if self.writer is not None else self._otlp,
                # Over OTLP the receiver that owns the store stamps its run on every process's
                # spans: one experiment stays one run however many processes export to it.
                run_id=self.run_id if self.writer is not None else None,
            ))

    def _engine(self, index: int, engine_id: str, role: str) -> EngineTelemetry | None:
        if not self._telemetry:
            return None
        telemetry = EngineTelemetry(self._telemetry[index].tracer(), engine_id=engine_id,
                                    role=role)
        self._engine_telemetry.append(telemetry)
        return telemetry

    def _build(self) -> Emulation:
        truth_path = self._truth_path
        if truth_path is None and self._db is not None:
            truth_path = f"{self._db}.truth.jsonl"
        emulation = Emulation(
            self.config, TruthRecorder(truth_path, self.run_id, self.config.block_size)
        )
        n_prefill, n_decode = self._counts
        for i in range(n_prefill):
            emulation.add_prefill(self._engine(0, f"prefill-engine-{i:03d}",
                                               semconv.ROLE_PREFILL))
        for i in range(n_decode):
            emulation.add_decode(self._engine(1, f"decode-engine-{i:03d}",
                                              semconv.ROLE_DECODE))
        if self._telemetry:
            decoders = emulation.decode_nodes

            def observe(options: CallbackOptions) -> Iterable[Observation]:
                # Reads a value the event loop keeps current; never touches the model here.
                return [Observation(d.retained_bytes, {semconv.ENGINE_ID: d.engine_id})
                        for d in decoders]

            self._telemetry[1].meter().create_observable_gauge(
                semconv.METRIC_KV_RETAINED, callbacks=[observe], unit="By",
                description="KV bytes decode holds for later turns.",
            )
        return emulation

    # -- the server thread ---------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced to the caller of start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _site(self, server: PrefillServer | DecodeServer, port: int,
                    runners: list[web.AppRunner]) -> str:
        runner = web.AppRunner(server.application(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, self.host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        return f"http://{self.host}:{bound}"

    async def _start_proxy(self, runners: list[web.AppRunner]) -> str:
        from kvscope.collector.proxy.app import SERVER_OPTIONS, ProxyConfig, Upstream, build_app
        from kvscope.collector.proxy.telemetry import ProxyTelemetry

        def upstream(url: str) -> Upstream:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            return Upstream(host, int(port))

        config = ProxyConfig(
            prefillers=[upstream(u) for u in self.prefill_urls],
            decoders=[upstream(u) for u in self.decode_urls],
            router_ttl_s=self.router_ttl_s,
            reuse_guard=self._reuse_guard,
        )
        telemetry = ProxyTelemetry(self._telemetry[2] if len(self._telemetry) > 2 else None,
                                   router_ttl_s=self.router_ttl_s)
        runner = web.AppRunner(build_app(config, telemetry), access_log=None,
                               shutdown_timeout=1.0, **SERVER_OPTIONS)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        return f"http://{self.host}:{runner.addresses[0][1]}"

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        emulation = self._build()
        self.emulation = emulation
        runners: list[web.AppRunner] = []
        reaper = asyncio.create_task(emulation.reaper())
        try:
            base_p, base_d = self._ports
            for i, p in enumerate(emulation.prefill_nodes):
                self.prefill_urls.append(await self._site(p, base_p + i if base_p else 0,
                                                          runners))
            for i, d in enumerate(emulation.decode_nodes):
                self.decode_urls.append(await self._site(d, base_d + i if base_d else 0,
                                                         runners))
            if self._with_proxy:
                self.proxy_url = await self._start_proxy(runners)
            self._ready.set()
            await self._stop.wait()
        finally:
            reaper.cancel()
            for runner in reversed(runners):  # the proxy first, then the engines
                await runner.cleanup()
            emulation.close()

    def start(self) -> EmulatedCluster:
        """Start telemetry and the servers; return once every server listens."""
        self._start_telemetry()
        self._thread = threading.Thread(target=self._run, name="kvscope-emulate", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            self.stop()
            raise self._error
        return self

    def stop(self) -> None:
        """Stop the servers, emit open retentions, flush telemetry and end the run."""
        if self._loop is not None and self._stop is not None and self._thread is not None:
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
        for telemetry in self._engine_telemetry:
            telemetry.close()
        self._engine_telemetry.clear()
        for tel in self._telemetry:
            tel.flush()
            tel.shutdown()
        self._telemetry.clear()
        if self.writer is not None:
            self.writer.flush(30)
            cursor = self.writer.connection.cursor()
            try:
                end_run(cursor, self.run_id)
            finally:
                cursor.close()
            if self._owns_writer:
                self.writer.close()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every engine record so far is in the store (or sent)."""
        ok = all(t.flush(timeout_s) for t in self._engine_telemetry)
        for tel in self._telemetry:
            ok = tel.flush(timeout_s) and ok
        return ok

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# --- command line ---------------------------------------------------------------------------------


def _setting_help(name: str) -> str:
    setting = settings.SETTINGS[name]
    return f"{setting.help} (env {setting.env_var}; default {setting.default!r})"


def add_emulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``kvscope emulate`` options on ``parser``."""
    parser.add_argument("--prefill", type=int, default=1, help="prefill servers (1)")
    parser.add_argument("--decode", type=int, default=1, help="decode servers (1)")
    parser.add_argument("--host", default=None, help=_setting_help("host"))
    parser.add_argument("--prefill-port", type=int, default=8100,
                        help="port of the first prefill server; the next get +1 (8100; 0: any)")
    parser.add_argument("--decode-port", type=int, default=8200,
                        help="port of the first decode server; the next get +1 (8200; 0: any)")
    parser.add_argument("--served-model-name", "--model", dest="model", default=DEFAULT_MODEL,
                        help=f"model name the servers answer to ({DEFAULT_MODEL!r})")
    parser.add_argument("--profile", default="tiny", choices=sorted(PROFILES),
                        help="cost-model profile for prefill, transfer and decode times (tiny)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="model time runs this many times faster than the wall clock: "
                             "durations and TTLs shrink by it (replay with the same factor)")
    parser.add_argument("--bidirectional-kv-xfer", action=argparse.BooleanOptionalAction,
                        default=True, help="D->P readback on both P and D (on)")
    parser.add_argument("--kv-recompute-threshold", type=int, default=None,
                        help=_setting_help("kv_recompute_threshold"))
    parser.add_argument("--decoder-kv-blocks-ttl", type=float, default=None,
                        help=_setting_help("decoder_kv_blocks_ttl") + " (model seconds)")
    parser.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"),
                        default="recompute",
                        help="what P does after a failed load (vLLM's default is fail; the "
                             "emulator's recompute keeps each failure's own outcome)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True, help="the engines' scheduler (vLLM's default off CPU: "
                        "async; decode then offers prompt + output after a stop token, the "
                        "synchronous one prompt + output - 1)")
    parser.add_argument("--no-enable-prefix-caching", action="store_true",
                        help="prefix caching off on the prefill servers (as the blog's P)")
    parser.add_argument("--prefix-cache-blocks", type=int, default=1 << 20,
                        help="free cached blocks each engine's prefix cache may hold")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (16)")
    parser.add_argument("--decode-clock-offset", type=float, default=0.0,
                        help="seconds decode's perf_counter is ahead of prefill's (0)")
    parser.add_argument("--side-channel-port", type=int, default=5600,
                        help="first emulated NIXL side-channel port (5600; one per engine)")
    parser.add_argument("--max-model-len", type=int, default=1 << 20,
                        help="longest prompt + output a request may have")
    parser.add_argument("--stall-timeout", type=float, default=5.0,
                        help="wall seconds before a stalled request is answered with 500 (vLLM "
                             "would wait forever)")
    parser.add_argument("--disable-request-id-randomization", action="store_true",
                        help="as VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report usage.prompt_tokens_details.cached_tokens (as vLLM's flag)")
    parser.add_argument("--fault", action="append", default=[], metavar="NAME[=P]",
                        help="inject a fault into a share P of turns (repeatable); one of: "
                             + ", ".join(sorted(FAULTS)))
    parser.add_argument("--allow-fault-headers", action="store_true",
                        help="honour the X-Kvscope-Fault header / kvscope_fault body field")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of outputs, request-id suffixes and fault draws")
    parser.add_argument("--db", default=None, help=_setting_help("db"))
    parser.add_argument("--otlp-endpoint", dest="otlp_endpoint", default=None,
                        help=_setting_help("otlp_endpoint"))
    parser.add_argument("--truth", default=None,
                        help="ground-truth JSONL file (default: <db>.truth.jsonl with --db)")
    parser.add_argument("--run-label", default=None, help=_setting_help("run_label"))


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """An :class:`EmulatorConfig` from parsed flags; SettingError naming a bad value."""
    if args.time_scale <= 0:
        raise SettingError(f"--time-scale={args.time_scale}: must be > 0")
    if args.block_size <= 0:
        raise SettingError(f"--block-size={args.block_size}: must be > 0")
    if args.stall_timeout <= 0:
        raise SettingError(f"--stall-timeout={args.stall_timeout}: must be > 0")
    return EmulatorConfig(
        model=args.model,
        cost_profile=args.profile,
        time_scale=args.time_scale,
        bidirectional_kv_xfer=args.bidirectional_kv_xfer,
        kv_recompute_threshold=settings.resolve("kv_recompute_threshold",
                                                args.kv_recompute_threshold),
        decoder_kv_blocks_ttl=settings.resolve("decoder_kv_blocks_ttl",
                                               args.decoder_kv_blocks_ttl),
        kv_load_failure_policy=args.kv_load_failure_policy,
        block_size=args.block_size,
        prefill_prefix_caching=not args.no_enable_prefix_caching,
        scheduling=(reuse_params.SCHEDULING_ASYNC if args.async_scheduling
                    else reuse_params.SCHEDULING_SYNC),
        cache_capacity_blocks=args.prefix_cache_blocks,
        decode_clock_offset_s=args.decode_clock_offset,
        side_channel_port=args.side_channel_port,
        max_model_len=args.max_model_len,
        seed=args.seed,
        stall_timeout_s=args.stall_timeout,
        disable_request_id_randomization=args.disable_request_id_randomization,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        allow_fault_headers=args.allow_fault_headers,
        faults=FaultMix.from_args(args.fault, args.seed),
    )


def main_emulate(args: argparse.Namespace) -> int:
    """Run ``kvscope emulate`` until interrupted (SIGINT/SIGTERM). Returns the exit code."""
    config = config_from_args(args)
    db = settings.resolve("db", args.db) or None
    endpoint = settings.resolve("otlp_endpoint", args.otlp_endpoint) or None
    if db is not None and endpoint is not None:
        raise SettingError("give --db FILE or --otlp-endpoint URL, not both")
    if db is None and endpoint is None:
        logger.warning("no --db or --otlp-endpoint given: serving without spans")
    cluster = EmulatedCluster(
        config,
        prefill=args.prefill,
        decode=args.decode,
        host=settings.resolve("host", args.host),
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        db=db,
        otlp_endpoint=endpoint,
        truth_path=args.truth,
        run_label=settings.resolve("run_label", args.run_label) or "emulate",
    )
    stop = threading.Event()

    def _request_stop(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with cluster:
            print(
                f"kvscope emulate run {cluster.run_id}: prefill {' '.join(cluster.prefill_urls)}"
                f" decode {' '.join(cluster.decode_urls)}",
                flush=True,
            )
            stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
