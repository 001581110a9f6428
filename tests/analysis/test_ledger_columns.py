"""Analyses read only the ledger columns they name, and answer as they do on the whole ledger.

Each analysis module says which of the ledger's columns it reads (``LEDGER_COLUMNS``), and a
stored ledger (``kvscope ledger``'s table) is read a few columns at a time as analyses ask:
at 10M turns the whole ledger is ~5 GiB in polars. A column an analysis reads but did not name
would fail it (polars names the column) or, where code asks whether a column is there, change
its answer: so every analysis, with its parameters' variants, is run both ways on a store with
faults, two runs to compare and a feature-OFF run, computed and stored.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from kvscope import cli
from kvscope.analysis import ledger as ledger_module
from kvscope.analysis import ledger_units, registry, reuse
from kvscope.emulator.simulator import SimulationSettings, simulate
from tests.stores import busy_workload, query, simulate_faults


def _variants(db: Path) -> list[tuple[str, dict[str, Any]]]:
    """(analysis, parameters) beyond each analysis's defaults: the groupings read other
    columns, and one run's what-if, ladder and fit take another path."""
    labels = dict(query(db, "SELECT label, run_id FROM kvscope_runs"))
    return [*(("reuse_rate", {"by": by}) for by in reuse.GROUPINGS),
            ("whatif", {"run": labels["faults"]}), ("ladder", {"run": labels["faults"]}),
            ("cost_fit", {"run": labels["plain"]}), ("cost_fit", {"run": "no such run"})]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("columns")
    computed = folder / "computed.duckdb"
    workload = busy_workload(turns_p50=5, max_turns=8)
    simulate_faults(workload, computed)
    simulate(workload, computed, SimulationSettings(profile="tiny", label="plain", seed=3))
    simulate(workload, computed, SimulationSettings(profile="tiny", label="off", seed=3,
                                                    prefill_bidirectional_kv_xfer=False,
                                                    decode_bidirectional_kv_xfer=False))
    stored = folder / "stored.duckdb"
    stored.write_bytes(computed.read_bytes())
    assert cli.main(["ledger", str(stored)]) == 0
    return {"computed": computed, "stored": stored}


class _Whole:
    """The whole ledger, whatever columns are asked for."""

    def __init__(self, frame: pl.DataFrame) -> None:
        self._frame = frame

    def frame(self, columns: object = None) -> pl.DataFrame:
        return self._frame


class WholeLedgerContext(registry.AnalysisContext):
    """Every analysis gets every ledger column (what it got before it named its own)."""

    def get(self, item: registry.Intermediate, *args: Hashable) -> Any:
        if item is not registry.LEDGER:
            return super().get(item, *args)

        def whole() -> _Whole:
            built = item.build(self)
            return _Whole(built if isinstance(built, pl.DataFrame) else built.frame())
        return self.cached(("whole", item), whole)

    def ledger(self, columns: object = None) -> pl.DataFrame:
        return super().ledger()


def _runs(kind: str, analyses: list[tuple[str, dict[str, Any]]], stores: dict[str, Path],
          context: type[registry.AnalysisContext]) -> dict[str, pl.DataFrame | str]:
    out: dict[str, pl.DataFrame | str] = {}
    with context(registry.AnalysisContext.open(stores[kind]).reader) as ctx:
        for name, params in analyses:
            key = f"{name} {sorted(params.items())}"
            try:
                out[key] = registry.run(ctx, name, params)
            except registry.AnalysisError as exc:  # an analysis that says why it cannot answer
                out[key] = f"AnalysisError: {exc}"
    return out


@pytest.mark.parametrize("kind", ["computed", "stored"])
def test_every_analysis_answers_alike_on_the_columns_it_names(stores: dict[str, Path],
                                                              kind: str) -> None:
    analyses = [(name, {}) for name in sorted(registry.analyses())] + _variants(stores[kind])
    narrow = _runs(kind, analyses, stores, registry.AnalysisContext)
    whole = _runs(kind, analyses, stores, WholeLedgerContext)
    assert narrow.keys() == whole.keys()
    answered = 0
    for key, got in narrow.items():
        expected = whole[key]
        if isinstance(expected, str) or isinstance(got, str):
            assert got == expected, key
            continue
        answered += expected.height > 0
        # Floats exact but for the last bits: a sum over another chunking of the same column.
        assert_frame_equal(got, expected, check_exact=False, rel_tol=1e-12, abs_tol=1e-12)
    assert answered >= 15, answered  # the store gives most analyses something to say


