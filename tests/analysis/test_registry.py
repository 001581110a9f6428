"""Every registered analysis on an empty store: an empty frame of its declared columns."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from kvscope.analysis import registry
from kvscope.analysis.registry import AnalysisError
from kvscope.store.database import open_store

# Analyses that need runs to compare, or turns to bin, and say so instead of answering.
NEEDS_RUNS = {"compare", "compare_by_prompt", "by_prompt"}
# Rows that are the published claims, present whatever the store holds.
STATIC = {"evidence"}


@pytest.fixture(scope="module")
def empty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("registry") / "empty.duckdb"
    open_store(db).close()
    return db


@pytest.mark.parametrize("name", sorted(set(registry.analyses()) - NEEDS_RUNS - STATIC))
def test_an_empty_store_gives_an_empty_frame_of_the_declared_columns(empty: Path,
                                                                       name: str) -> None:
    with registry.AnalysisContext.open(empty) as ctx:
        frame = registry.run(ctx, name)
    assert frame.is_empty()
    declared = registry.get(name).columns
    if declared:
        assert frame.schema == pl.Schema(declared)


@pytest.mark.parametrize("name", sorted(NEEDS_RUNS))
def test_an_analysis_that_needs_runs_says_so_on_an_empty_store(empty: Path, name: str) -> None:
    with registry.AnalysisContext.open(empty) as ctx, pytest.raises(AnalysisError) as error:
        registry.run(ctx, name)
    assert "\n" not in str(error.value)
