"""The store's schema version: its own module, so reading it imports no database library."""

from __future__ import annotations

__all__ = ["SCHEMA_VERSION"]

# Bumped with every change to the raw tables; migrations.py upgrades older stores to it.
SCHEMA_VERSION = 1
