"""A replicated store (tests/benchmarks/replicate.py, the 10M-turn figures of issue 20) is its
source K times over: the ledger of a store replicated x3 is the source's ledger three times,
modulo the replicas' id suffixes and time shifts, and the analyses count three times as much."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from kvscope.analysis import registry
from kvscope.store.schema import GAUGE_TABLE, RUNS_TABLE, TRACES_TABLE
from tests.benchmarks.replicate import replicate, suffix
from tests.stores import on_off_store

K = 3
_KEY = ["run_id", "conversation_id", "turn_index"]
# Ledger columns holding ids: whole ids take the suffix at the end, vLLM request ids
# (``chatcmpl-<X-Request-Id>-<8 random>``) just before vLLM's random tail.
_WHOLE_IDS = ["conversation_id", "x_request_id", "trace_id"]
_VLLM_IDS = ["prefill_request_id", "decode_request_id", "retention_id"]
_TIMES = ["arrival", "end"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    folder = tmp_path_factory.mktemp("replicate")
    source = on_off_store(folder / "source.duckdb", seed=3, conversations=4, turns_p50=5,
                          max_turns=8)
    out = replicate(source, folder / "x3.duckdb", K, gap_s=600)
    return source, folder / "x3.duckdb", out["step_ns"]


def _run_all(db: Path) -> dict[str, pl.DataFrame]:
    with registry.AnalysisContext.open(db) as ctx:
        return {a.name: registry.run(ctx, a.name) for a in registry.iter_analyses()}


@pytest.fixture(scope="module")
def results(stores: tuple[Path, Path, int]) -> tuple[dict[str, pl.DataFrame],
                                                     dict[str, pl.DataFrame]]:
    source, replicated, _ = stores
    return _run_all(source), _run_all(replicated)


def _as_replica(ledger: pl.DataFrame, replica: int, step_ns: int) -> pl.DataFrame:
    """The source ledger as replica ``replica`` of it should read (written here with string
    slicing, apart from the engine's regular expressions)."""
    sfx = suffix(replica)
    tail = 9  # "-" + vLLM's 8 random characters
    return ledger.with_columns(
        *[(pl.col(c) + sfx).alias(c) for c in _WHOLE_IDS],
        *[(pl.col(c).str.head(-tail) + sfx + pl.col(c).str.tail(tail)).alias(c)
          for c in _VLLM_IDS],
        *[(pl.col(c) + pl.duration(nanoseconds=replica * step_ns)).alias(c) for c in _TIMES],
    )


def test_the_ledger_is_the_source_ledger_three_times_over(
        stores: tuple[Path, Path, int],
        results: tuple[dict[str, pl.DataFrame], dict[str, pl.DataFrame]]) -> None:
    _, _, step_ns = stores
    original, replicated = results[0]["ledger"], results[1]["ledger"]
    assert replicated.height == K * original.height
    # The source must exercise what replication rewrites: both runs, remote reads joined by
    # request id, retained KV, earlier turns.
    assert original["run_id"].n_unique() == 2
    assert (original["outcome"] == "reused_remote").sum() > 0
    assert original["retention_id"].is_not_null().sum() > 0
    assert original["decision"].is_not_null().all()
    for column in _VLLM_IDS:  # vLLM's random tail is there to keep the suffix in front of
        assert original[column].drop_nulls().str.contains(r"-[0-9A-Za-z]{8}$").all()
    for replica in range(K):
        if replica:
            part = replicated.filter(pl.col("conversation_id").str.ends_with(suffix(replica)))
        else:
            part = replicated.filter(~pl.col("conversation_id").str.contains(r"-r\d+$"))
        assert_frame_equal(part.sort(_KEY), _as_replica(original, replica, step_ns).sort(_KEY))


def test_replicas_follow_each_other_in_time(stores: tuple[Path, Path, int],
                                            results: tuple[dict[str, pl.DataFrame],
                                                           dict[str, pl.DataFrame]]) -> None:
    _, _, step_ns = stores
    ledger = results[1]["ledger"].with_columns(
        pl.col("conversation_id").str.extract(r"-r(\d+)$").cast(pl.Int64).fill_null(0)
        .alias("replica"))
    spans = ledger.group_by("replica").agg(pl.col("arrival").min(), pl.col("end").max()).sort(
        "replica")
    assert spans.height == K
    # Each replica ends before the next begins: no engine holds two replicas' KV at once.
    assert (spans["end"].head(K - 1) < spans["arrival"].tail(K - 1)).all()
    assert step_ns % (3600 * 10**9) == 0


def test_the_analyses_count_three_times_as_much(
        results: tuple[dict[str, pl.DataFrame], dict[str, pl.DataFrame]]) -> None:
    original, replicated = results
    counts = {
        "reuse_rate": (["run_id"], ["turns", "measured_turns", "reusable_tokens",
                                    "local_tokens", "remote_tokens", "recomputed_tokens",
                                    "turns_fully_reused", "turns_unknown"],
                       ["token_reuse_rate", "turn_reuse_rate"]),
        "miss_causes": (["run_id", "outcome"], ["turns", "recomputed_tokens"], ["share"]),
        "retention_cost": (["run_id", "engine_id"],
                           ["retentions", "released_read", "released_notified", "expired",
                            "open", "gib_s_total"], ["useful_share"]),
        "outcome_engines": (["prefill_engine", "outcome"], ["turns"], []),
        "ladder": (["run_id", "step_order"], ["tokens", "turns_limited", "lost_tokens"],
                   ["rate"]),
        "evidence": (["source"], ["turns_with_it"], []),
    }
    for name, (key, tripled, same) in counts.items():
        a, b = original[name].sort(key), replicated[name].sort(key)
        assert a.height > 0, name
        assert_frame_equal(b.select(key), a.select(key), check_dtypes=False)
        for column in tripled:
            assert_frame_equal(b.select(column), a.select(pl.col(column) * K),
                               check_dtypes=False, rel_tol=1e-9)
        for column in same:
            assert_frame_equal(b.select(column), a.select(column), rel_tol=1e-9)
    # One task row per conversation: three times the conversations.
    assert replicated["task_time"].height == K * original["task_time"].height


def test_the_raw_tables_keep_their_schema_and_the_two_runs(
        stores: tuple[Path, Path, int]) -> None:
    source, replicated, _ = stores
    schemas = []
    for db in (source, replicated):
        con = duckdb.connect(str(db), read_only=True)
        try:
            schemas.append({t: con.execute(f'DESCRIBE "{t}"').fetchall()
                            for t in (TRACES_TABLE, GAUGE_TABLE, RUNS_TABLE)})
            runs = con.execute(f'SELECT count(*) FROM "{RUNS_TABLE}"').fetchall()[0][0]
        finally:
            con.close()
        assert runs == 2
    assert schemas[0] == schemas[1]
