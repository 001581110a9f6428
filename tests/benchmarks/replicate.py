"""A K times larger store made from a simulated one, in DuckDB's engine (issue 20, part 6).

Simulating 10M turns takes hours here; replicating the cached 1M store takes minutes. Replica
``r`` (0..K-1) of every span and gauge row is the source row with

* every id the ledger and the analyses join on given the suffix ``-r<r>`` (none for replica 0):
  TraceId, SpanId, ParentSpanId, the links' TraceId/SpanId, the exemplars' TraceId/SpanId, and
  the attribute values of :data:`APPENDED_KEYS` (conversation id, X-Request-Id). vLLM request
  ids (:data:`VLLM_ID_KEYS`, the offered/retention id among them) take the suffix *before*
  vLLM's random ``-`` + 8 characters, so that reduced to the X-Request-Id they name the
  replica's X-Request-Id (``chatcmpl-<x>-r3-1a2b3c4d`` -> ``<x>-r3``);
* every time (span start, event times, gauge sample times, exemplar times) moved later by
  ``r`` x (the source's time span + ``gap_s``), rounded up to whole hours, so replicas never
  overlap on the same engines: each engine's retained memory stays what one engine could hold.

The run ids stay: the ON and OFF runs stay two runs, each K times as many conversations. The
raw tables keep exactly the schema of :mod:`kvscope.store.schema` (the target is created by
``open_store``); ``kvscope_runs`` is copied once. Everything runs as ``INSERT ... SELECT`` in
DuckDB; no row passes through Python.

Run:  .venv/bin/python tests/benchmarks/replicate.py SOURCE TARGET --replicate K
      [--gap-s 3600] [--memory-limit 6GB] [--threads 2]
Not a test (tests/store/test_replicate.py checks it on a small store).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent.parent))  # run as a script from anywhere

from kvscope import semconv  # noqa: E402
from kvscope.store.database import open_store  # noqa: E402
from kvscope.store.schema import (  # noqa: E402
    GAUGE_COLUMNS,
    GAUGE_TABLE,
    RUNS_TABLE,
    TRACES_COLUMNS,
    TRACES_TABLE,
    quote,
)

# Ids that are whole values: the replica's suffix goes at the end.
APPENDED_KEYS = (semconv.GEN_AI_CONVERSATION_ID, semconv.X_REQUEST_ID)
# vLLM request ids (``chatcmpl-<X-Request-Id>-<8 random>``): every declared request-id key but
# the X-Request-Id. Taken from the registry, as kvscope's hook spans' key and vLLM's own
# llm_request key are both declared there (a store may hold either).
VLLM_ID_KEYS = tuple(sorted(
    name for name, convention in semconv.REGISTRY.items()
    if convention.kind == "attribute" and name.endswith(("request_id", "request.id"))
    and name not in APPENDED_KEYS
))
# vLLM's random tail, as analysis/ledger.py strips it; the suffix goes in front of it.
_VLLM_TAIL = r"^(.*?)(-[0-9A-Za-z]{8})?$"
HOUR_NS = 3600 * 10**9

# Macros: the one definition of each rewrite, used by both tables' SELECTs.
_MACROS = [
    # An id with the replica's suffix; an empty id (no parent) stays empty.
    "CREATE OR REPLACE TEMP MACRO rep_id(v, sfx) AS "
    "CASE WHEN v IS NULL OR v = '' THEN v ELSE v || sfx END",
    "CREATE OR REPLACE TEMP MACRO rep_ts(t, shift_ns) AS "
    "CASE WHEN t IS NULL THEN t ELSE make_timestamp_ns(epoch_ns(t) + shift_ns) END",
    # A gauge's StartTimeUnix may be unset (the epoch): it stays so.
    "CREATE OR REPLACE TEMP MACRO rep_start_ts(t, shift_ns) AS "
    "CASE WHEN t IS NULL OR epoch_ns(t) = 0 THEN t "
    "ELSE make_timestamp_ns(epoch_ns(t) + shift_ns) END",
    "CREATE OR REPLACE TEMP MACRO rep_attrs(m, sfx, appended, vllm, tail) AS "
    "CASE WHEN m IS NULL THEN m ELSE map_from_entries(list_transform(map_entries(m), "
    "lambda e: {'key': e.key, 'value': CASE "
    "WHEN e.value IS NULL OR e.value = '' THEN e.value "
    "WHEN list_contains(appended, e.key) THEN e.value || sfx "
    "WHEN list_contains(vllm, e.key) THEN regexp_replace(e.value, tail, '\\1' || sfx || '\\2') "
    "ELSE e.value END})) END",
]


def _select(table: str) -> str:
    """The SELECT of one replica of ``table``'s rows; parameters $sfx, $shift_ns, $appended,
    $vllm, $tail."""
    attrs = "rep_attrs({}, $sfx, $appended, $vllm, $tail)"
    if table == TRACES_TABLE:
        exprs = {
            "Timestamp": "rep_ts(Timestamp, $shift_ns)",
            "TraceId": "rep_id(TraceId, $sfx)",
            "SpanId": "rep_id(SpanId, $sfx)",
            "ParentSpanId": "rep_id(ParentSpanId, $sfx)",
            "SpanAttributes": attrs.format("SpanAttributes"),
            "Events": "list_transform(Events, lambda e: {"
                      "'Timestamp': rep_ts(e.Timestamp, $shift_ns), "
                      f"'Name': e.Name, 'Attributes': {attrs.format('e.Attributes')}}})",
            "Links": "list_transform(Links, lambda k: {'TraceId': rep_id(k.TraceId, $sfx), "
                     "'SpanId': rep_id(k.SpanId, $sfx), 'TraceState': k.TraceState, "
                     f"'Attributes': {attrs.format('k.Attributes')}}})",
        }
        columns = TRACES_COLUMNS
    else:
        exprs = {
            "Attributes": attrs.format("Attributes"),
            "StartTimeUnix": "rep_start_ts(StartTimeUnix, $shift_ns)",
            "TimeUnix": "rep_ts(TimeUnix, $shift_ns)",
            "Exemplars": "list_transform(Exemplars, lambda x: {"
                         f"'FilteredAttributes': {attrs.format('x.FilteredAttributes')}, "
                         "'TimeUnix': rep_ts(x.TimeUnix, $shift_ns), 'Value': x.Value, "
                         "'SpanId': rep_id(x.SpanId, $sfx), 'TraceId': rep_id(x.TraceId, $sfx)})",
        }
        columns = GAUGE_COLUMNS
    body = ", ".join(exprs.get(name, quote(name)) + f" AS {quote(name)}" for name, _, _ in columns)
    return f"SELECT {body} FROM src.{quote(table)}"


def suffix(replica: int) -> str:
    """The id suffix of replica ``replica`` (none for the original, replica 0)."""
    return f"-r{replica}" if replica else ""


def time_step_ns(con: Any, gap_s: float) -> int:
    """How far replica r+1 starts after replica r: the source's span of time (first start to
    last end, spans and gauge samples) plus ``gap_s``, rounded up to whole hours."""
    row = con.execute(
        f"SELECT min(epoch_ns(Timestamp)), max(epoch_ns(Timestamp) + Duration) "
        f"FROM src.{quote(TRACES_TABLE)}").fetchone()
    gauge = con.execute(
        f"SELECT min(epoch_ns(TimeUnix)), max(epoch_ns(TimeUnix)) "
        f"FROM src.{quote(GAUGE_TABLE)}").fetchone()
    starts = [v for v in (row[0], gauge[0]) if v is not None]
    ends = [v for v in (row[1], gauge[1]) if v is not None]
    if not starts:
        return HOUR_NS
    span = int(max(ends)) - int(min(starts)) + int(gap_s * 1e9)
    return math.ceil(span / HOUR_NS) * HOUR_NS


def _sql_string(text: str) -> str:
    # ATTACH takes no bound parameter: the path goes in as a quoted literal.
    return "'" + text.replace("'", "''") + "'"


def replicate(source: Path, target: Path, replicas: int, *, gap_s: float = 3600.0,
              memory_limit: str = "6GB", threads: int = 2,
              progress: Any = None) -> dict[str, Any]:
    """Write ``target``: ``replicas`` copies of ``source``'s rows (see the module docstring).

    Atomic: written under ``<target>.partial`` and renamed when complete. Returns rows per
    table, the time step (ns), the seconds taken and the file size.
    """
    if replicas < 1:
        raise ValueError(f"--replicate {replicas}: need at least 1")
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such store file")
    partial = target.with_name(target.name + ".partial")
    for stale in (partial, partial.with_name(partial.name + ".wal")):
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    con = open_store(partial, threads=threads)
    try:
        con.execute(f"SET memory_limit = {_sql_string(memory_limit)}")
        con.execute("SET preserve_insertion_order = false")
        con.execute("SET enable_progress_bar = false")
        con.execute(f"ATTACH {_sql_string(str(source))} AS src (READ_ONLY)")
        for macro in _MACROS:
            con.execute(macro)
        step = time_step_ns(con, gap_s)
        con.execute(f"INSERT INTO {quote(RUNS_TABLE)} SELECT * FROM src.{quote(RUNS_TABLE)}")
        rows = {TRACES_TABLE: 0, GAUGE_TABLE: 0}
        for replica in range(replicas):
            params = {"sfx": suffix(replica), "shift_ns": replica * step,
                      "appended": list(APPENDED_KEYS), "vllm": list(VLLM_ID_KEYS),
                      "tail": _VLLM_TAIL}
            for table in (TRACES_TABLE, GAUGE_TABLE):
                sql = f"INSERT INTO {quote(table)} {_select(table)}"
                added = con.execute(sql, {k: v for k, v in params.items()
                                          if f"${k}" in sql}).fetchone()
                rows[table] += int(added[0]) if added else 0
            if progress is not None:
                progress(replica, time.perf_counter() - start)
        con.execute("DETACH src")
        con.execute("CHECKPOINT")
    except BaseException:
        con.close()
        partial.unlink(missing_ok=True)
        raise
    con.close()
    os.replace(partial, target)
    return {"rows": rows, "step_ns": step, "replicate_s": time.perf_counter() - start,
            "file_mib": target.stat().st_size / 2**20}


def replicated_name(turns: int, seed: int, replicas: int) -> str:
    """The cache file name of a replicated store: says it was not simulated at that size."""
    return f"ledger-{turns * replicas}-s{seed}-rep{replicas}x{turns}.duckdb"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--replicate", type=int, required=True, help="copies (K)")
    parser.add_argument("--gap-s", type=float, default=3600.0)
    parser.add_argument("--memory-limit", default="6GB")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    out = replicate(args.source, args.target, args.replicate, gap_s=args.gap_s,
                    memory_limit=args.memory_limit, threads=args.threads,
                    progress=lambda r, s: print(f"  replica {r} done at {s:.1f} s", flush=True))
    print(f"replicate x{args.replicate}: {out['rows']} in {out['replicate_s']:.1f} s, "
          f"step {out['step_ns'] / 3.6e12:.0f} h, file {out['file_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
