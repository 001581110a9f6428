"""What-if: the vectorised replay against the reuse model, against the simulator, the cost fit.

Three levels of evidence:

* **model equivalence** (hypothesis): conversations are driven through the real
  :mod:`kvscope.emulator.reuse_model` objects (prefill, decode, fabric) and vLLM's router at an
  observed setting and at a target setting; the replay of the observed run at the target must
  equal the target run turn by turn (tokens, failures, GiB·s), exactly.
* **simulator** runs where the answer is known by construction (all tool waits 100 s; a
  threshold above every pull) and runs with random waits: the what-if from one run must equal the
  simulator re-run at the other setting. Tolerance: reused tokens, pulled tokens, failed turns
  and retained GiB·s exactly (the simulator's own rules, gaps recorded to the nanosecond); TTFT
  percentiles within 2 % (the cost model is fitted, and a failed turn changes which turns have a
  first token).
* **cost fit**: a known linear model is recovered from noisy points and from simulator spans.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope import cli, semconv
from kvscope.analysis import cost_fit, whatif
from kvscope.analysis.registry import AnalysisContext, AnalysisError, run
from kvscope.emulator.ground_truth import account_turn
from kvscope.emulator.reuse_model import (
    DecodeNode,
    Fabric,
    NodeConfig,
    PrefillNode,
)
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, simulate
from kvscope.emulator.tokens import BlockSeq
from kvscope.emulator.workloads import synthetic
from kvscope.emulator.workloads.model import Workload
from kvscope.reuse.params import STATUS_STOPPED, remote_num_tokens
from kvscope.reuse.router import ConversationRouter, prefill_params

BS = 16
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)

# --- the reuse model, driven turn by turn ------------------------------------------------------


def _seq(stream_id: int, tokens: int) -> BlockSeq:
    # One token stream per conversation: block i has id stream_id * 10^6 + i, so equal ids at
    # equal positions mean an equal prefix (what block hashing gives).
    ids = tuple(stream_id * 1_000_000 + i for i in range(tokens // BS))
    return BlockSeq(ids, tokens, (), BS)


def drive(conversations: list[list[tuple[float, int, int]]], ttl: float, threshold: int,
          router_ttl: float) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Run conversations of (gap, new tokens, output tokens) through the model objects.

    Returns a ledger-shaped frame (the columns the what-if reads, as the ledger would report
    them) and the retention spans, exactly as the emulator's hooks would record them.
    """
    rows: list[dict[str, Any]] = []
    spans: list[dict[str, Any]] = []
    for ci, turns in enumerate(conversations):
        fabric = Fabric()
        decode = DecodeNode(NodeConfig(
            engine_id="decode-0", side_channel_host="10.0.1.1", bidirectional_kv_xfer=True,
            decoder_kv_blocks_ttl=ttl, kv_bytes_per_token=1, block_size=BS,
            clock_offset_s=1234.5))
        fabric.register(decode, hosts=("decode.local",))
        prefill = PrefillNode(NodeConfig(
            engine_id="prefill-0", bidirectional_kv_xfer=True, kv_recompute_threshold=threshold,
            decoder_kv_blocks_ttl=ttl, kv_bytes_per_token=1, block_size=BS), fabric)
        clock = [0.0]
        router = ConversationRouter(router_ttl, clock=lambda c=clock: c[0])
        conv = f"c{ci}"
        t = end = 0.0
        total = 0  # prompt + output of the previous turn
        returned = True
        for k, (gap, new, out) in enumerate(turns, start=1):
            t = end + gap if k > 1 else 0.0
            clock[0] = t
            prompt_tokens = total + new
            lookup = router.lookup(conv)
            params = prefill_params(lookup)
            result = prefill.prefill(f"p-{ci}-{k}", _seq(ci, prompt_tokens), params, t)
            # What decode holds after a stop token (the async scheduler, vLLM's default).
            reusable = min(remote_num_tokens(total), prompt_tokens) if k > 1 else 0
            acct = account_turn(k, reusable, result, router_lookup=lookup.result,
                                decode_returned_params=returned)
            failed = result.errored or result.stalled
            end = t + 1.0
            d_rid = f"d-{ci}-{k}"
            returned = False
            if not failed:
                clock[0] = end
                retention, back = decode.finish_request(
                    d_rid, _seq(ci, prompt_tokens + out), STATUS_STOPPED, end)
                if back is not None and retention is not None:
                    router.put(conv, back, "decode.local")
                    returned = True
            transfer = result.transfer
            rows.append({
                "run_id": "r", "conversation_id": conv, "turn_index": k,
                "arrival": EPOCH + timedelta(seconds=t), "end": EPOCH + timedelta(seconds=end),
                "decode_request_id": None if failed else d_rid,
                "tool_wait_s": gap if k > 1 else None,
                "offered_tokens": result.decision.remote_offered_tokens if lookup.params else None,
                "prompt_tokens": prompt_tokens, "output_tokens": out,
                "router_entry_age_s": lookup.age_s, "router_lookup": lookup.result,
                "outcome": acct.outcome, "decision": result.decision.decision,
                "d2p_status": transfer.status if transfer is not None else None,
                "to_pull_tokens": result.decision.tokens_to_pull,
                "prefill_bidirectional": True, "errored": failed,
                "reusable_tokens": reusable, "local_hit_tokens": acct.local_hit_tokens,
                "remote_reused_tokens": acct.remote_reused_tokens, "ttft_ms": None,
                "threshold_tokens": threshold,
            })
            total = prompt_tokens + out
        decode.reap(end + ttl + 1.0)
        for r in decode.released:
            spans.append({
                "run_id": "r", "request_id": r.request_id, "size_bytes": r.bytes,
                "tokens": r.tokens, "ttl_s": r.ttl_s, "reason": r.release_reason,
                "held_s": r.held_s,
            })
    ledger = pl.DataFrame(rows).with_columns(
        pl.col("arrival").dt.cast_time_unit("ns"), pl.col("end").dt.cast_time_unit("ns"),
        pl.col("ttft_ms").cast(pl.Float64), pl.col("tool_wait_s").cast(pl.Float64),
        pl.col("router_entry_age_s").cast(pl.Float64),
        pl.col("offered_tokens").cast(pl.Int64), pl.col("d2p_status").cast(pl.String),
        pl.col("decode_request_id").cast(pl.String),
    )
    retentions = pl.DataFrame(spans, schema={
        "run_id": pl.String, "request_id": pl.String, "size_bytes": pl.Int64,
        "tokens": pl.Int64, "ttl_s": pl.Float64, "reason": pl.String, "held_s": pl.Float64})
    return ledger, retentions


