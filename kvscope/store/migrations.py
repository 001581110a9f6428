"""Schema migrations: each step upgrades a store from version N to N+1 in one transaction.

Version 1 is the first schema; there is nothing to migrate yet. A new version appends a step
here and bumps :data:`kvscope.store.schema.SCHEMA_VERSION`.
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb

from kvscope.store.schema import META_TABLE, SCHEMA_VERSION, quote

Step = Callable[[duckdb.DuckDBPyConnection], None]

# STEPS[n] upgrades version n to n + 1.
STEPS: dict[int, Step] = {}


def upgrade(con: duckdb.DuckDBPyConnection, version: int) -> None:
    """Apply every step from ``version`` up to the current schema version."""
    while version < SCHEMA_VERSION:
        step = STEPS[version]
        con.execute("BEGIN TRANSACTION")
        try:
            step(con)
            version += 1
            con.execute(
                f"UPDATE {quote(META_TABLE)} SET value = ? WHERE key = 'schema_version'",
                [str(version)],
            )
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise


__all__ = ["STEPS", "Step", "upgrade"]
