"""Invalid reuse is shown first, as a correctness alarm: verdict, figure and overview page."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.analysis import registry
from kvscope.analysis.registry import AnalysisContext
from kvscope.analysis.verdict import verdict_sentences
from kvscope.dashboards import figures
from kvscope.dashboards.data import Filters, open_data
from kvscope.dashboards.pages import overview
from kvscope.emulator.simulator import SimulationSettings, iter_truth, simulate
from kvscope.emulator.workloads import synthetic
from kvscope.reuse import outcomes
from tests.dashboards.test_app import texts


@pytest.fixture(scope="module")
def edited(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A run whose agents reset their context often: a reset keeps the id, so KV is pulled."""
    db = tmp_path_factory.mktemp("alarm") / "alarm.duckdb"
    workload = synthetic.generate(conversations=5, seed=11, reset_probability=0.3,
                                  subagent_probability=0.0)
    result = simulate(workload, db, SimulationSettings(profile="tiny", label="resets", seed=4))
    invalid = sum(1 for t in iter_truth(result) if t["outcome"] == outcomes.REUSED_INVALID)
    assert invalid > 0  # the hazard is in the data, or the test proves nothing
    return db, invalid


def test_the_verdict_opens_with_the_alarm(edited: tuple[Path, int]) -> None:
    db, invalid = edited
    with AnalysisContext.open(db) as ctx:
        [row] = registry.run(ctx, "verdict").iter_rows(named=True)
    assert row["turns_reused_invalid"] == invalid
    sentences = verdict_sentences(row)
    assert sentences[1].startswith(f"CORRECTNESS ALARM: {invalid} later turn(s)")


def test_the_miss_causes_figure_puts_invalid_reuse_on_top(edited: tuple[Path, int]) -> None:
    db, _ = edited
    with AnalysisContext.open(db) as ctx:
        frame = registry.run(ctx, "miss_causes")
    fig = figures.miss_causes(frame)
    assert "ALARM: reused_invalid" in fig.layout.title.text
    assert list(fig.layout.yaxis.categoryarray)[-1] == outcomes.REUSED_INVALID


def test_the_overview_page_opens_with_the_alarm(edited: tuple[Path, int]) -> None:
    db, invalid = edited
    data = open_data(db)
    try:
        page = overview.content(data, Filters())
    finally:
        data.close()
    assert getattr(page[0], "id", None) == "overview-alarm" or \
        getattr(page[1], "id", None) == "overview-alarm"
    assert f"{invalid:,} turn(s) loaded decode KV" in texts(page)