def _replayed(ledger: pl.DataFrame, retentions: pl.DataFrame, ttl: float, threshold: int,
              router_ttl: float) -> pl.DataFrame:
    turns = whatif.timeline(ledger, retentions)
    return whatif.replay(turns.lazy(), ttl, threshold, router_ttl).collect()


def _gib_s(replayed: pl.DataFrame) -> float:
    prev = (replayed["prev_ret_bytes"].cast(pl.Float64) * replayed["w_prev_held_s"]).sum()
    tail = (replayed["tail_ret_bytes"].cast(pl.Float64) * replayed["w_tail_held_s"]).sum()
    return float(prev) + float(tail)


# Gaps include the boundaries: TTL − 5 s exactly (declined), just under, and the router TTL.
GAPS = [1.0, 30.0, 54.75, 55.0, 55.25, 100.0, 114.75, 115.0, 200.0, 449.5, 450.0, 474.75,
        475.0, 480.0, 600.0]
TTLS = [60.0, 120.0, 480.0]
THRESHOLDS = [0, 64, 256]
ROUTER_TTLS = [100.0, 450.0, 1e9]
conversations_st = st.lists(
    st.lists(st.tuples(st.sampled_from(GAPS), st.integers(1, 400), st.integers(1, 300)),
             min_size=2, max_size=7),
    min_size=1, max_size=3)


def _assert_same(replayed: pl.DataFrame, target: pl.DataFrame, target_ret: pl.DataFrame) -> None:
    later = replayed.filter(pl.col("later"))
    truth = target.filter(pl.col("turn_index") >= 2)
    assert later["w_remote"].to_list() == truth["remote_reused_tokens"].to_list()
    assert later["w_local"].to_list() == truth["local_hit_tokens"].to_list()
    assert replayed["w_errored"].to_list() == target["errored"].to_list()
    expected = float((target_ret["size_bytes"].cast(pl.Float64) * target_ret["held_s"]).sum())
    assert _gib_s(replayed) == pytest.approx(expected, rel=1e-12, abs=1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations_st, st.sampled_from(THRESHOLDS), st.sampled_from(TTLS),
       st.sampled_from(THRESHOLDS), st.sampled_from(ROUTER_TTLS))
