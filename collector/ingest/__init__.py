"""``kvscope ingest``: make a store from files a run left behind when kvscope did not watch it.

Each source's kind is detected from its first bytes (or named with ``--kind``); every source of
one command becomes one run in ``kvscope_runs``, whose settings list each file's name, kind and
SHA-256. Kinds:

    vllm-bench-stats   vLLM's multi-turn benchmark --stats-json-output (:mod:`.bench_stats`)
    kvscope-replay     kvscope replay --output's JSON lines (:mod:`.replay_records`), read as
                       the benchmark's stats are (joined to a proxy log the same way)
    vllm-proxy-log     vLLM's disagg_proxy_multiturn.py log, or kvscope proxy's turn lines
                       (:mod:`.proxy_log`)
    vllm-server-log    a vLLM server's log, role not named (:mod:`.server_log`); named:
    vllm-prefill-log   ... a prefill server's
    vllm-decode-log    ... a decode server's (the direction of a failed read is the role's)
    vllm-metrics       a snapshot of a vLLM server's /metrics (:mod:`.vllm_metrics`): vLLM's
                       own reuse counters, recorded with the run for reconciliation; named:
    vllm-prefill-metrics, vllm-decode-metrics
    weka-kv-cache-tester  an output file of the WEKA kv-cache-tester (:mod:`.weka_tester`):
                       what it measured, recorded with the run (no turn spans)

A source written ``KIND:PATH`` names that file's kind (e.g. ``vllm-prefill-log:p.log``);
``--kind`` names every source's. A source ``http://HOST:PORT/metrics`` (or
``vllm-prefill-metrics:http://...``) is a vLLM server's ``/metrics``, scraped when the command
runs.

A run's benchmark stats and proxy logs are joined (:mod:`.join`): a client turn takes the
proxy's evidence for the request that served it, so each turn is one ledger row.

All sources are parsed and checked before the store is opened, and their spans are written in
one transaction with the run's record, so a malformed file (a one-line :class:`IngestError`
naming file and line) or any failure leaves the store as it was. A file whose SHA-256 is already
recorded in the store (under any name) is refused, so nothing is ever stored twice.

Files of a deployment whose engines already exported to the store (``kvscope serve``: the vLLM
plugin, vLLM's own tracing) join that run rather than begin one: when the proxy log's requests
are named by the engine spans of exactly one run that has no turn of its own, its turns go into
that run (its settings list the files under ``ingested``), and the ledger's rows built from
engine spans alone give way to them. ``run`` (``kvscope ingest --run``) names the run to join
outright, by id or label: vLLM's ``/metrics`` snapshots of a deployment kvscope watched live, for
the ``reconciliation`` analysis.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvscope import semconv
from kvscope.collector.ingest import (
    bench_stats,
    proxy_log,
    replay_records,
    server_log,
    vllm_metrics,
    weka_tester,
)
from kvscope.collector.ingest.join import join
from kvscope.errors import IngestError
from kvscope.files import read_limited
from kvscope.store.database import batch_folder, begin_run, end_run, open_store
from kvscope.store.rows import TraceRows
from kvscope.store.schema import RUNS_TABLE, TRACES_TABLE, quote
from kvscope.store.writer import insert_arrow

_SOURCE = "kvscope ingest"
# Enough of a file to tell its kind.
_HEAD_BYTES = 4096
_URL_SCHEMES = ("http://", "https://")


class Parsed(Protocol):
    """A parsed source, whatever its kind."""

    @property
    def sha256(self) -> str: ...

    @property
    def records(self) -> int: ...

    def run_settings(self) -> dict[str, Any]:
        """What the run records about this file besides its name, kind and SHA-256."""
        ...


@dataclass(frozen=True)
class Kind:
    """One kind of source: how to recognise, read and turn it into spans."""

    name: str
    description: str
    looks_like: Callable[[str], bool]
    read: Callable[[Path], Parsed]
    add_spans: Callable[[Any, str, TraceRows], int]


def _kind(module: Any, description: str) -> Kind:
    """The kind a source module defines (its ``KIND``, ``looks_like``, ``read``, ``add_spans``)."""
    return Kind(module.KIND, description, module.looks_like, module.read, module.add_spans)


def _by_role(module: Any, description: str) -> list[Kind]:
    """A module's kind per server role, named only (``KIND:PATH`` or ``--kind``): a file does not
    show its server's role. ``description`` has a ``{role}`` to fill."""
    return [Kind(kind, description.format(role=role), lambda head: False,
                 functools.partial(module.read_role, role=role), module.add_spans)
            for kind, role in ((module.KIND_PREFILL, semconv.ROLE_PREFILL),
                               (module.KIND_DECODE, semconv.ROLE_DECODE))]


KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    _kind(bench_stats, "vLLM multi-turn benchmark --stats-json-output"),
    Kind(replay_records.KIND, "kvscope replay --output (JSON lines, one per request)",
         replay_records.looks_like, replay_records.read, bench_stats.add_spans),
    _kind(proxy_log, "a P/D proxy's log (vLLM's disagg_proxy_multiturn.py or kvscope proxy)"),
    _kind(server_log, "a vLLM server's log, role not named (name it: vllm-prefill-log:FILE)"),
    *_by_role(server_log, "a vLLM {role} server's log"),
    _kind(vllm_metrics, "a snapshot of a vLLM server's /metrics (Prometheus text), role not "
          "named (name it: vllm-prefill-metrics:FILE)"),
    *_by_role(vllm_metrics, "a snapshot of a vLLM {role} server's /metrics"),
    _kind(weka_tester, "an output of the WEKA kv-cache-tester (detailed_results, "
          "summary_trace_replay, user_lifecycle CSV or test_metadata.json): recorded with the run"),
)}


@dataclass(frozen=True)
class Ingested:
    """What one source added to the store."""

    path: Path
    kind: str
    sha256: str
    records: int
    spans: int
    # Lines of no known pattern, counted (logs); None for kinds that have no such lines.
    unknown_lines: int | None = None


@dataclass(frozen=True)
class IngestResult:
    """The run one ``kvscope ingest`` recorded and what each source added."""

    run_id: str
    label: str
    sources: tuple[Ingested, ...]
    # Client turns that took a proxy log's evidence for the same request (.join).
    joined: int = 0


def detect(path: Path) -> Kind:
    """The kind of ``path`` from its first bytes; IngestError when no kind matches."""
    head = read_limited(path, _HEAD_BYTES, "ingest source", IngestError, head=True).decode(
        "utf-8", errors="replace")
    for kind in KINDS.values():
        if kind.looks_like(head):
            return kind
    raise IngestError(f"{path}: not a kind of source kvscope knows; name its kind with --kind "
                      f"(known: {', '.join(KINDS)})")


def _named(source: str | Path) -> tuple[str | None, Path]:
    """``KIND:PATH`` → (KIND, PATH) when KIND is a known kind; else (None, the source)."""
    text = str(source)
    prefix, sep, rest = text.partition(":")
    if sep and prefix in KINDS and not Path(text).exists():
        return prefix, Path(rest)
    return None, Path(source)


def _scraped(source: str | Path, scratch: Path) -> tuple[str | None, Path] | None:
    """A live ``/metrics`` URL (``http://HOST:PORT/metrics``, or ``vllm-prefill-metrics:URL``)
    scraped now into ``scratch``: (its kind when named, the snapshot); None for a file."""
    text = str(source)
    prefix, sep, rest = text.partition(":")
    if sep and prefix in KINDS and rest.startswith(_URL_SCHEMES):
        return prefix, vllm_metrics.scrape(rest, scratch)
    if text.startswith(_URL_SCHEMES):  # its kind: --kind's, else detected from the page
        return None, vllm_metrics.scrape(text, scratch)
    return None


