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

import asyncio
import logging
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
from kvscope.emulator.ground_truth import Route, TruthRecorder
from kvscope.emulator.servers import (
    DecodeServer,
    Emulation,
    EmulatorConfig,
    PrefillServer,
)
from kvscope.errors import SettingError
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
        decode_params: str = "auto",
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
        self._decode_params = decode_params
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
        from kvscope.collector.proxy.telemetry import ProxyTelemetry, TurnRecord
        from kvscope.reuse.router import Lookup

        def upstream(url: str) -> Upstream:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            return Upstream(host, int(port))

        config = ProxyConfig(
            prefillers=[upstream(u) for u in self.prefill_urls],
            decoders=[upstream(u) for u in self.decode_urls],
            router_ttl_s=self.router_ttl_s,
            reuse_guard=self._reuse_guard,
            decode_params=self._decode_params,
        )
        telemetry = ProxyTelemetry(self._telemetry[2] if len(self._telemetry) > 2 else None,
                                   router_ttl_s=self.router_ttl_s)
        truth = self.emulation.truth if self.emulation is not None else None

        def routed(record: TurnRecord, entry: Lookup) -> None:
            if truth is not None:
                named = (entry.params or {}).get("remote_request_id")
                truth.routed(record.x_request_id, Route(
                    record.lookup, record.lookup_age_s, record.reuse_guard,
                    named if isinstance(named, str) else None))

        runner = web.AppRunner(build_app(config, telemetry, routed), access_log=None,
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


__all__ = ["EmulatedCluster"]
