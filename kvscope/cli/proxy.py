"""``kvscope proxy``: vLLM's ``disagg_proxy_multiturn.py`` flags plus kvscope's, and the serving
process (the proxy itself is :mod:`kvscope.collector.proxy`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from kvscope import semconv, settings
from kvscope.cli import deployment
from kvscope.cli.options import setting_help
from kvscope.errors import SettingError
from kvscope.reuse.params import DECODE_PARAMS_AUTO, DECODE_PARAMS_MODES

if TYPE_CHECKING:
    from kvscope.collector.proxy.app import ProxyConfig
    from kvscope.collector.proxy.telemetry import ProxyTelemetry

__all__ = ["config_from_args", "configure", "run_proxy", "telemetry_from_args"]

# The proxy's own logger (kvscope.collector.proxy.app's, which imports aiohttp: the options
# above are listed on an install without it, the command then names the extra it needs).
logger = logging.getLogger("kvscope.collector.proxy.app")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add vLLM's proxy flags plus kvscope's (router TTL, telemetry destination, timeouts)."""
    vllm = parser.add_argument_group("vLLM disagg_proxy_multiturn.py flags")
    vllm.add_argument("--host", default=None, help=setting_help("host"))
    vllm.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    vllm.add_argument("--prefiller-host", "--prefiller-hosts", dest="prefiller_hosts", nargs="+",
                      default=["localhost"], help="prefill server host(s)")
    vllm.add_argument("--prefiller-port", "--prefiller-ports", dest="prefiller_ports", type=int,
                      nargs="+", default=[8100], help="prefill server port(s), one per host")
    vllm.add_argument("--decoder-host", "--decoder-hosts", dest="decoder_hosts", nargs="+",
                      default=["localhost"], help="decode server host(s)")
    vllm.add_argument("--decoder-port", "--decoder-ports", dest="decoder_ports", type=int,
                      nargs="+", default=[8200], help="decode server port(s), one per host")
    own = parser.add_argument_group(
        "kvscope", "(--decoder-kv-blocks-ttl is decode's: the proxy only checks --router-ttl "
        "against it)")
    deployment.add(own, "router_ttl")
    deployment.add(own, "decoder_kv_blocks_ttl")
    own.add_argument("--db", default=None, help=setting_help("db"))
    own.add_argument("--otlp-endpoint", dest="otlp_endpoint", default=None,
                     help=setting_help("otlp_endpoint"))
    own.add_argument("--service-name", dest="service_name", default=None,
                     help=f"{setting_help('service_name')}; {semconv.SERVICE_PROXY!r} when empty")
    own.add_argument("--boundary-hash-key-file", dest="boundary_hash_key_file", default=None,
                     help=setting_help("boundary_hash_key_file"))
    deployment.add(own, "reuse_guard")
    own.add_argument("--decode-params", dest="decode_params", choices=DECODE_PARAMS_MODES,
                     default=DECODE_PARAMS_AUTO,
                     help="where decode's kv_transfer_params are read: 'stream' (vLLM >= 0.33 "
                     "puts them on its stream, as vLLM's proxy expects), 'response' (older vLLM "
                     "returns them only in a non-streaming response: decode is called "
                     "non-streaming and a streaming client gets the answer as one SSE event, "
                     "with no TTFT measured), or 'auto' (each decode instance's GET /version "
                     "decides, asked once; the default)")
    own.add_argument("--no-log-turns", dest="log_turns", action="store_false",
                     help="do not log each turn's cache HIT / MISS and prefill time (logged by "
                     "default, in vLLM's proxy's words)")
    own.add_argument("--no-telemetry", action="store_true",
                     help="serve without spans (Prometheus /metrics stays on)")
    own.add_argument("--connect-timeout", type=float, default=10.0,
                     help="seconds to connect to an upstream server (10)")
    own.add_argument("--prefill-timeout", type=float, default=600.0,
                     help="seconds a whole prefill call may take before 504 (600)")
    own.add_argument("--decode-idle-timeout", type=float, default=600.0,
                     help="seconds decode's stream may stay silent before the turn fails (600)")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """A :class:`ProxyConfig` from parsed flags; SettingError for mismatched lists or values."""
    from kvscope.collector.proxy.app import ProxyConfig, Upstream, api_key_from_env

    if len(args.prefiller_hosts) != len(args.prefiller_ports):
        raise SettingError("--prefiller-host and --prefiller-port need the same number of values")
    if len(args.decoder_hosts) != len(args.decoder_ports):
        raise SettingError("--decoder-host and --decoder-port need the same number of values")
    for flag in ("connect_timeout", "prefill_timeout", "decode_idle_timeout"):
        if getattr(args, flag) <= 0:
            raise SettingError(f"--{flag.replace('_', '-')} must be > 0")
    router_ttl = settings.resolve("router_ttl", args.router_ttl)
    decoder_ttl = settings.resolve("decoder_kv_blocks_ttl", args.decoder_kv_blocks_ttl)
    if router_ttl >= decoder_ttl:
        logger.warning(
            "--router-ttl %.0fs is not below decode's decoder_kv_blocks_ttl %.0fs: the proxy will "
            "offer blocks decode has already released (late turns fail or recompute)",
            router_ttl, decoder_ttl,
        )
    return ProxyConfig(
        prefillers=[Upstream(h, p) for h, p in zip(args.prefiller_hosts, args.prefiller_ports,
                                                    strict=True)],
        decoders=[Upstream(h, p) for h, p in zip(args.decoder_hosts, args.decoder_ports,
                                                  strict=True)],
        router_ttl_s=router_ttl,
        api_key=api_key_from_env(),
        connect_timeout_s=args.connect_timeout,
        prefill_timeout_s=args.prefill_timeout,
        decode_idle_timeout_s=args.decode_idle_timeout,
        reuse_guard=bool(getattr(args, "reuse_guard", False)),
        log_turns=bool(getattr(args, "log_turns", True)),
        decode_params=getattr(args, "decode_params", DECODE_PARAMS_AUTO),
    )


