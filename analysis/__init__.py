"""Analyses: the per-turn reuse ledger and the registered analyses built on it."""
