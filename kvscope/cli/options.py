"""What every command shares: the command record, setting options, value parsers, exit codes."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvscope import settings
from kvscope.errors import SettingError

__all__ = ["Command", "EXIT_USER_ERROR", "FORMATS", "add_clickhouse", "add_format", "add_setting",
    "add_store", "add_store_and_runs", "add_workload_scaling", "floats", "ints", "names",
    "required", "resolved", "setting_help", "store_source"]

EXIT_USER_ERROR = 2
FORMATS = ("table", "csv", "json")


@dataclass(frozen=True)
class Command:
    """One sub-command: its name, one-line help, how it adds options and how it runs."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def setting_help(name: str) -> str:
    """A setting's help with its environment variable and default (for hand-built options)."""
    setting = settings.SETTINGS[name]
    return f"{setting.help} (env {setting.env_var}; default {setting.default!r})"


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


def required(args: argparse.Namespace, name: str) -> Any:
    """A setting that must have a value (from its flag or its environment variable)."""
    value = resolved(args, name)
    if value in ("", None):
        setting = settings.SETTINGS[name]
        raise SettingError(f"{setting.cli_flag} is required (or set {setting.env_var})")
    return value


def _numbers(text: str, convert: Callable[[str], Any], what: str) -> list[Any]:
    try:
        return [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of {what}") from None


def floats(text: str) -> list[float]:
    """A comma-separated list of numbers (an argparse type)."""
    return _numbers(text, float, "numbers")


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (an argparse type)."""
    return _numbers(text, int, "integers")


def names(text: str) -> list[str]:
    """A comma-separated list of names (an argparse type)."""
    return [v.strip() for v in text.split(",") if v.strip()]


def add_workload_scaling(parser: argparse.ArgumentParser) -> None:
    """Options that scale the workload ``sources.load`` reads: turns, tokens, arrivals, time."""
    parser.add_argument("--max-turns", type=int, default=None, help="cap turns per conversation")
    parser.add_argument("--token-scale", type=float, default=1.0,
                        help="multiply weka CSV token counts (e.g. 0.05 for a fast demo)")
    parser.add_argument("--arrival-rate", type=float, default=0.0,
                        help="sessions per second for weka traces (0: all start at once)")
    from kvscope.cli import deployment

    deployment.add(parser, "time_scale")


def add_clickhouse(parser: argparse.ArgumentParser) -> None:
    """Options of the commands that read the Collector's ClickHouse tables instead of a file."""
    add_setting(parser, "clickhouse", metavar="URL")
    add_setting(parser, "clickhouse_database", metavar="DATABASE")
    add_setting(parser, "clickhouse_user", metavar="USER")


def add_store(parser: argparse.ArgumentParser, mode: str = "opened read-only") -> None:
    """The store a command reads: a DuckDB file, or the Collector's ClickHouse tables."""
    parser.add_argument("file", nargs="?", default=None,
                        help=f"kvscope DuckDB store ({mode}); or --clickhouse URL")
    add_clickhouse(parser)


def store_source(args: argparse.Namespace) -> Any:
    """What a reading command reads: the DuckDB file named, else the ClickHouse source of
    ``--clickhouse`` (or its environment variable), with its database, user and password."""
    explicit = getattr(args, "clickhouse", None)
    if args.file is not None and not explicit:
        return args.file
    url = resolved(args, "clickhouse")
    if not url:
        env = settings.SETTINGS["clickhouse"].env_var
        raise SettingError("name a kvscope DuckDB store, or the Collector's ClickHouse tables "
                           f"with --clickhouse URL (or set {env})")
    if args.file is not None:
        if getattr(args, "name", "absent") is None:
            # `analyze --clickhouse URL NAME`: the one positional is the analysis, not a file.
            args.name, args.file = args.file, None
        else:
            raise SettingError(f"{args.file}: read a DuckDB store or --clickhouse, not both")
    from kvscope.store.clickhouse import ClickHouseSource

    return ClickHouseSource(url, database=resolved(args, "clickhouse_database"),
                            user=resolved(args, "clickhouse_user") or None,
                            password=resolved(args, "clickhouse_password") or None)


def add_store_and_runs(parser: argparse.ArgumentParser) -> None:
    """The store (file or ClickHouse) and an optional run selection by ids or labels."""
    add_store(parser)
    parser.add_argument("--run", "--runs", dest="runs", type=names, default=None,
                        help="run ids or labels to include, comma separated (default: all)")


def add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format")