def test_replay_of_a_fully_observed_run_equals_the_model_at_any_setting(
        conversations: list[list[tuple[float, int, int]]], observed_threshold: int, ttl: float,
        threshold: int, router_ttl: float) -> None:
    # Observed with every handle in time (no declined read, no stale router entry): what the
    # model does at the target setting follows from the observed run alone.
    ledger, retentions = drive(conversations, 10_000.0, observed_threshold, 1e9)
    target, target_ret = drive(conversations, ttl, threshold, router_ttl)
    _assert_same(_replayed(ledger, retentions, ttl, threshold, router_ttl), target, target_ret)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations_st, st.sampled_from(TTLS), st.sampled_from(THRESHOLDS),
       st.sampled_from(ROUTER_TTLS))
def test_replay_at_the_observed_setting_reproduces_the_observed_run(
        conversations: list[list[tuple[float, int, int]]], ttl: float, threshold: int,
        router_ttl: float) -> None:
    # Failed reads, stale router entries and the turns after a failure included.
    ledger, retentions = drive(conversations, ttl, threshold, router_ttl)
    _assert_same(_replayed(ledger, retentions, ttl, threshold, router_ttl), ledger, retentions)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(conversations_st, min_size=1, max_size=3), st.sampled_from(TTLS),
       st.sampled_from(THRESHOLDS), st.sampled_from(ROUTER_TTLS))
def test_the_timeline_derived_a_slice_at_a_time_is_the_timeline_derived_whole(
        runs: list[list[list[tuple[float, int, int]]]], ttl: float, threshold: int,
        router_ttl: float) -> None:
    # Several runs, failed reads and expired handles: slices cut conversations anywhere, and a
    # turn's previous decision is derived from the turn before it (two rows back).
    ledgers, handles = [], []
    for index, conversations in enumerate(runs):
        ledger, retentions = drive(conversations, ttl, threshold, router_ttl)
        ledgers.append(ledger.with_columns(pl.lit(f"r{index}").alias("run_id")))
        handles.append(retentions.with_columns(pl.lit(f"r{index}").alias("run_id")))
    ledger, retentions = pl.concat(ledgers), pl.concat(handles)
    whole = whatif.timeline(ledger, retentions, slice_rows=ledger.height)
    assert whole.height == ledger.height
    for rows in (1, 2, 3, 5):
        sliced = whatif.timeline(ledger, retentions, slice_rows=rows)
        assert sliced.rechunk().equals(whole), rows


def test_a_streak_of_late_turns_fails_every_other_turn() -> None:
    # Every gap is past the TTL: turn 2 fails, so turn 3 has no offer (computes), turn 4 fails…
    conversation = [(0.0, 500, 100)] + [(100.0, 200, 100)] * 5
    ledger, retentions = drive([conversation], 10_000.0, 0, 1e9)
    replayed = _replayed(ledger, retentions, 60.0, 0, 1e9)
    assert replayed["w_errored"].to_list() == [False, True, False, True, False, True]
    target, _ = drive([conversation], 60.0, 0, 1e9)
    assert target["errored"].to_list() == replayed["w_errored"].to_list()


# --- simulator: known by construction ---------------------------------------------------------


def _workload(think_p50: float, think_p90: float, seed: int = 4) -> Workload:
    return synthetic.generate(
        seed=seed, conversations=10, turns_p50=6, max_turns=8, system_prompt_tokens=512,
        new_input_tokens_p50=300, think_time_p50_s=think_p50, think_time_p90_s=think_p90,
        reset_probability=0.0, subagent_probability=0.0)


def _sim(workload: Workload, path: Path, **overrides: Any) -> SimulationResult:
    return simulate(workload, path, SimulationSettings(profile="qwen3-32b", **overrides))


