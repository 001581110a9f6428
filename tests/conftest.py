"""Shared fixtures: real DuckDB stores in tmp_path (seeded generators live in the packages:
``kvscope.emulator.workloads``, ``kvscope.emulator.simulator``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """Path of a store file that does not exist yet."""
    return tmp_path / "store.duckdb"


@pytest.fixture(scope="session")
def chdb_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one chdb data folder of this test process (chdb allows one folder per process); each
    test module uses a database of its own in it."""
    return tmp_path_factory.mktemp("chdb")
