"""The OpenTelemetry Collector's ClickHouse exporter DDL (``data/otelcol/``): parse and render it.

The files are the exporter's own templates, unmodified (see ``data/otelcol/NOTICE.md``); this
module reads their column list and fills their ``%s`` placeholders the way the exporter does.
"""

from __future__ import annotations

import re
from pathlib import Path

DATA = Path(__file__).parent / "data" / "otelcol"
TRACES_DDL = DATA / "traces_table.sql"
GAUGE_DDL = DATA / "metrics_gauge_table.sql"

_CODEC = re.compile(r"\s+CODEC\(.*\)$", re.S)


def _split(body: str) -> list[str]:
    """Split a column list at its top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [" ".join(p.split()) for p in parts if p.strip()]


def _body(template: str) -> str:
    """The text between the column list's parentheses (after the ``%s`` cluster clause)."""
    open_at = template.index("(", template.index('"%s"."%s"'))
    depth = 0
    for i in range(open_at, len(template)):
        depth += {"(": 1, ")": -1}.get(template[i], 0)
        if depth == 0:
            return template[open_at + 1:i]
    raise ValueError("unbalanced column list")


def columns(path: Path) -> list[tuple[str, str]]:
    """(name, ClickHouse type) per column, in order; a Nested column's type keeps its fields.

    Indexes are not columns and are left out; codecs are not part of a type.
    """
    out = []
    for part in _split(_body(path.read_text())):
        if part.startswith("INDEX "):
            continue
        name, _, rest = part.partition(" ")
        out.append((name, _CODEC.sub("", rest).strip()))
    return out


def nested_fields(ch_type: str) -> list[tuple[str, str]]:
    """(name, type) of each field of a ``Nested (...)`` type."""
    inner = ch_type[ch_type.index("(") + 1:ch_type.rindex(")")]
    return [(p.partition(" ")[0], p.partition(" ")[2]) for p in _split(inner)]


def render(path: Path, database: str, table: str, engine: str = "MergeTree()") -> str:
    """The exporter's CREATE TABLE for ``database.table``: no cluster, no TTL (its defaults)."""
    return path.read_text() % (database, table, "", engine, "")


def load_into_chdb(duck: str, folder: str, database: str) -> dict[str, int]:
    """Create the exporter's tables in chdb (``folder``, ``database``) and copy ``duck`` in.

    Run it in a process of its own when the caller's process uses another chdb folder (chdb
    allows one per process): ``python -c`` with this module importable from the repo root.
    """
    from kvscope.store.clickhouse import ClickHouseReader, ClickHouseSource, load_store

    create_database(folder, database)
    reader = ClickHouseReader.connect(ClickHouseSource(f"chdb:{folder}", database=database))
    try:
        reader.engine.command(render(TRACES_DDL, database, "otel_traces"))
        reader.engine.command(render(GAUGE_DDL, database, "otel_metrics_gauge"))
        return load_store(duck, reader.engine)
    finally:
        reader.close()


def create_database(folder: str | Path, database: str) -> None:
    """Create ``database`` in the chdb data folder (as the exporter does with create_schema)."""
    from kvscope.store.clickhouse import ClickHouseReader, ClickHouseSource

    reader = ClickHouseReader.connect(ClickHouseSource(f"chdb:{folder}"))
    try:
        reader.engine.command(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    finally:
        reader.close()
