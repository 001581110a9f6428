"""The ``kvscope`` command line.

Each sub-command is one small function registered in :data:`COMMANDS`; options that are settings
are built from :mod:`kvscope.settings`. Library errors (:class:`kvscope.errors.KvscopeError`)
become one-line messages here and nowhere else; exit status 2 for user mistakes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope import __version__, settings
from kvscope.errors import KvscopeError, SettingError
from kvscope.tables import format_rows

EXIT_USER_ERROR = 2


def add_setting(parser: argparse.ArgumentParser, name: str, **overrides: Any) -> None:
    """Add the option for one declared setting (flag, type and help come from settings.py)."""
    setting = settings.SETTINGS[name]
    kwargs: dict[str, Any] = {
        "dest": name,
        "default": None,
        "help": f"{setting.help} (env {setting.env_var}; default {setting.default!r})",
        "metavar": name.upper(),
    }
    if setting.type is bool:
        kwargs.pop("metavar")
        kwargs["action"] = "store_const"
        kwargs["const"] = True
    kwargs.update(overrides)
    parser.add_argument(setting.cli_flag, **kwargs)


def resolved(args: argparse.Namespace, name: str) -> Any:
    """The value of a setting option after explicit → environment → default resolution."""
    return settings.resolve(name, getattr(args, name, None))


# --- commands -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One sub-command: its name, one-line help, how it adds options and how it runs."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _configure_version(parser: argparse.ArgumentParser) -> None:
    return None


def _run_version(args: argparse.Namespace) -> int:
    from kvscope.store.schema import SCHEMA_VERSION

    print(f"kvscope {__version__} (store schema {SCHEMA_VERSION})")
    return 0


def _configure_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown", action="store_true", help="print the reference table (docs/settings.md)"
    )


def _run_settings(args: argparse.Namespace) -> int:
    if args.markdown:
        sys.stdout.write(settings.markdown_table(setting_commands()))
        return 0
    values = settings.resolve_all()
    rows = [(name, values[name], s.env_var) for name, s in settings.SETTINGS.items()]
    sys.stdout.write(format_rows(["setting", "value", "environment"], rows, "table"))
    return 0


def _configure_sql(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="kvscope DuckDB store (opened read-only)")
    parser.add_argument(
        "query", help="one SQL statement, e.g. 'SELECT count(*) FROM otel_traces'"
    )
    parser.add_argument(
        "--format", choices=["table", "csv", "json"], default="table", help="output format"
    )
    parser.add_argument(
        "--param", action="append", default=[], metavar="VALUE",
        help="bind a value to the next ? placeholder (repeatable)",
    )


def _run_sql(args: argparse.Namespace) -> int:
    from kvscope.store.reader import StoreReader

    reader = StoreReader.open(args.file)
    try:
        columns, rows = reader.rows(args.query, args.param)
    finally:
        reader.close()
    sys.stdout.write(format_rows(columns, rows, args.format))
    return 0


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    add_setting(parser, "db")
    add_setting(parser, "host")
    add_setting(parser, "port")
    add_setting(parser, "grpc_port")
    add_setting(parser, "run_label")
    parser.add_argument("--dashboard", action="store_true",
                        help="also serve the live dashboard from the same store")
    parser.add_argument("--dashboard-port", type=int, default=None,
                        help="port of the dashboard (default 8050)")


def _required(args: argparse.Namespace, name: str) -> Any:
    value = resolved(args, name)
    if value in ("", None):
        setting = settings.SETTINGS[name]
        raise SettingError(f"{setting.cli_flag} is required (or set {setting.env_var})")
    return value


def _run_serve(args: argparse.Namespace) -> int:
    db, host, port = _required(args, "db"), resolved(args, "host"), resolved(args, "port")
    grpc_port = resolved(args, "grpc_port")
    label = getattr(args, "run_label", None)
    if label:
        # The receiver records its run under the run_label setting: the flag wins over the
        # environment, as every setting's flag does.
        os.environ[settings.SETTINGS["run_label"].env_var] = str(label)
    if args.dashboard:
        from kvscope.dashboards.app import main_serve_dashboard

        return main_serve_dashboard(db, host, port, args.dashboard_port, grpc_port=grpc_port)
    from kvscope.collector.receiver import main_serve

    return main_serve(db, host, port, grpc_port)


def _configure_dashboard(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="kvscope DuckDB store (opened read-only)")
    add_setting(parser, "host")
    parser.add_argument("--port", type=int, default=None, help="dashboard port (default 8050)")


def _run_dashboard(args: argparse.Namespace) -> int:
    from kvscope.dashboards.app import main_dashboard

    return main_dashboard(args.file, resolved(args, "host"), args.port)


def _configure_proxy(parser: argparse.ArgumentParser) -> None:
    from kvscope.collector.proxy import add_proxy_arguments

    add_proxy_arguments(parser)


def _run_proxy(args: argparse.Namespace) -> int:
    from kvscope.collector.proxy import main_proxy

    return main_proxy(args)


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


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers") from None


def _runs(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _add_store_and_runs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="kvscope DuckDB store (opened read-only)")
    parser.add_argument("--run", "--runs", dest="runs", type=_runs, default=None,
                        help="run ids or labels to include, comma separated (default: all)")


def _configure_analyze(parser: argparse.ArgumentParser) -> None:
    _add_store_and_runs(parser)
    parser.add_argument("name", nargs="?", default=None,
                        help="analysis to run (omit to list them)")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table",
                        help="output format")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="an analysis parameter (repeatable)")


def _run_analyze(args: argparse.Namespace) -> int:
    from kvscope.dashboards.report import main_analyze

    params = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise SettingError(f"--param {item!r}: expected NAME=VALUE")
        params[key.strip()] = value
    return main_analyze(args.file, args.name, args.runs, args.format, params)


def _configure_ledger(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="kvscope DuckDB store (opened for writing)")


def _run_ledger(args: argparse.Namespace) -> int:
    from kvscope.analysis.ledger import LEDGER_TABLE, rebuild

    if not Path(args.file).is_file():
        # Opening for writing would create an empty store and report 0 turns.
        raise SettingError(f"{args.file}: no such kvscope store")
    rows = rebuild(args.file)
    print(f"{LEDGER_TABLE}: {rows} turns rebuilt from the raw spans in {args.file}")
    return 0


def _configure_report(parser: argparse.ArgumentParser) -> None:
    _add_store_and_runs(parser)
    parser.add_argument("-o", "--out", default="report.html", help="HTML file to write")


def _run_report(args: argparse.Namespace) -> int:
    from kvscope.dashboards.report import main_report

    return main_report(args.file, args.out, args.runs)


def _configure_compare(parser: argparse.ArgumentParser) -> None:
    _add_store_and_runs(parser)
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table",
                        help="output format")


def _run_compare(args: argparse.Namespace) -> int:
    from kvscope.analysis.compare import main_compare

    return main_compare(args.file, args.runs, args.format)


def _configure_whatif(parser: argparse.ArgumentParser) -> None:
    _add_store_and_runs(parser)
    parser.add_argument("--ttl", type=_floats, default=None,
                        help="decoder_kv_blocks_ttl values in seconds (default 60,120,480,900)")
    parser.add_argument("--threshold", type=_ints, default=None,
                        help="kv_recompute_threshold values in tokens (default 0,64,256)")
    parser.add_argument("--router-ttl", type=_floats, default=None,
                        help="proxy router TTLs in seconds (default: the observed one)")
    parser.add_argument("--budget-gib-s", type=float, default=None,
                        help="retained-memory budget for the recommendation (default: observed)")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table",
                        help="output format")


def _run_whatif(args: argparse.Namespace) -> int:
    from kvscope.analysis.whatif import main_whatif

    return main_whatif(args.file, args.ttl or [], args.threshold or [], args.router_ttl,
                       args.runs, args.format, args.budget_gib_s)


def _configure_gpu_sampler(parser: argparse.ArgumentParser) -> None:
    from kvscope.collector.gpu import add_gpu_sampler_arguments

    add_gpu_sampler_arguments(parser)


def _run_gpu_sampler(args: argparse.Namespace) -> int:
    from kvscope.collector.gpu import main_gpu_sampler

    return main_gpu_sampler(args)


def _configure_ingest(parser: argparse.ArgumentParser) -> None:
    from kvscope.collector.ingest import KINDS

    add_setting(parser, "db")
    add_setting(parser, "run_label")
    parser.add_argument("--kind", choices=sorted(KINDS), default=None,
                        help="kind of every source (default: detected from each file: "
                        + "; ".join(f"{k.name}: {k.description}" for k in KINDS.values()) + ")")
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="files the run left (ingested together as one run); "
                        "KIND:FILE names one file's kind (e.g. vllm-prefill-log:prefill.log)")


def _run_ingest(args: argparse.Namespace) -> int:
    from kvscope.collector.ingest import ingest

    db = _required(args, "db")
    result = ingest(db, args.sources, resolved(args, "run_label") or None, args.kind)
    for source in result.sources:
        unknown = (f", {source.unknown_lines} lines of no known pattern (counted)"
                   if source.unknown_lines else "")
        print(f"{source.path}: {source.kind}, {source.records} records, {source.spans} spans"
              + unknown)
    if result.joined:
        print(f"{result.joined} client turns joined to the proxy's record of them")
    print(f"run {result.run_id} ({result.label!r}) written to {db}")
    return 0


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
    from pathlib import Path

    from kvscope.demo import DemoOptions, run_demo

    return run_demo(Path(args.out), DemoOptions(
        conversations=args.conversations, max_turns=args.max_turns,
        time_scale=args.time_scale, token_scale=args.token_scale,
    ))


COMMANDS: list[Command] = [
    Command("version", "print kvscope's version and store schema version",
            _configure_version, _run_version),
    Command("settings", "show every setting with its resolved value (or the docs table)",
            _configure_settings, _run_settings),
    Command("sql", "run one read-only SQL query against a store", _configure_sql, _run_sql),
    Command("serve", "receive OTLP/HTTP and OTLP/gRPC traces and metrics into a store",
            _configure_serve, _run_serve),
    Command("proxy", "run the instrumented drop-in for vLLM's multi-turn P/D proxy",
            _configure_proxy, _run_proxy),
    Command("emulate", "start emulated vLLM prefill and decode servers (no GPU needed)",
            _configure_emulate, _run_emulate),
    Command("replay", "drive a multi-turn agentic workload against an OpenAI-compatible URL",
            _configure_replay, _run_replay),
    Command("simulate", "simulate a P/D deployment in virtual time on a workload (runs, sweeps) "
            "into a store", _configure_simulate, _run_simulate),
    Command("dashboard", "browse a store in the Dash dashboard (read-only)",
            _configure_dashboard, _run_dashboard),
    Command("analyze", "run one registered analysis (or list them)",
            _configure_analyze, _run_analyze),
    Command("ledger", "rebuild the kvscope_ledger table from a store's raw spans",
            _configure_ledger, _run_ledger),
    Command("report", "write the single-file HTML report", _configure_report, _run_report),
    Command("compare", "compare two runs (A/B: TTFT vs prompt length, prefill split, memory)",
            _configure_compare, _run_compare),
    Command("whatif", "replay observed timelines under other TTL / threshold settings",
            _configure_whatif, _run_whatif),
    Command("gpu-sampler", "sample GPU memory with NVML as kvscope gauges",
            _configure_gpu_sampler, _run_gpu_sampler),
    Command("ingest", "store a run's own files (vLLM benchmark stats, proxy log) as a kvscope run",
            _configure_ingest, _run_ingest),
    Command("demo", "run the demo and write out/kvscope.duckdb", _configure_demo, _run_demo),
]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (tests iterate it to check every command has help)."""
    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="Observe KV reuse in vLLM P/D deployments with bidirectional NIXL transfer.",
    )
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        try:
            command.configure(child)
        except ModuleNotFoundError as exc:
            # The base install (what a vLLM process needs) lacks this command's extra: the
            # command stays listed and says which extra to install when run.
            if missing_extra(exc) is None:
                raise
            child.set_defaults(_run=_needs_extra(exc))
            continue
        child.set_defaults(_run=command.run)
    return parser


def setting_commands() -> dict[str, list[str]]:
    """Setting name → the sub-commands that take its option (for docs/settings.md)."""
    found: dict[str, list[str]] = {}
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, child in action.choices.items():
                for option in child._actions:
                    setting = settings.SETTINGS.get(option.dest)
                    if setting is not None and setting.cli_flag in option.option_strings:
                        found.setdefault(option.dest, []).append(command)
    return found


# Packages of the extras, and the extra that brings each (pyproject.toml).
_EXTRA_OF = {"duckdb": "store", "pyarrow": "store", "polars": "store", "aiohttp": "store",
             "grpc": "store", "plotly": "dashboard", "dash": "dashboard"}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The kvscope extra whose package ``exc`` did not find, if it is one of them."""
    return _EXTRA_OF.get((exc.name or "").split(".")[0])


def _needs_extra(exc: ModuleNotFoundError) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise exc
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvscope`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=str(settings.resolve("log_level")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args._run(args))
    except KvscopeError as exc:
        print(f"kvscope {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc)
        if extra is None:
            raise
        print(f"kvscope {args.command}: error: needs the '{extra}' extra ({exc.name} is not "
              f"installed): pip install 'kvscope[{extra}]'", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