def _recorded(con: Any) -> dict[str, tuple[str, str, str]]:
    """SHA-256 of every file already ingested → (run id, label, file name)."""
    found: dict[str, tuple[str, str, str]] = {}
    rows = con.execute(f"SELECT run_id, label, settings FROM {quote(RUNS_TABLE)}").fetchall()
    for run_id, label, settings in rows:
        try:
            recorded = json.loads(settings or "{}")
        except json.JSONDecodeError:
            continue  # a run of another writer with settings kvscope did not write
        if not isinstance(recorded, dict):
            continue
        if recorded.get("source") != _SOURCE:  # a run ingest joined: its files are listed apart
            recorded = recorded.get("ingested")
            if not isinstance(recorded, dict):
                continue
        for entry in recorded.get("files", []):
            if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
                found[entry["sha256"]] = (str(run_id), str(label), str(entry.get("name", "")))
    return found


# vLLM's request id → the X-Request-Id it came from (as the ledger reduces it).
_ID_PREFIX = r"^(chatcmpl-|cmpl-)"
_ID_SUFFIX = r"-[0-9A-Za-z]{8}$"


def _engine_run(con: Any, request_ids: Sequence[str]) -> tuple[str, str, dict[str, Any]] | None:
    """The run (id, label, settings) whose engine spans name ``request_ids``, when exactly one
    run's do and it holds no turn span: the same deployment's engines, seen live."""
    if not request_ids:
        return None
    rows = con.execute(
        "SELECT DISTINCT ResourceAttributes[?] FROM otel_traces WHERE ServiceName IN (?, ?) "
        "AND list_contains(?, regexp_replace(regexp_replace(SpanAttributes[?], ?, ''), ?, ''))",
        [semconv.RUN_ID, semconv.SERVICE_PREFILL, semconv.SERVICE_DECODE, list(request_ids),
         semconv.VLLM_REQUEST_ID, _ID_PREFIX, _ID_SUFFIX]).fetchall()
    runs = [r[0] for r in rows if r[0] is not None]
    if len(runs) != 1:
        return None
    turns = con.execute("SELECT count(*) FROM otel_traces WHERE SpanName = ? AND "
                        "ResourceAttributes[?] = ?",
                        [semconv.SPAN_TURN, semconv.RUN_ID, runs[0]]).fetchall()
    found = con.execute(f"SELECT label, settings FROM {quote(RUNS_TABLE)} WHERE run_id = ?",
                        [runs[0]]).fetchall()
    if turns[0][0] or not found:
        return None
    try:
        settings = json.loads(found[0][1] or "{}")
    except json.JSONDecodeError:
        settings = {}
    return runs[0], str(found[0][0]), settings if isinstance(settings, dict) else {}


def _named_run(con: Any, run: str) -> tuple[str, str, dict[str, Any]]:
    """The run (id, label, settings) whose id or label is ``run``; exactly one must match."""
    found = con.execute(f"SELECT run_id, label, settings FROM {quote(RUNS_TABLE)} "
                        "WHERE run_id = ? OR label = ?", [run, run]).fetchall()
    if len(found) != 1:
        known = con.execute(f"SELECT run_id, label FROM {quote(RUNS_TABLE)} ORDER BY started_at"
                            ).fetchall()
        listed = ", ".join(f"{r[0]} ({r[1]!r})" for r in known[-10:]) or "none"
        what = "no run has" if not found else f"{len(found)} runs have"
        raise IngestError(f"--run {run}: {what} that id or label (runs: {listed}); "
                          "nothing was written")
    try:
        settings = json.loads(found[0][2] or "{}")
    except json.JSONDecodeError:
        settings = {}
    return str(found[0][0]), str(found[0][1]), settings if isinstance(settings, dict) else {}


