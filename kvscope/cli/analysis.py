"""Commands that read a store: ``sql``, ``analyze``, ``ledger``, ``report``, ``compare``,
``whatif``.

Each opens the store read-only (``ledger`` for writing: it rebuilds the ledger table), runs
registered analyses through :mod:`kvscope.analysis` and prints their frames with
:func:`kvscope.tables.format_rows`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvscope.cli.options import (
    Command,
    add_format,
    add_store,
    add_store_and_runs,
    floats,
    ints,
    store_source,
)
from kvscope.errors import SettingError, StoreError
from kvscope.tables import format_rows

__all__ = ["COMMANDS", "SQL_MAX_ROWS", "sql_params"]

# Most rows `kvscope sql` prints: a terminal's or a script's worth, held as Python objects
# (about 100-200 MB at a handful of columns). A larger result is refused with its reason.
SQL_MAX_ROWS = 1_000_000


def _configure_sql(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="kvscope DuckDB store (opened read-only)")
    parser.add_argument(
        "query", help="one SQL statement, e.g. 'SELECT count(*) FROM otel_traces'"
    )
    add_format(parser)
    parser.add_argument(
        "--param", action="append", default=[], metavar="NAME=VALUE",
        help="bind VALUE to $NAME in the query (repeatable; as analyze's --param)",
    )


_PARAM = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)


def sql_params(query: str, given: list[str]) -> dict[str, str] | list[str]:
    """``--param NAME=VALUE`` items as ``$NAME`` bindings; the old spelling, ``--param VALUE``
    for the next ``?``, still binds (with a deprecation line on stderr) when any item is not
    ``NAME=VALUE`` or names a ``$NAME`` the query does not use."""
    named = [_PARAM.fullmatch(item) for item in given]
    if all(m is not None and re.search(rf"\${m[1]}\b", query) for m in named):
        return {m[1]: m[2] for m in named if m is not None}
    print("kvscope sql: --param VALUE for a ? placeholder is deprecated; write $name in the "
          "query and --param name=VALUE", file=sys.stderr)
    return list(given)


def _run_sql(args: argparse.Namespace) -> int:
    from kvscope.store.query import Query
    from kvscope.store.source import open_reader

    bound = sql_params(args.query, args.param)
    query = (Query(args.query, bound, name="kvscope sql") if isinstance(bound, dict)
             else Query(args.query, positional=tuple(bound), name="kvscope sql"))
    reader = open_reader(args.file)
    try:
        columns, rows = reader.rows(query, max_rows=SQL_MAX_ROWS)
    except StoreError as exc:
        raise _unbuilt_ledger(exc, args.file) or exc from None
    finally:
        reader.close()
    sys.stdout.write(format_rows(columns, rows, args.format))
    return 0


def _unbuilt_ledger(exc: Exception, store: str) -> SettingError | None:
    """A hint for a query naming the ledger table before ``kvscope ledger`` built it (DuckDB
    says only that the table does not exist)."""
    from kvscope.analysis.ledger import LEDGER_TABLE

    if f"Table with name {LEDGER_TABLE} does not exist" not in str(exc):
        return None
    return SettingError(
        f"{store} has no {LEDGER_TABLE} table yet: build it with `kvscope ledger {store}` "
        f"(from the raw spans), or read the ledger without it: `kvscope analyze {store} ledger`")


def _configure_analyze(parser: argparse.ArgumentParser) -> None:
    add_store_and_runs(parser)
    parser.add_argument("name", nargs="?", default=None,
                        help="analysis to run (omit to list them)")
    add_format(parser)
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="an analysis parameter (repeatable)")
    parser.add_argument("--live", default=None, metavar="URL",
                        help="ask a running kvscope serve (its OTLP/HTTP URL, e.g. "
                        "http://127.0.0.1:4318) instead of opening a store: serve holds its "
                        "store for writing, and answers from a consistent snapshot")


def _run_analyze(args: argparse.Namespace) -> int:
    """Without a name: list the analyses with their titles and parameters. With one: print its
    result as a table, JSON or CSV (read from the store, or asked of a live ``kvscope serve``)."""
    from kvscope.analysis import registry
    from kvscope.analysis.live_queries import parse_params, run_analysis
    from kvscope.analysis.runs import require_spans

    params = parse_params(args.param)
    if args.live is not None:
        if args.name is None and args.file is not None:
            args.name, args.file = args.file, None  # `analyze --live URL NAME`
        if args.file is not None:
            raise SettingError("--live URL reads from kvscope serve: give no store file")
    source = None if args.live is not None else store_source(args)
    if args.name is None:
        rows = [
            (a.name, a.title, ", ".join(f"{p.name}={p.default} ({p.help})" for p in a.params))
            for a in registry.iter_analyses()
        ]
        sys.stdout.write(format_rows(["name", "title", "parameters"], rows, args.format))
        return 0
    registry.get(args.name).parse_params(params)  # refuse bad parameters before reading
    labels = args.format == "table"  # people read runs by label; csv and json keep the id
    if args.live is not None:
        columns, answered = _ask_live(args.live, args.name, args.param, args.runs, labels)
        sys.stdout.write(format_rows(columns, answered, args.format))
        return 0
    from kvscope.store.source import open_reader

    assert source is not None
    require_spans(source)
    reader = open_reader(source)
    try:
        frame = run_analysis(reader, args.name, params, args.runs, labels=labels)
    finally:
        reader.close()
    sys.stdout.write(format_rows(frame.columns, frame.rows(), args.format))
    return 0


def _ask_live(url: str, name: str, params: list[str], runs: list[str] | None,
              labels: bool) -> tuple[list[str], list[list[object]]]:
    """An analysis answered by a running ``kvscope serve`` (``GET /v1/analyze/NAME``)."""
    import httpx

    query: list[tuple[str, str | int | float | bool | None]] = [
        ("param", p) for p in params]
    query.append(("labels", "1" if labels else "0"))
    if runs:
        query.append(("runs", ",".join(runs)))
    target = f"{url.rstrip('/')}/v1/analyze/{name}"
    try:
        response = httpx.get(target, params=query, timeout=120)
    except httpx.HTTPError as exc:
        raise SettingError(f"--live {url}: cannot reach kvscope serve ({exc})") from None
    if response.status_code == 404:
        raise SettingError(f"--live {url}: no /v1/analyze there (is it kvscope serve's "
                           "OTLP/HTTP port?)")
    body = response.json() if response.headers.get("content-type", "").startswith(
        "application/json") else {}
    if response.status_code != 200:
        raise SettingError(f"--live {url}: {body.get('error') or response.text.strip()}")
    return list(body["columns"]), [list(row) for row in body["rows"]]


def _configure_ledger(parser: argparse.ArgumentParser) -> None:
    add_store(parser, "opened for writing")
    parser.add_argument("--full", action="store_true",
                        help="rebuild every turn (default: only the conversations new spans "
                             "touched since the last build; DuckDB stores)")
    parser.add_argument("--partitions", type=_partitions, default=None, metavar="N",
                        help="build a whole table in N ranges of conversations, each "
                             "written as it is built: less memory, more time (default: one "
                             "statement up to 1M turns, 250k on ClickHouse, then one range per "
                             "125k)")


def _partitions(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number from 1 to 256")
    return value


def _run_ledger(args: argparse.Namespace) -> int:
    from kvscope.analysis.ledger import LEDGER_TABLE
    from kvscope.progress import spinner

    source = store_source(args)
    if not isinstance(source, str):
        from kvscope.analysis.ledger_units import rebuild_clickhouse

        with spinner(f"kvscope ledger: rebuilding {LEDGER_TABLE} from the raw spans"):
            rows = rebuild_clickhouse(source, partitions=args.partitions)
        print(f"{LEDGER_TABLE}: {rows} turns rebuilt from the raw spans in {source}")
        return 0
    if not Path(args.file).is_file():
        # Opening for writing would create an empty store and report 0 turns.
        raise SettingError(f"{args.file}: no such kvscope store")
    from kvscope.analysis.ledger_units import update

    with spinner(f"kvscope ledger: bringing {LEDGER_TABLE} up to the raw spans"):
        done = update(args.file, full=args.full, partitions=args.partitions)
    if done.units is None:
        print(f"{LEDGER_TABLE}: {done.rows} turns rebuilt from the raw spans in {args.file} "
              f"({done.reason})")
    else:
        print(f"{LEDGER_TABLE}: {done.rows} turns; {done.units} conversations touched by new "
              f"spans recomputed in {args.file}")
    return 0


def _configure_report(parser: argparse.ArgumentParser) -> None:
    add_store_and_runs(parser)
    parser.add_argument("-o", "--out", default="report.html", help="HTML file to write")


def _run_report(args: argparse.Namespace) -> int:
    from kvscope.analysis.runs import require_spans
    from kvscope.dashboards.report import REPORT_STEPS, write_report
    from kvscope.progress import steps

    source = store_source(args)
    require_spans(source)
    with steps("kvscope report", REPORT_STEPS) as step:
        path = write_report(source, args.out, args.runs, step)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def _configure_compare(parser: argparse.ArgumentParser) -> None:
    add_store_and_runs(parser)
    add_format(parser)


def _run_compare(args: argparse.Namespace) -> int:
    """Print the summary and the by-prompt tables of the pair ``--runs`` names (or the chosen
    ON/OFF pair)."""
    from kvscope.analysis.compare import comparison
    from kvscope.analysis.runs import open_context

    with open_context(store_source(args)) as ctx:
        summary, by_prompt = comparison(ctx, args.runs or None)
    fmt = args.format
    if fmt == "json":
        summary_rows = json.loads(format_rows(summary.columns, summary.rows(), fmt))
        prompt_rows = json.loads(format_rows(by_prompt.columns, by_prompt.rows(), fmt))
        print(json.dumps({"summary": summary_rows, "by_prompt": prompt_rows}, indent=2))
        return 0
    sys.stdout.write(format_rows(summary.columns, summary.rows(), fmt))
    if fmt == "table":
        print()
        sys.stdout.write(format_rows(by_prompt.columns, by_prompt.rows(), fmt))
    return 0


def _configure_whatif(parser: argparse.ArgumentParser) -> None:
    add_store_and_runs(parser)
    parser.add_argument("--ttl", type=floats, default=None,
                        help="decoder_kv_blocks_ttl values in seconds (default 60,120,480,900)")
    parser.add_argument("--threshold", type=ints, default=None,
                        help="kv_recompute_threshold values in tokens (default 0,64,256)")
    parser.add_argument("--router-ttl", type=floats, default=None,
                        help="proxy router TTLs in seconds (default: the observed one)")
    parser.add_argument("--budget-gib-s", type=float, default=None,
                        help="retained-memory budget for the recommendation (default: observed)")
    add_format(parser)


def _run_whatif(args: argparse.Namespace) -> int:
    """Print the what-if table (and, as a table, the cost fit it priced turns with)."""
    from kvscope.analysis import registry
    from kvscope.analysis.runs import open_context
    from kvscope.analysis.whatif import DEFAULT_THRESHOLDS, DEFAULT_TTLS_S

    with open_context(store_source(args), args.runs) as ctx:
        result = registry.run(ctx, "whatif", {
            "ttl": args.ttl or list(DEFAULT_TTLS_S),
            "threshold": args.threshold if args.threshold else list(DEFAULT_THRESHOLDS),
            "router_ttl": args.router_ttl or None,
            "budget_gib_s": args.budget_gib_s,
        })
        sys.stdout.write(format_rows(result.columns, result.rows(), args.format))
        if args.format == "table":
            fits = registry.run(ctx, "cost_fit")
            print()
            sys.stdout.write(format_rows(fits.columns, fits.rows(), args.format))
    return 0


COMMANDS = [
    Command("sql", "run one read-only SQL query against a store", _configure_sql, _run_sql),
    Command("analyze", "run one registered analysis (or list them)",
            _configure_analyze, _run_analyze),
    Command("ledger", "bring the kvscope_ledger table up to a store's raw spans",
            _configure_ledger, _run_ledger),
    Command("report", "write the single-file HTML report", _configure_report, _run_report),
    Command("compare", "compare two runs (A/B: TTFT vs prompt length, prefill split, memory)",
            _configure_compare, _run_compare),
    Command("whatif", "replay observed timelines under other TTL / threshold settings",
            _configure_whatif, _run_whatif),
]
