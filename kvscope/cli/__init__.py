"""The ``kvscope`` command line: every command, its options, its composition and exit codes.

    options.py    what commands share: the command record, setting options, parsers
    deployment.py the settings emulate, simulate, replay and proxy share, each declared once
    analysis.py   sql, analyze, ledger, report, compare, whatif (reading a store)
    serve.py      serve (optionally with the live dashboard) and dashboard
    collect.py    proxy (its options and process: proxy.py), gpu-sampler, ingest
    emulator.py   emulate, replay, simulate, demo; simulate.py and demo.py their bodies

Each sub-command is a :class:`~kvscope.cli.options.Command` of one of those modules; options
that are settings are built from :mod:`kvscope.settings`. Library errors
(:class:`kvscope.errors.KvscopeError`) become one-line messages here and nowhere else; exit
status 2 for user mistakes. Library modules expose functions; none defines an entry point.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from kvscope import __version__, settings
from kvscope.cli import analysis, collect, emulator, serve
from kvscope.cli.options import EXIT_USER_ERROR, Command
from kvscope.errors import KvscopeError
from kvscope.tables import format_rows

__all__ = [
    "COMMANDS", "analysis", "build_parser", "collect", "demo", "deployment", "emulator", "main",
    "missing_extra", "options", "proxy", "serve", "setting_commands", "simulate",
]


def _configure_version(parser: argparse.ArgumentParser) -> None:
    return None


def _run_version(args: argparse.Namespace) -> int:
    from kvscope.store.version import SCHEMA_VERSION

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
    # A password is shown as set or not, never printed.
    shown = {n: ("(set)" if n.endswith("_password") and v else v) for n, v in values.items()}
    rows = [(name, shown[name], s.env_var) for name, s in settings.SETTINGS.items()]
    sys.stdout.write(format_rows(["setting", "value", "environment"], rows, "table"))
    return 0


def _ordered(commands: Sequence[Command], order: Sequence[str]) -> list[Command]:
    """``commands`` in the help's order (every command placed once)."""
    by_name = {c.name: c for c in commands}
    if sorted(by_name) != sorted(order) or len(by_name) != len(commands):
        raise ValueError(f"commands {sorted(by_name)} are not the ordered {sorted(order)}")
    return [by_name[name] for name in order]


COMMANDS: list[Command] = _ordered([
    Command("version", "print kvscope's version and store schema version",
            _configure_version, _run_version),
    Command("settings", "show every setting with its resolved value (or the docs table)",
            _configure_settings, _run_settings),
    *analysis.COMMANDS, *serve.COMMANDS, *collect.COMMANDS, *emulator.COMMANDS,
], ("version", "settings", "sql", "serve", "proxy", "emulate", "replay", "simulate", "dashboard",
    "analyze", "ledger", "report", "grafana", "alerts", "compare", "whatif", "gpu-sampler",
    "ingest", "demo"))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, the options of that one command alone.

    Configuring a command imports what its options need (settings tables, emulator profiles,
    the proxy's defaults), so ``main`` configures just the command it runs and ``kvscope
    version`` or ``kvscope --help`` import nothing heavy. Without ``only`` every command is
    configured (docs/settings.md and the tests iterate the whole parser).
    """
    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="Observe KV reuse in vLLM P/D deployments with bidirectional NIXL transfer.",
    )
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        if only is not None and command.name != only:
            continue
        try:
            command.configure(child)
        except ModuleNotFoundError as exc:
            # The base install (what a vLLM process needs) lacks this command's extra: the
            # command stays listed, its --help and any run say which extra to install.
            extra = missing_extra(exc)
            if extra is None:
                raise
            child.description = f"{command.help} ({_install(extra, exc)})"
            child.set_defaults(_run=_needs_extra(exc), _options_unknown=True)
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
             "grpc": "store", "rich": "store", "prometheus_client": "store",
             "plotly": "dashboard", "dash": "dashboard",
             "chdb": "clickhouse", "clickhouse_connect": "clickhouse"}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The kvscope extra whose package ``exc`` did not find, if it is one of them."""
    return _EXTRA_OF.get((exc.name or "").split(".")[0])


def _install(extra: str, exc: ModuleNotFoundError) -> str:
    return (f"needs the '{extra}' extra ({exc.name} is not installed): "
            f"pip install 'kvscope[{extra}]'")


def _needs_extra(exc: ModuleNotFoundError) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise exc
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvscope`` console script."""
    given = list(sys.argv[1:] if argv is None else argv)
    # The command is the first word; any other first word (an option, a typo) needs no
    # command's options to be answered, so none is configured.
    parser = build_parser(only=given[0] if given else "")
    args, unknown = parser.parse_known_args(given)
    if unknown and not getattr(args, "_options_unknown", False):
        parser.parse_args(given)  # argparse's own error for them
    # (A command whose options need a missing extra takes any; running it names the extra.)
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
        print(f"kvscope {args.command}: error: {_install(extra, exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