def _truth(result: SimulationResult) -> dict[str, Any]:
    later = [t for t in result.truth if t.turn_index > 1]
    ttfts = sorted(t.ttft_ms for t in result.truth if t.ttft_ms is not None)
    return {
        "reusable": sum(t.reusable_tokens for t in later),
        "reused": sum(t.local_hit_tokens + t.remote_reused_tokens for t in later),
        "remote": sum(t.remote_reused_tokens for t in later),
        "errored": sum(t.errored for t in later),
        "ttft_p50": pl.Series(ttfts).quantile(0.5, "linear"),
        "ttft_p90": pl.Series(ttfts).quantile(0.9, "linear"),
    }


def _retained(path: Path) -> float:
    with AnalysisContext.open(path) as ctx:
        frame = whatif.shape_retentions(ctx.frame(whatif.QUERIES["retentions"]))
    return float((frame["size_bytes"].cast(pl.Float64) * frame["held_s"]).sum()) / whatif.GIB


def _whatif(path: Path, **params: Any) -> pl.DataFrame:
    with AnalysisContext.open(path) as ctx:
        return run(ctx, "whatif", params)


def _row(table: pl.DataFrame, ttl: float, threshold: int) -> dict[str, Any]:
    rows = table.filter((pl.col("source") == whatif.SOURCE_REPLAY)
                        & (pl.col("decoder_kv_blocks_ttl") == ttl)
                        & (pl.col("kv_recompute_threshold") == threshold))
    assert rows.height == 1
    return rows.row(0, named=True)


def _agrees(predicted: dict[str, Any], truth: dict[str, Any], retained: float) -> None:
    assert predicted["reused_tokens"] == truth["reused"]
    assert predicted["remote_tokens"] == truth["remote"]
    assert predicted["turns_errored"] == truth["errored"]
    # The same denominator (the workload's reusable tokens) gives the same rate.
    assert predicted["reused_tokens"] / truth["reusable"] == truth["reused"] / truth["reusable"]
    assert predicted["retained_gib_s"] == pytest.approx(retained, rel=1e-9)
    assert predicted["ttft_p50_ms"] == pytest.approx(truth["ttft_p50"], rel=0.02)
    assert predicted["ttft_p90_ms"] == pytest.approx(truth["ttft_p90"], rel=0.02)


def test_tool_waits_of_100_s_reuse_everything_at_480_and_nothing_remote_at_60(
        tmp_path: Path) -> None:
    workload = _workload(100.0, 100.0)
    observed = _sim(workload, tmp_path / "480.duckdb", decoder_kv_blocks_ttl=480.0)
    table = _whatif(tmp_path / "480.duckdb", ttl=[60, 480], threshold=[64])
    at_480, at_60 = _row(table, 480.0, 64), _row(table, 60.0, 64)
    assert at_480["is_observed_setting"] and not at_60["is_observed_setting"]
    assert at_480["remote_tokens"] == _truth(observed)["remote"] > 0
    assert at_480["turns_errored"] == 0
    # 100 s + 5 s margin ≥ 60 s: every pull is declined and fails its turn.
    assert at_60["remote_tokens"] == at_60["turns_pulled"] == 0
    assert at_60["turns_errored"] > 0
    short = _sim(workload, tmp_path / "60.duckdb", decoder_kv_blocks_ttl=60.0)
    assert _truth(short)["remote"] == 0
    _agrees(at_60, _truth(short), _retained(tmp_path / "60.duckdb"))
    _agrees(at_480, _truth(observed), _retained(tmp_path / "480.duckdb"))


def test_a_threshold_above_every_pull_pulls_nothing(tmp_path: Path) -> None:
    workload = _workload(10.0, 60.0)
    _sim(workload, tmp_path / "on.duckdb")
    table = _whatif(tmp_path / "on.duckdb", ttl=[480], threshold=[64, 10**6])
    high = _row(table, 480.0, 10**6)
    assert high["remote_tokens"] == high["turns_pulled"] == 0
    truth = _sim(workload, tmp_path / "high.duckdb", kv_recompute_threshold=10**6)
    _agrees(high, _truth(truth), _retained(tmp_path / "high.duckdb"))


@pytest.mark.parametrize("ttl", [120.0, 900.0])
def test_random_waits_predict_the_simulator_rerun(tmp_path: Path, ttl: float) -> None:
    workload = _workload(30.0, 400.0, seed=7)
    _sim(workload, tmp_path / "480.duckdb")
    predicted = _row(_whatif(tmp_path / "480.duckdb", ttl=[ttl], threshold=[64]), ttl, 64)
    rerun = _sim(workload, tmp_path / "rerun.duckdb", decoder_kv_blocks_ttl=ttl)
    _agrees(predicted, _truth(rerun), _retained(tmp_path / "rerun.duckdb"))


