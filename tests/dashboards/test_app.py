"""The dashboard without a browser: page contents, filters, caching, empty and live stores."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from dash import dcc

from kvscope.analysis.sources import evidence_table
from kvscope.dashboards.app import DashboardServer, create_app, selection
from kvscope.dashboards.data import DashboardData, Filters, open_data
from kvscope.dashboards.pages import (
    compare,
    conversations,
    missed,
    overview,
    pages,
    retention,
    task_time,
    whatif,
)
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic
from kvscope.store.database import open_store
from kvscope.store.writer import StoreWriter


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[SimulationResult]]:
    db = tmp_path_factory.mktemp("app") / "runs.duckdb"
    workload = synthetic.generate(conversations=4, seed=5)
    results = [simulate(workload, db, SimulationSettings(
        profile="tiny", label=label, prefill_bidirectional_kv_xfer=on,
        decode_bidirectional_kv_xfer=on, seed=seed))
        for label, on, seed in (("feature ON", True, 1), ("feature OFF", False, 2))]
    return db, results


def graphs(children: Any) -> dict[str, Any]:
    """Every dcc.Graph under ``children`` by id."""
    found: dict[str, Any] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list | tuple):
            for n in node:
                walk(n)
        elif isinstance(node, dcc.Graph):
            found[getattr(node, "id")] = getattr(node, "figure")  # noqa: B009
        elif hasattr(node, "children"):
            walk(node.children)
    walk(children)
    return found


def texts(children: Any) -> str:
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, list | tuple):
            for n in node:
                walk(n)
        elif hasattr(node, "children"):
            walk(node.children)
    walk(children)
    return " ".join(out)


def test_every_page_has_figures_with_data(simulated: tuple[Path, list[SimulationResult]]) -> None:
    data = open_data(simulated[0])
    pick = conversations.options(data, Filters())[0][0]["value"]
    contents = {
        "overview": overview.content(data, Filters()),
        "missed": missed.content(data, Filters()),
        "retention": retention.content(data, Filters()),
        "task": task_time.content(data, Filters()),
        "whatif": whatif.content(data, Filters(), None, None),
        "compare": compare.content(data, Filters(), None, None),
        "conversation": conversations.content(data, Filters(), pick),
    }
    for name, children in contents.items():
        figs = graphs(children)
        assert figs, name
        for fig_id, fig in figs.items():
            assert fig.data, (name, fig_id)
    assert "recommended" in texts(contents["whatif"]).lower() or \
        "recommendation" in texts(contents["whatif"]).lower()
    data.close()


def test_run_filter_narrows_results_and_is_cached(
        simulated: tuple[Path, list[SimulationResult]]) -> None:
    data = open_data(simulated[0])
    on = simulated[1][0].run_id
    every = data.result("reuse_rate", None, Filters())
    only = data.result("reuse_rate", None, Filters(runs=(on,)))
    assert every.frame is not None and only.frame is not None
    assert set(every.frame["run_id"]) == {r.run_id for r in simulated[1]}
    assert set(only.frame["run_id"]) == {on}
    # Same filters, same version: the very same frame (cached), not a rebuild.
    assert data.result("reuse_rate", None, Filters(runs=(on,))).frame is only.frame
    # Every run ticked is the unfiltered selection (shares its cache).
    assert selection(data, [r.run_id for r in simulated[1]], None, None, [0, 5], 5) == Filters()
    data.close()


def test_time_engine_and_conversation_filters_select_turns(
        simulated: tuple[Path, list[SimulationResult]]) -> None:
    data = open_data(simulated[0])
    ledger = data.ledger()
    late = data.ledger(Filters(start_s=60.0))
    assert 0 < late.height < ledger.height
    conversation = ledger["conversation_id"][0]
    one = data.ledger(Filters(conversation=conversation))
    assert set(one["conversation_id"]) == {conversation}
    assert data.ledger(Filters(engine="no-such-engine")).is_empty()
    data.close()


def test_conversation_outcomes_match_ground_truth(
        simulated: tuple[Path, list[SimulationResult]]) -> None:
    data = open_data(simulated[0])
    run = simulated[1][0]
    truth = sorted((t.turn_index, t.outcome) for t in run.truth
                   if t.conversation_id == run.truth[0].conversation_id)
    children = conversations.content(
        data, Filters(), conversations.pick_value(run.run_id, run.truth[0].conversation_id))
    labels = [li.children for li in _find(children, "conversation-outcomes").children]
    assert labels == [f"turn {t}: {o}" for t, o in truth]
    data.close()


def _find(node: Any, id_: str) -> Any:
    if getattr(node, "id", None) == id_:
        return node
    children = node if isinstance(node, list | tuple) else getattr(node, "children", None)
    if isinstance(children, list | tuple):
        for child in children:
            hit = _find(child, id_)
            if hit is not None:
                return hit
    elif children is not None and not isinstance(children, str):
        return _find(children, id_)
    return None


def test_empty_store_says_what_is_missing(tmp_path: Path) -> None:
    db = tmp_path / "empty.duckdb"
    open_store(db).close()
    data = open_data(db)
    children = overview.content(data, Filters())
    text = texts(children)
    assert "no turns stored yet" in text
    assert "no engine hooks: transfer times not measured" in text
    for fig in graphs(children).values():
        notes = " ".join(a.text for a in fig.layout.annotations)
        assert "not measured" in notes or "no data" in notes
    assert graphs(retention.content(data, Filters()))
    assert "no vLLM /metrics snapshot in these runs" in text
    data.close()


def test_overview_sets_vllms_counters_beside_the_ledger(tmp_path: Path) -> None:
    from tests.collector.test_ingest_vllm_metrics import _run

    _run(tmp_path, external=900)  # ingests a run with a prefill /metrics snapshot
    data = open_data(tmp_path / "run.duckdb")
    try:
        found = _find(overview.content(data, Filters()), "overview-reconciliation")
        assert found is not None
        text = texts([found])
        assert "d2p_tokens_scheduled" in text and "d2p_tokens_reused" in text
    finally:
        data.close()


def test_source_table_names_missing_hooks() -> None:
    ledger = pl.DataFrame({"turn_ms": [1.0, 2.0], "ttft_ms": [1.0, None],
                           "decision": [None, None]})
    table = evidence_table(ledger, None)
    row = dict(zip(table["source"], table["missing"], strict=True))
    assert row["engine hooks: reuse decisions"].startswith("no engine hooks")
    assert row["first-token times"] == ""
    assert row["GPU memory samples"].startswith("no GPU sampler")


def test_live_writer_refreshes_when_rows_arrive(tmp_path: Path) -> None:
    db = tmp_path / "live.duckdb"
    workload = synthetic.generate(conversations=2, seed=9)
    simulate(workload, db, SimulationSettings(profile="tiny", label="first", seed=1))
    writer = StoreWriter(open_store(db))
    try:
        data = open_data(writer, refresh_s=0.0)
        before = data.version()
        assert data.ledger().height > 0
        # Rows written through the live writer change the version, and the next read sees them.
        ledger_rows = data.ledger().height
        arrow = writer.connection.cursor().sql(
            "SELECT * FROM otel_traces LIMIT 5").to_arrow_table()
        assert writer.submit_traces(arrow)
        assert writer.flush(10)
        assert data.version() != before
        assert data.ledger().height >= ledger_rows
    finally:
        writer.close()


def test_server_serves_layout_and_pages_without_cdn(
        simulated: tuple[Path, list[SimulationResult]]) -> None:
    app = create_app(simulated[0])
    assert {p.title for p in pages()} == {"Overview", "Conversations", "Missed reuse",
                                          "Retention & memory", "TTFT vs task time",
                                          "What-if", "Compare"}
    with DashboardServer(app, "127.0.0.1", 0) as server:
        assert server.host == "127.0.0.1"
        index = urllib.request.urlopen(server.url + "/", timeout=30).read().decode()
        # Nothing is fetched from elsewhere: no script or stylesheet with an absolute URL (a
        # random id in the page may well spell "cdn").
        assert not re.findall(r'(?:src|href)="(?:https?:)?//', index)
        assert "_dash-component-suites" in index
        layout = json.loads(urllib.request.urlopen(server.url + "/_dash-layout",
                                                   timeout=30).read())
        assert "filter-runs" in json.dumps(layout)


def _stored_ledger_reads(source: Path, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """A copy of ``source`` with its ledger stored (``kvscope ledger``), and the list every
    read of the stored ledger's columns is recorded in ("(every column)" for all)."""
    import shutil

    from kvscope import cli
    from kvscope.analysis import ledger_units

    db = tmp_path / "stored.duckdb"
    shutil.copy(source, db)
    assert cli.main(["ledger", str(db)]) == 0
    asked: list[str] = []
    frame = ledger_units.StoredLedger.frame

    def recorded(self: ledger_units.StoredLedger, columns: Any = None) -> pl.DataFrame:
        asked.extend(["(every column)"] if columns is None else columns)
        return frame(self, columns)

    monkeypatch.setattr(ledger_units.StoredLedger, "frame", recorded)
    return db, asked


