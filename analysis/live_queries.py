"""Registered analyses answered by ``kvscope serve`` while it writes the store.

DuckDB lets one process open a file for writing and then no other may open it, so
``kvscope analyze FILE`` cannot read a store ``kvscope serve`` holds. The receiver answers
``GET /v1/analyze/NAME`` on its OTLP/HTTP port instead: it runs the registered analysis on a
cursor of its own connection, which reads a consistent snapshot (what was committed when the
query began; DuckDB's MVCC), and answers JSON ``{"columns": [...], "rows": [[...], ...]}``.
``kvscope analyze --live URL NAME`` prints that like a local run. Query string: ``runs`` (ids or
labels, comma separated), ``param`` (``NAME=VALUE``, repeatable), ``labels=1`` (``run_id``
shown as a ``run`` column of labels, as tables show it).

Read-only by construction: only registered analyses run (no SQL text is taken), through a
:class:`~kvscope.store.reader.Reader` with the store query time limit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import duckdb
import polars as pl

from kvscope import settings
from kvscope.analysis import registry
from kvscope.analysis.runs import context_over, run_table, with_run_labels
from kvscope.errors import SettingError
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.reader import Reader
from kvscope.tables import jsonable

# The receiver's route (``{name}``: the analysis).
ROUTE = "/v1/analyze/{name}"
# Query string → JSON body; raises KvscopeError for a bad request (answered 400).
Answer = Callable[[str, Mapping[str, Sequence[str]]], bytes]


def parse_params(items: Sequence[str]) -> dict[str, str]:
    """``NAME=VALUE`` items as a dict (``--param`` and the ``param`` query argument)."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SettingError(f"--param {item!r}: expected NAME=VALUE")
        params[key.strip()] = value
    return params


def run_analysis(reader: Reader, name: str, params: Mapping[str, str],
                 runs: Sequence[str] | None = None, *, labels: bool = False) -> pl.DataFrame:
    """One registered analysis on an open reader (parameters checked first); ``labels``: its
    ``run_id`` column as run labels."""
    parsed = registry.get(name).parse_params(dict(params))
    ctx = context_over(reader, runs)
    frame = registry.run(ctx, name, parsed)
    if labels and "run_id" in frame.columns:
        frame = with_run_labels(frame, run_table(ctx))
    return frame


def answer_source(con: duckdb.DuckDBPyConnection) -> Answer:
    """The ``/v1/analyze/{name}`` answerer over the receiver's store connection."""

    def answer(name: str, query: Mapping[str, Sequence[str]]) -> bytes:
        runs = [r.strip() for item in query.get("runs", []) for r in item.split(",")
                if r.strip()]
        labels = query.get("labels", ["0"])[-1] in ("1", "true", "yes")
        cursor = con.cursor()
        try:
            limit = float(settings.resolve("store_query_time_limit_s")) or None
            frame = run_analysis(DuckDBReader(cursor, time_limit_s=limit), name,
                                 parse_params(query.get("param", [])), runs or None,
                                 labels=labels)
        finally:
            cursor.close()
        rows = [[jsonable(v) for v in row] for row in frame.rows()]
        return json.dumps({"columns": frame.columns, "rows": rows}, default=str).encode()

    return answer


__all__ = ["Answer", "ROUTE", "answer_source", "parse_params", "run_analysis"]