def test_observed_row_deltas_and_recommendation(tmp_path: Path) -> None:
    workload = _workload(30.0, 400.0, seed=7)
    _sim(workload, tmp_path / "480.duckdb")
    table = _whatif(tmp_path / "480.duckdb")
    observed = table.filter(pl.col("source") == whatif.SOURCE_OBSERVED).row(0, named=True)
    assert (observed["decoder_kv_blocks_ttl"], observed["kv_recompute_threshold"],
            observed["router_ttl"]) == (480.0, 64, 450.0)
    replays = table.filter(pl.col("source") == whatif.SOURCE_REPLAY)
    assert replays.height == 4 * 3  # default grid; the observed setting is one of its rows
    same = replays.filter(pl.col("is_observed_setting")).row(0, named=True)
    for column in ("reused_tokens", "remote_tokens", "turns_errored"):
        assert same[column] == observed[column]
    assert same["retained_gib_s"] == pytest.approx(observed["retained_gib_s"], rel=1e-9)
    assert same["ttft_p50_delta_ms"] == pytest.approx(0.0, abs=1e-9)
    assert replays["retained_gib_s_delta"].to_list() == pytest.approx(
        (replays["retained_gib_s"] - observed["retained_gib_s"]).to_list())
    best = table.filter(pl.col("recommended"))
    assert best.height == 1
    best_row = best.row(0, named=True)
    assert best_row["retained_gib_s"] <= observed["retained_gib_s"] * (1 + 1e-9)
    within = replays.filter(pl.col("retained_gib_s") <= observed["retained_gib_s"] * (1 + 1e-9))
    assert best_row["ttft_p50_ms"] == within["ttft_p50_ms"].min()
    assert "recommendation" in observed["note"]
    # A budget nothing fits: no recommendation, the trade-off is stated.
    tight = _whatif(tmp_path / "480.duckdb", budget_gib_s=1e-6)
    assert not tight["recommended"].any()
    note = tight.filter(pl.col("source") == whatif.SOURCE_OBSERVED)["note"].item()
    assert note.startswith("no setting within") and "fastest" in note


def test_without_retention_spans_retained_memory_is_not_measured(tmp_path: Path) -> None:
    workload = _workload(10.0, 60.0)
    _sim(workload, tmp_path / "off.duckdb", prefill_bidirectional_kv_xfer=False,
         decode_bidirectional_kv_xfer=False)
    table = _whatif(tmp_path / "off.duckdb", ttl=[60, 480], threshold=[64])
    assert table["retained_gib_s"].null_count() == table.height
    assert table["decoder_kv_blocks_ttl"][0] is None  # the observed TTL: not measured
    assert not table["recommended"].any()
    assert table["remote_tokens"].to_list() == [0, 0, 0]


# --- cost fit ---------------------------------------------------------------------------------


def test_least_squares_recovers_a_known_linear_model() -> None:
    import random

    rng = random.Random(1)
    n = 2000
    computed = [rng.uniform(1, 30_000) for _ in range(n)]
    pulled = [rng.choice([0, 0, rng.randint(1, 20_000)]) for _ in range(n)]
    flag = [1.0 if p else 0.0 for p in pulled]
    y = [40.0 + 0.025 * c + f * -12.0 + 0.004 * p + rng.gauss(0, 2.0)
         for c, p, f in zip(computed, pulled, flag, strict=True)]
    frame = pl.DataFrame({"y": y, "computed": computed, "pull_flag": flag, "pulled": pulled})
    fit = cost_fit.least_squares(frame, "y", ["computed", "pull_flag", "pulled"])
    assert fit is not None and fit.n == n
    coefs = fit.coefficients
    assert coefs["intercept"] == pytest.approx(40.0, abs=0.5)
    assert coefs["computed"] == pytest.approx(0.025, rel=1e-3)
    assert coefs["pull_flag"] == pytest.approx(-12.0, abs=0.5)
    assert coefs["pulled"] == pytest.approx(0.004, rel=1e-2)
    assert fit.residual_stdev == pytest.approx(2.0, rel=0.1)
    assert fit.r2 is not None and fit.r2 > 0.99
    # A term that never varies is not measured: absent, not 0.
    none_pulled = frame.with_columns(pl.lit(0.0).alias("pull_flag"), pl.lit(0).alias("pulled"))
    partial = cost_fit.least_squares(none_pulled, "y", ["computed", "pull_flag", "pulled"])
    assert partial is not None and set(partial.coefficients) == {"intercept", "computed"}
    assert cost_fit.least_squares(frame.head(1), "y", ["computed"]) is None


