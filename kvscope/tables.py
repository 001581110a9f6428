"""Query results as text: an aligned table, CSV or JSON (every command that prints rows)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

# What a figure, table or sentence says instead of a number nobody measured (never 0).
NOT_MEASURED = "not measured"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, dict | list):
        return json.dumps(value, default=str, separators=(",", ":"))
    return str(value)


def round_float(value: float) -> str:
    """A float as people read it: 4 significant digits, thousands separated, and float noise
    (|x| < 1e-9, e.g. 3.553e-15 left by a subtraction) as 0."""
    if value != value:  # NaN
        return "nan"
    if abs(value) < 1e-9:
        return "0"
    if abs(value) >= 1e6:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _text_cell(value: Any) -> str:
    return round_float(value) if isinstance(value, float) else _cell(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def format_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str) -> str:
    """Render a result as an aligned text table, CSV or JSON (a list of objects)."""
    if fmt == "json":
        records = [
            {c: _jsonable(v) for c, v in zip(columns, row, strict=True)} for row in rows
        ]
        return json.dumps(records, indent=2, default=str) + "\n"
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(v) for v in row])
        return buffer.getvalue()
    cells = [[_text_cell(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        widths = [max(w, len(v)) for w, v in zip(widths, row, strict=True)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"