def ingest(db: str | Path, sources: Sequence[str | Path], run_label: str | None = None,
           kind: str | None = None, run: str | None = None) -> IngestResult:
    """Ingest ``sources`` into the store ``db`` as one run; return what was added.

    ``run`` (an id or label) adds them to that run of the store instead (listed in its settings
    under ``ingested``).

    Raises IngestError (malformed, unknown or already stored source: nothing is written) or a
    StoreError from opening the store.
    """
    if not sources:
        raise IngestError("no source files given")
    if kind is not None and kind not in KINDS:
        raise IngestError(f"unknown --kind {kind!r} (known: {', '.join(KINDS)})")
    parsed: list[tuple[Path, Kind, Parsed]] = []
    first_seen: dict[str, Path] = {}
    scratch = tempfile.TemporaryDirectory(prefix="kvscope-ingest-")
    for source in sources:
        named, path = _scraped(source, Path(scratch.name)) or _named(source)
        name = named or kind
        source_kind = KINDS[name] if name is not None else detect(path)
        content = source_kind.read(path)
        if content.sha256 in first_seen:
            raise IngestError(f"{path}: same content as {first_seen[content.sha256]}, given "
                              "twice; nothing was written")
        first_seen[content.sha256] = path
        parsed.append((path, source_kind, content))
    # Scraped snapshots were read whole (on an error above, the directory's finalizer removes it).
    scratch.cleanup()
    label = run_label or f"{_SOURCE} {', '.join(path.name for path, _, _ in parsed)}"
    joined = join([c for _, _, c in parsed if isinstance(c, bench_stats.BenchStats)],
                  [c for _, _, c in parsed if isinstance(c, proxy_log.ProxyLog)])

    con = open_store(db)
    try:
        already = _recorded(con)
        for path, _, content in parsed:
            if content.sha256 in already:
                run_id, run_label_found, name = already[content.sha256]
                raise IngestError(
                    f"{path}: already in {db} as {name or 'a file'} of run {run_id} "
                    f"({run_label_found!r}); nothing was written")
        con.execute("BEGIN TRANSACTION")
        try:
            files = [{"name": path.name, "kind": source_kind.name, "sha256": content.sha256,
                      **content.run_settings()}
                     for path, source_kind, content in parsed]
            request_ids = [r.x_request_id for _, _, c in parsed
                           if isinstance(c, proxy_log.ProxyLog) for r in c.requests]
            live = _named_run(con, run) if run is not None else _engine_run(con, request_ids)
            if live is None:
                run_id = begin_run(con, label, {"source": _SOURCE, "files": files})
            else:
                run_id, label, settings = live
                ingested = settings.setdefault("ingested", {"source": _SOURCE, "files": []})
                ingested["files"] = [*ingested.get("files", []), *files]
                con.execute(f"UPDATE {quote(RUNS_TABLE)} SET settings = ? WHERE run_id = ?",
                            [json.dumps(settings, sort_keys=True, default=str), run_id])
            rows = TraceRows()
            added: list[Ingested] = []
            for path, source_kind, content in parsed:
                before = len(rows)
                source_kind.add_spans(content, run_id, rows)
                added.append(Ingested(path, source_kind.name, content.sha256,
                                      content.records, len(rows) - before,
                                      getattr(content, "unknown_lines", None)))
            if len(rows):
                insert_arrow(con, TRACES_TABLE, rows.to_arrow())
            if live is None:
                end_run(con, run_id)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    finally:
        con.close()
        try:
            # The folder of the batch file the insert went through: empty now (an empty
            # .kvscope-tmp was once left beside the store after every ingest).
            batch_folder(db).rmdir()
        except OSError:
            pass  # absent, or files of another process (the next open_store removes those)
    return IngestResult(run_id, label, tuple(added), joined)


__all__ = ["KINDS", "IngestResult", "Ingested", "Kind", "Parsed", "detect", "ingest"]
