"""Shared fixtures: real DuckDB stores in tmp_path (seeded generators live in the packages:
``kvscope.emulator.workloads``, ``kvscope.emulator.simulator``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """Path of a store file that does not exist yet."""
    return tmp_path / "store.duckdb"


@pytest.fixture(autouse=True, scope="session")
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep what kvscope creates under the user's state directory (the proxy's boundary hash
    key) in a temporary folder, for this process and the servers tests start."""
    previous = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if previous is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = previous


@pytest.fixture(scope="session")
def chdb_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one chdb data folder of this test process (chdb allows one folder per process); each
    test module uses a database of its own in it."""
    return tmp_path_factory.mktemp("chdb")
