"""The reader's one seam: every query path has the time limit and the error translation."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.errors import StoreError
from kvscope.store import open_store
from kvscope.store.reader import StoreReader

# A query that runs for minutes unless interrupted.
SLOW = "SELECT count(*) FROM range(10000000000) a"


@pytest.fixture
def reader(tmp_path: Path) -> StoreReader:
    path = tmp_path / "r.duckdb"
    open_store(path).close()
    return StoreReader.open(path, time_limit_s=0.3)


@pytest.mark.parametrize("how", ["execute", "frame", "rows"])
def test_every_query_path_is_interrupted_at_the_time_limit(reader: StoreReader, how: str) -> None:
    """``frame`` ran its (lazy) query outside the limit before: a slow analysis query ran on."""
    with pytest.raises(StoreError, match="exceeded the 0.3 s time limit"):
        result = getattr(reader, how)(SLOW)
        if how == "execute":
            result.fetchall()


@pytest.mark.parametrize("how", ["execute", "frame", "rows"])
def test_every_query_path_translates_duckdb_errors(reader: StoreReader, how: str) -> None:
    with pytest.raises(StoreError, match="query failed: "):
        getattr(reader, how)("SELECT * FROM no_such_table")
    assert reader.frame("SELECT ? AS x", [7])["x"].to_list() == [7]