def test_a_stored_ledger_is_read_only_as_far_as_analyses_ask(stores: dict[str, Path]) -> None:
    with registry.AnalysisContext.open(stores["stored"]) as ctx:
        registry.run(ctx, "reuse_rate")
        whole = ctx.get(registry.LEDGER)
        assert isinstance(whole, ledger_units.StoredLedger)
        read = set(whole.frame([]).columns) | set(whole._columns)
        assert read <= set(reuse.LEDGER_COLUMNS), read - set(reuse.LEDGER_COLUMNS)
        assert len(read) < len(whole.frame().columns) // 3
        # The columns read apart line up: the ledger the spans give, row for row.
        computed = ledger_module.ledger(ctx.reader)
        assert_frame_equal(whole.frame(), ledger_units.categorical(computed))
        assert whole.height == computed.height


class _Unkept(registry.AnalysisContext):
    """A context whose cache keeps nothing between builds (``analysis_cache_mib`` 0)."""

    made: list[registry.AnalysisContext] = []

    def __init__(self, reader: Any) -> None:
        super().__init__(reader, cache_mib=0)
        _Unkept.made.append(self)


@pytest.mark.parametrize("kind", ["computed", "stored"])
def test_analyses_answer_alike_when_the_cache_lets_go_of_what_they_built(
        stores: dict[str, Path], kind: str) -> None:
    """Under a cache bound of 0 every intermediate, result and stored ledger column is let go
    as soon as something else is built, and built again when asked: the answers are the same."""
    analyses = [(name, {}) for name in sorted(registry.analyses())] + _variants(stores[kind])
    kept = _runs(kind, analyses, stores, registry.AnalysisContext)
    _Unkept.made.clear()
    unkept = _runs(kind, analyses, stores, _Unkept)
    (ctx,) = _Unkept.made
    assert ctx.rebuilt > 10, ctx.rebuilt  # the bound was exercised
    assert unkept.keys() == kept.keys()
    for key, got in unkept.items():
        expected = kept[key]
        if isinstance(expected, str) or isinstance(got, str):
            assert got == expected, key
            continue
        assert_frame_equal(got, expected, check_exact=False, rel_tol=1e-12, abs_tol=1e-12)


def test_the_cache_lets_the_large_least_recently_used_go_first(
        stores: dict[str, Path]) -> None:
    """Past the bound, large entries go least recently used first (a stored ledger lets go of
    its least recently used columns), small results stay while they hold under a quarter of
    it, and at 0 everything goes but the columns the last read asked for."""
    with registry.AnalysisContext.open(stores["stored"]) as ctx:
        ctx.cache_bytes = 1 << 40
        registry.run(ctx, "reuse_rate")
        registry.run(ctx, "whatif")
        whole = ctx.get(registry.LEDGER)
        assert isinstance(whole, ledger_units.StoredLedger)
        held = ctx.cached_bytes()
        assert ctx.rebuilt == 0 and held > 0
        sizes = {key: registry.size_of(value) for key, value in ctx._cache.items()}
        results = {key for key in ctx._cache if isinstance(key[0], registry.Analysis)}
        assert {key[0].name for key in results} >= {"reuse_rate", "whatif"}

        ctx.cache_bytes = held - 1  # one byte over: the oldest large entry goes, no more
        ctx.trim()
        assert held - max(sizes.values()) <= ctx.cached_bytes() < held

        small = sum(sizes[key] for key in results)
        bound = max(16 * max(sizes[key] for key in results) + 16, 4 * small + 4)
        assert held > bound  # the store's intermediates outweigh its results
        ctx.cache_bytes = bound
        ctx.trim()
        assert ctx.cached_bytes() <= bound
        assert results <= set(ctx._cache)

        ctx.cache_bytes = 0
        ctx.trim()
        # Nothing but the columns the last read asked for (its caller holds them).
        assert whole._columns and set(whole._columns) == whole._asked
        assert ctx.cached_bytes() == whole.cached_bytes()


def test_the_cache_lets_what_is_cheapest_to_build_again_go_first(
        stores: dict[str, Path]) -> None:
    """Of two entries of one size, the one whose build took less goes first, though it was used
    more recently (least recently used first would let the slow one go)."""
    import time

    frame = pl.DataFrame({"x": pl.int_range(100_000, eager=True)})
    with registry.AnalysisContext.open(stores["computed"]) as ctx:
        ctx.cache_bytes = 1 << 40
        ctx.cached("slow", lambda: (time.sleep(0.2), frame.clone())[1])
        ctx.cached("fast", frame.clone)
        ctx.cached("slow", frame.clone)  # a hit: built once, not again
        ctx.cached("fast", frame.clone)  # the most recently used now
        assert ctx.rebuilt == 0
        ctx.cache_bytes = registry.size_of(frame) * 3 // 2  # room for one
        ctx.trim()
        assert "slow" in ctx._cache and "fast" not in ctx._cache