def test_filter_options_read_a_few_ledger_columns_not_the_whole_ledger(
        simulated: tuple[Path, list[SimulationResult]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs, engines, conversations and the time span (every page's filter options) read their
    few columns of a stored ledger, where they read the whole ``ledger`` analysis (every
    column: ~7.5 GiB at 10M turns), with the options the whole ledger gives."""
    db, asked = _stored_ledger_reads(simulated[0], tmp_path, monkeypatch)
    data = open_data(db)
    try:
        ids = set(data.runs()["run_id"].to_list())
        engines = data.engines()
        conversations = data.conversations(Filters())
        span = data.time_span_s()
        assert set(asked) == {"run_id", "prefill_engine", "decode_engine", "conversation_id",
                              "arrival", "end"}
        whole = data.ledger()  # the listing: every column
        assert "(every column)" in asked
    finally:
        data.close()
    assert ids == set(whole["run_id"].to_list())
    assert engines == sorted({v for c in ("prefill_engine", "decode_engine")
                              for v in whole[c].unique().to_list() if v})
    assert conversations.equals(whole.group_by("run_id", "conversation_id").agg(
        pl.len().alias("turns")).sort("run_id", "conversation_id"))
    assert span == whole.group_by("run_id").agg(
        ((pl.col("end").max() - pl.col("arrival").min()).dt.total_nanoseconds() / 1e9)
        .alias("s"))["s"].max()


def test_a_selection_reads_the_columns_its_analyses_name(
        simulated: tuple[Path, list[SimulationResult]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A filtered selection's analyses read their columns (and the filters') from the stored
    ledger, not every column, and give what they give over the whole selection."""
    db, asked = _stored_ledger_reads(simulated[0], tmp_path, monkeypatch)
    names = ("reuse_rate", "miss_causes", "task_time", "ttft_windows", "outcome_windows")
    first = open_data(db)
    try:
        span = first.time_span_s()
        assert span
        selections = [Filters(engine=first.engines()[0], start_s=0.0, end_s=span / 2),
                      Filters(runs=(simulated[1][0].run_id,), conversation=first.conversations(
                          Filters())["conversation_id"][0])]
        by_columns = {(n, f): first.result(n, None, f) for n in names for f in selections}
    finally:
        first.close()
    assert asked and "(every column)" not in asked
    second = open_data(db)
    try:
        for f in selections:
            second.context(f).ledger()  # the whole selection first: analyses select from it
        whole = {(n, f): second.result(n, None, f) for n in names for f in selections}
    finally:
        second.close()
    assert "(every column)" in asked
    for key, result in by_columns.items():
        assert result.frame is not None and whole[key].frame is not None, key
        assert result.frame.equals(whole[key].frame), key
    for f in selections:  # selections with turns in them
        frame = by_columns["reuse_rate", f].frame
        assert frame is not None and frame["turns"].sum() > 0


def test_the_overview_and_missed_pages_read_their_few_ledger_columns(
        simulated: tuple[Path, list[SimulationResult]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The overview (the landing page) and missed-reuse pages read the ledger columns they show
    (turn count, freshness, the invalid-KV alarm, the window width), not the whole listing
    (every column: ~7.5 GiB at 10M turns), and show what the listing gives them."""
    from kvscope.dashboards.pages import missed, overview

    db, asked = _stored_ledger_reads(simulated[0], tmp_path, monkeypatch)
    selections = [Filters(), Filters(runs=(simulated[1][0].run_id,))]

    def pages() -> list[str]:
        data = open_data(db)
        try:
            return [re.sub(r"data read at \S+", "", repr(page.content(data, f)))
                    for page in (overview, missed) for f in selections]
        finally:
            data.close()

    narrow = pages()
    assert asked and "(every column)" not in asked
    assert "overview-freshness" in narrow[0] and "last turn ended" in narrow[0]
    ledger = DashboardData.ledger
    monkeypatch.setattr(DashboardData, "ledger",
                        lambda self, filters=None, columns=None: ledger(self, filters))
    assert pages() == narrow
    assert "(every column)" in asked
