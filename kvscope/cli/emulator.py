"""Commands of the emulator: ``emulate`` (servers), ``replay`` (a workload over HTTP),
``simulate`` (virtual time into a store) and ``demo`` (all of it, end to end: :mod:`.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvscope.cli.options import Command

__all__ = ["COMMANDS"]


def _configure_emulate(parser: argparse.ArgumentParser) -> None:
    from kvscope.emulator.launcher import add_emulate_arguments

    add_emulate_arguments(parser)


def _run_emulate(args: argparse.Namespace) -> int:
    from kvscope.emulator.launcher import main_emulate

    return main_emulate(args)


def _configure_replay(parser: argparse.ArgumentParser) -> None:
    from kvscope.emulator.replay import add_replay_arguments

    add_replay_arguments(parser)


def _run_replay(args: argparse.Namespace) -> int:
    from kvscope.emulator.replay import main_replay

    return main_replay(args)


def _configure_simulate(parser: argparse.ArgumentParser) -> None:
    from kvscope.emulator.simulate_command import add_simulate_arguments

    add_simulate_arguments(parser)


def _run_simulate(args: argparse.Namespace) -> int:
    from kvscope.simulate import main_simulate

    return main_simulate(args)


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out", help="folder for kvscope.duckdb and report.html")
    parser.add_argument("--conversations", type=int, default=10,
                        help="WEKA traces to replay (default 10)")
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
