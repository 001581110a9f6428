"""Commands that collect: ``proxy``, ``gpu-sampler`` and ``ingest`` (files a run left behind)."""

from __future__ import annotations

import argparse

from kvscope import settings
from kvscope.cli.options import Command, add_setting, required, resolved
from kvscope.serving import stop_signals

__all__ = ["COMMANDS"]


def _configure_proxy(parser: argparse.ArgumentParser) -> None:
    from kvscope.cli.proxy import configure

    configure(parser)


def _run_proxy(args: argparse.Namespace) -> int:
    from kvscope.cli.proxy import run_proxy

    return run_proxy(args)


def _configure_gpu_sampler(parser: argparse.ArgumentParser) -> None:
    for name in ("db", "otlp_endpoint", "gpu_sample_interval_s"):
        add_setting(parser, name)
    parser.add_argument("--duration-s", type=float, default=None,
                        help="stop after this many seconds (default: until interrupted)")


def _run_gpu_sampler(args: argparse.Namespace) -> int:
    """Sample until SIGINT/SIGTERM (or ``--duration-s``); exit 0 when there is no GPU."""
    from kvscope.collector.gpu import run_sampler

    with stop_signals() as wait_for_stop:
        why = run_sampler(
            db=resolved(args, "db") or None,
            otlp_endpoint=resolved(args, "otlp_endpoint") or None,
            interval_s=float(settings.resolve("gpu_sample_interval_s",
                                              args.gpu_sample_interval_s)),
            wait=lambda: wait_for_stop(args.duration_s),
        )
    if why is not None:
        print(f"kvscope gpu-sampler: {why}; nothing to sample")
    return 0


def _configure_ingest(parser: argparse.ArgumentParser) -> None:
    from kvscope.collector.ingest import KINDS

    add_setting(parser, "db")
    add_setting(parser, "run_label")
    parser.add_argument("--kind", choices=sorted(KINDS), default=None,
                        help="kind of every source (default: detected from each file: "
                        + "; ".join(f"{k.name}: {k.description}" for k in KINDS.values()) + ")")
    parser.add_argument("--run", default=None, metavar="RUN",
                        help="add the files to this run of the store (id or label) instead of "
                        "beginning one: e.g. vLLM's /metrics snapshots of a deployment kvscope "
                        "watched live, for the reconciliation analysis")
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="files the run left (ingested together as one run); "
                        "KIND:FILE names one file's kind (e.g. vllm-prefill-log:prefill.log)")


def _run_ingest(args: argparse.Namespace) -> int:
    from kvscope.collector.ingest import ingest

    db = required(args, "db")
    result = ingest(db, args.sources, resolved(args, "run_label") or None, args.kind, args.run)
    for source in result.sources:
        unknown = (f", {source.unknown_lines} lines of no known pattern (counted)"
                   if source.unknown_lines else "")
        print(f"{source.path}: {source.kind}, {source.records} records, {source.spans} spans"
              + unknown)
    if result.joined:
        print(f"{result.joined} client turns joined to the proxy's record of them")
    print(f"run {result.run_id} ({result.label!r}) written to {db}")
    return 0


COMMANDS = [
    Command("proxy", "run the instrumented drop-in for vLLM's multi-turn P/D proxy",
            _configure_proxy, _run_proxy),
    Command("gpu-sampler", "sample GPU memory with NVML as kvscope gauges",
            _configure_gpu_sampler, _run_gpu_sampler),
    Command("ingest", "store a run's own files (vLLM benchmark stats, proxy log, server logs, "
            "/metrics snapshots) "
            "as a kvscope run",
            _configure_ingest, _run_ingest),
]
