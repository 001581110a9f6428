"""Which evidence a store holds, and what each missing source leaves unmeasured.

``evidence`` is a registered analysis over the selected runs: one row per source of evidence
(proxy turn spans, first-token events, the engine hooks' decisions, transfers and retention
spans, tool waits, GPU memory samples, the retained-bytes gauge), whether it is present, on how
many turns, and, when absent, what is *not measured* without it. The dashboard's overview shows
it; the report lists it with the other tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope.analysis import retention
from kvscope.analysis.registry import AnalysisContext, register, run
from kvscope.errors import KvscopeError

__all__ = ["COLUMNS", "SOURCES", "source_table"]

# Which evidence each part of the picture needs: (name, ledger column, what is lost without it).
SOURCES: tuple[tuple[str, str, str], ...] = (
    ("proxy turn spans", "turn_ms", "no proxy spans: turns, TTFT and task time not measured"),
    ("first-token times", "ttft_ms", "no first-token events: TTFT not measured"),
    ("engine hooks: reuse decisions", "decision",
     "no engine hooks: reuse decisions not measured (outcomes fall back to unknown)"),
    ("engine hooks: D→P transfers", "d2p_status",
     "no engine hooks: transfer times not measured"),
    ("engine hooks: retention spans", "retention_bytes",
     "no retention spans: retention cost not measured"),
    ("tool waits", "tool_wait_s", "no tool-wait spans: tool wait not measured"),
)

COLUMNS: dict[str, pl.DataType] = {
    "source": pl.String(), "present": pl.Boolean(), "turns_with_it": pl.Int64(),
    "missing": pl.String(),
}


def source_table(ledger: pl.DataFrame, memory: pl.DataFrame | None) -> pl.DataFrame:
    """Which evidence the store holds: source, present, rows, and what is missing without it.

    ``memory`` is the ``retained_memory`` result (None when it could not be computed).
    """
    rows: list[tuple[str, bool, int | None, str]] = []
    for name, column, lost in SOURCES:
        count = (ledger.height - ledger[column].null_count()) if column in ledger.columns else 0
        rows.append((name, count > 0, count, "" if count else lost))
    sources = memory["source"].unique().to_list() if memory is not None and \
        "source" in memory.columns else []
    gpu = retention.SOURCE_GPU_USED in sources or retention.SOURCE_GPU_TOTAL in sources
    gauge = retention.SOURCE_RETAINED_GAUGE in sources
    rows.append(("GPU memory samples", gpu, None,
                 "" if gpu else "no GPU sampler: GPU memory not measured"))
    rows.append(("retained-bytes gauge", gauge, None,
                 "" if gauge else "no gauge: retained bytes derived from retention spans"))
    return pl.DataFrame(rows, schema=COLUMNS, orient="row")


@register("evidence", "Which evidence the selected runs have, and what is not measured without "
          "each missing source", columns=COLUMNS)
def evidence(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    try:
        memory: pl.DataFrame | None = run(ctx, "retained_memory")
    except KvscopeError:  # no memory evidence is itself the finding
        memory = None
    return source_table(ctx.ledger(), memory)