def test_cost_fit_recovers_the_simulators_tiny_profile(tmp_path: Path) -> None:
    workload = _workload(10.0, 60.0)
    simulate(workload, tmp_path / "tiny.duckdb", SimulationSettings(profile="tiny"))
    with AnalysisContext.open(tmp_path / "tiny.duckdb") as ctx:
        fits = {r["fit"]: r for r in run(ctx, "cost_fit").iter_rows(named=True)}
    prefill, wire = fits["prefill"], fits["transfer"]
    # tiny: prefill = 2 ms + 0.01 ms/token, no pull overhead; wire = 0.5 ms + bytes / 1e6 B/ms.
    assert prefill["intercept_ms"] == pytest.approx(2.0, abs=0.01)
    assert prefill["slope"] == pytest.approx(0.01, rel=1e-3)
    assert prefill["pull_fixed_ms"] == pytest.approx(0.0, abs=0.01)
    assert prefill["r2"] > 0.999 and prefill["n"] > 40
    assert wire["intercept_ms"] == pytest.approx(0.5, abs=1e-3)
    assert wire["slope"] == pytest.approx((1 << 20) / 1e6, rel=1e-3)
    assert wire["residual_stdev_ms"] < 1e-3
    assert fits["bytes_per_token"]["slope"] >= 1024  # whole blocks: at least 1 KiB per token


# --- CLI entry point --------------------------------------------------------------------------


def test_main_whatif_prints_json_csv_and_a_table(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "s.duckdb"
    result = _sim(_workload(10.0, 60.0), db)
    assert cli.main(["whatif", str(db), "--ttl", "60,480", "--threshold", "64",
                     "--runs", result.run_id, "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["source"] for r in records] == ["observed", "replay", "replay"]
    assert all(r["run_id"] == result.run_id for r in records)
    assert not any(isinstance(v, float) and math.isnan(v) for r in records for v in r.values())
    assert cli.main(["whatif", str(db), "--ttl", "60", "--threshold", "0,64",
                     "--router-ttl", "100,450", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(",")[:3] == ["run_id", "source", "decoder_kv_blocks_ttl"]
    # header, observed, 1 × 2 × 2 grid, and the observed setting (480 s, 64, 450 s) added
    assert len(lines) == 1 + 1 + 4 + 1
    assert cli.main(["whatif", str(db), "--ttl", "480", "--threshold", "64"]) == 0
    out = capsys.readouterr().out
    assert "token_reuse_rate" in out and cost_fit.PREFILL_FORMULA in out


def test_semconv_values_name_the_replayed_paths() -> None:
    # The replay's path labels reuse the decision values the spans carry.
    assert {semconv.DECISION_PULL, semconv.DECISION_NO_OFFER} <= set(semconv.DECISIONS)


@pytest.mark.parametrize(("params", "why"), [
    ({"ttl": ["nan"]}, "is not within"), ({"ttl": ["inf"]}, "is not within"),
    ({"ttl": ["1e308"]}, "is not within"), ({"threshold": ["-1"]}, "is not within"),
    ({"ttl": ["x"]}, "is not a number"),
    ({"ttl": [str(t) for t in range(1, 401)], "threshold": [str(h) for h in range(25)]},
     "10000 settings asked"),
])
def test_bad_or_unbounded_settings_are_refused_by_name(
        tmp_path: Path, params: dict[str, list[str]], why: str) -> None:
    """The dashboard's callback passes typed text through: every value is checked, the grid is
    capped (one request of 400 x 25 once ran for minutes past 8 GiB)."""
    db = tmp_path / "w.duckdb"
    simulate(synthetic.generate(conversations=2, seed=1), db,
             SimulationSettings(profile="tiny", seed=1))
    with AnalysisContext.open(db) as ctx, pytest.raises(AnalysisError, match=why):
        run(ctx, "whatif", params)
