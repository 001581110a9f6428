"""Shared fixtures: real DuckDB stores in tmp_path (seeded generators live in the packages:
``kvscope.emulator.workloads``, ``kvscope.emulator.simulator``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """Path of a store file that does not exist yet."""
    return tmp_path / "store.duckdb"