def telemetry_from_args(args: argparse.Namespace, router_ttl_s: float) -> ProxyTelemetry:
    """Span telemetry to ``--db`` or ``--otlp-endpoint`` (or none, with a warning)."""
    from kvscope.boundary_key import resolve_boundary_key
    from kvscope.collector.proxy.export_process import TurnExportProcess
    from kvscope.collector.proxy.telemetry import ProxyTelemetry

    if args.no_telemetry:
        return ProxyTelemetry(None, router_ttl_s=router_ttl_s)
    db = settings.resolve("db", args.db) or None
    endpoint = settings.resolve("otlp_endpoint", args.otlp_endpoint) or None
    if db is None and endpoint is None:
        logger.warning("no --db or --otlp-endpoint given: serving without spans")
        return ProxyTelemetry(None, router_ttl_s=router_ttl_s)
    service = settings.resolve("service_name", args.service_name) or semconv.SERVICE_PROXY
    # Spans are built and written in a child process: none of that work shares the GIL with
    # the event loop (see export_process).
    # The same key after a restart, so that the ledger can compare turns across it.
    key = resolve_boundary_key(getattr(args, "boundary_hash_key_file", None))
    process = TurnExportProcess(service, db=db, otlp_endpoint=endpoint, router_ttl_s=router_ttl_s,
                                boundary_key=key)
    return ProxyTelemetry(None, router_ttl_s=router_ttl_s, export_process=process)


def run_proxy(args: argparse.Namespace) -> int:
    """Run the proxy until interrupted; flush telemetry on the way out. Returns the exit code."""
    from aiohttp import web

    from kvscope.collector.proxy.app import (
        SERVER_OPTIONS,
        build_app,
        configure_serving_gc,
        turn_log,
    )

    config = config_from_args(args)
    telemetry = telemetry_from_args(args, config.router_ttl_s)
    app = build_app(config, telemetry)

    async def _close_telemetry(app: web.Application) -> None:
        if telemetry.enabled:
            # Flushing waits on the export process; keep the loop free while it does.
            await asyncio.get_running_loop().run_in_executor(None, telemetry.shutdown)

    async def _stopping(app: web.Application) -> None:
        # aiohttp runs this as the stop begins, before it waits for the turns in flight.
        telemetry.stopping()

    app.on_startup.append(configure_serving_gc)
    app.on_shutdown.append(_stopping)
    app.on_cleanup.append(_close_telemetry)
    if config.log_turns and not turn_log.isEnabledFor(logging.INFO):
        # Shown like vLLM's proxy, whatever kvscope's own log level (~56 us of CPU a turn for
        # its four lines; --no-log-turns removes them).
        turn_log.setLevel(logging.INFO)
    host = settings.resolve("host", args.host)
    loopback = host in ("127.0.0.1", "localhost", "::1")
    ready = turn_log if turn_log.isEnabledFor(logging.INFO) else logger

    def _listening(_aiohttp_banner: str) -> None:
        # aiohttp calls this once every socket listens: the line means "send turns now".
        ready.log(
            logging.INFO if ready is turn_log else logging.WARNING,
            "kvscope proxy on http://%s:%d%s: %d prefill, %d decode instances", host, args.port,
            " (loopback only, kvscope's default; --host 0.0.0.0 listens on every address, as "
            "vLLM's proxy does)" if loopback else "", len(config.prefillers),
            len(config.decoders))

    web.run_app(app, host=host, port=args.port, print=_listening, access_log=None,
                **SERVER_OPTIONS)
    return 0
