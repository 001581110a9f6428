"""``kvscope simulate --workload sweep``: the published sweep's workload, runs, command, table."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from kvscope import published
from kvscope.analysis import registry
from kvscope.dashboards import figures
from kvscope.dashboards.report import write_report
from kvscope.emulator.simulator import SimulationSettings
from kvscope.emulator.sweeps import DEFAULT_PREFIX_TOKENS, sweep_runs
from kvscope.emulator.turn_mix import turn_mix
from kvscope.emulator.workloads import published_sweep
from kvscope.emulator.workloads.model import WorkloadError, block_view, common_prefix_blocks
from kvscope.errors import SettingError


def kvscope(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_workload_is_the_published_setup() -> None:
    work = published_sweep.generate(8000)
    assert len(work.conversations) == 10
    assert work.settings["shared_prefix_tokens"] == 8000
    for conv in work.conversations:
        assert [t.prompt_tokens for t in conv.turns] == [8150 + 450 * k for k in range(10)]
        assert {t.output_tokens for t in conv.turns} == {300}
        assert all(t.think_time_s == 0.0 for t in conv.turns)
        for prev, turn in itertools.pairwise(conv.turns):
            assert turn.shared_prefix_tokens == prev.prompt_tokens + prev.output_tokens
            assert turn.new_input_tokens == 150
    # Mean prompt: the prefix and 2,175 tokens of the chat (the sweep table's "why" uses it).
    prompts = [t.prompt_tokens for c in work.conversations for t in c.turns]
    assert sum(prompts) / len(prompts) == 8000 + 2175
    # Two clients: chats start in pairs; the prefix is shared by every chat.
    assert [c.start_s for c in work.conversations[:4]] == [0.0, 0.0, 600.0, 600.0]
    view = block_view(work)
    a, b = work.conversations[0], work.conversations[5]
    assert common_prefix_blocks(view.prompt(a.id, 1), view.prompt(b.id, 1)) == 8000 // 16
    with pytest.raises(WorkloadError, match="prefix_tokens"):
        published_sweep.generate(0)


def test_the_runs_are_1p1d_with_prefill_prefix_caching_off_on_and_off() -> None:
    runs = sweep_runs(SimulationSettings(decoder_kv_blocks_ttl=60.0))
    assert len(runs) == 2 * len(DEFAULT_PREFIX_TOKENS) * 2
    assert {r.settings.profile for r in runs} == {"qwen3-32b", "glm-5-fp8"}
    for run in runs:
        s = run.settings
        assert (s.prefill_nodes, s.decode_nodes, s.prefill_prefix_caching) == (1, 1, False)
        assert s.prefill_bidirectional_kv_xfer == s.decode_bidirectional_kv_xfer
        assert s.decoder_kv_blocks_ttl == 60.0  # the caller's options still apply
        assert f"prefix={run.prefix_tokens} " in s.label
    assert sum(r.settings.prefill_bidirectional_kv_xfer for r in runs) == len(runs) // 2
    with pytest.raises(SettingError, match="no published sweep for profile 'tiny'"):
        sweep_runs(SimulationSettings(), ["tiny"])


def test_sweep_command_prints_simulated_beside_published(tmp_path: Path) -> None:
    done = kvscope("simulate", "--workload", "sweep", "--profile", "qwen3-32b",
                   "--prefix-tokens", "2000,12000,24000", "--db", "sweep.duckdb", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[6/6 simulated qwen3-32b prefix=24000 bidirectional-kv-xfer=off]" in done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith("Qwen3-32B")]
    assert [(r[1], r[2]) for r in rows] == [
        ("on", "2,000"), ("on", "12,000"), ("on", "24,000"),
        ("off", "2,000"), ("off", "12,000"), ("off", "24,000")]
    # 12k was never published: every published column there says so.
    middle = next(line for line in lines if line.startswith("Qwen3-32B  on       12,000"))
    assert middle.count("not measured") == 6
    assert "published: vLLM blog" in done.stdout

    with registry.AnalysisContext.open(tmp_path / "sweep.duckdb") as ctx:
        table = registry.run(ctx, "published_sweep")
    assert table.height == 6
    for row in table.iter_rows(named=True):
        on = row["feature"] == "on"
        pub = published.QWEN3_32B.value(published.TTFT, on, row["prompt_tokens"])
        assert row["ttft_published_ms"] == pub
        if pub is None:
            assert row["ttft_ratio"] is None and row["within_15pct"] is None
            assert row["why"].startswith("not measured")
        else:
            assert row["ttft_ratio"] == pytest.approx(row["ttft_ms"] / pub)
        assert row["turns"] == 100
        assert row["mean_prompt_tokens"] == row["prompt_tokens"] + 2175
        # OFF pulls nothing: no transfer, not a 0.
        assert (row["transfer_ms"] is None) == (not on)
    # The simulated sweep keeps the published shape: OFF grows steeply, ON stays flatter.
    by = {(r["feature"], r["prompt_tokens"]): r["ttft_ms"] for r in table.iter_rows(named=True)}
    assert by[("off", 24000)] / by[("on", 24000)] > 1.4
    # (published: OFF grows 620 ms over the sweep, ON 338 ms)
    assert by[("off", 24000)] - by[("off", 2000)] > 1.5 * (by[("on", 24000)] - by[("on", 2000)])
    # The profile was solved on the sweep's mean turns: every published end now matches, and
    # says it is a calibration point (no held-out point exists).
    compared = table.filter(table["within_15pct"].is_not_null())
    assert compared.height == 4 and compared["within_15pct"].all()
    assert all(why.startswith("within ±15 % (a calibration point") for why in compared["why"])
    # ... because the simulator's turns have the composition the fit assumed (turn_mix).
    with registry.AnalysisContext.open(tmp_path / "sweep.duckdb") as ctx:
        ledger = ctx.ledger()
    for run in sweep_runs_in(table, "on"):
        mix = turn_mix(published_sweep.generate(run["prompt_tokens"]))
        turns = ledger.filter(pl.col("run_id") == run["run_id"])
        reads = turns.filter(pl.col("remote_reused_tokens") > 0)
        assert turns["prompt_tokens"].mean() == mix.prompt_tokens
        assert reads.height / turns.height == mix.pull_share
        assert reads["remote_reused_tokens"].mean() == mix.pulled_tokens
        assert reads["d2p_bytes"].mean() == pytest.approx(mix.read_blocks * 16 * 262_144)
        computed = turns["prompt_tokens"] - turns["remote_reused_tokens"]
        assert computed.mean() == mix.computed_on_tokens

    out = write_report(tmp_path / "sweep.duckdb", tmp_path / "report.html")
    page = out.read_text()
    assert "Qwen3-32B ON published" in page and "Qwen3-32B OFF simulated" in page
    assert 'id="table-published_sweep"' in page


def sweep_runs_in(table: pl.DataFrame, feature: str) -> list[dict[str, object]]:
    return [r for r in table.iter_rows(named=True) if r["feature"] == feature]


def test_a_run_that_does_not_pull_says_so_in_why(tmp_path: Path) -> None:
    # Decode drops the blocks before the next turn reads them: the ON points miss, and the
    # table says the pull path did not run as calibrated (not a stale cost-model story).
    done = kvscope("simulate", "--workload", "sweep", "--profile", "glm-5-fp8",
                   "--prefix-tokens", "2000", "--decoder-kv-blocks-ttl", "3",
                   "--db", "s.duckdb", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with registry.AnalysisContext.open(tmp_path / "s.duckdb") as ctx:
        table = registry.run(ctx, "published_sweep")
    why = {r["feature"]: r["why"] for r in table.iter_rows(named=True)}
    assert why["on"].startswith("ttft, prefill, transfer off by more than 15 %")
    assert "pull path: 0% of turns used KV pulled from decode" in why["on"]
    assert "(90% of turns)" in why["on"]
    assert why["off"].startswith("within ±15 %")


def test_sweep_options_are_checked(tmp_path: Path) -> None:
    for argv, message in [
        (["--sweep", "decoder-kv-blocks-ttl=60,480"], "--sweep cannot be combined"),
        (["--prefix-tokens", "2k"], "--prefix-tokens=2k: expected token counts"),
        (["--profile", "tiny"], "no published sweep for profile 'tiny'"),
        (["--trace", "t.jsonl"], "--trace is not used with --workload sweep"),
    ]:
        done = kvscope("simulate", "--workload", "sweep", "--db", "x.duckdb", *argv,
                       cwd=tmp_path)
        assert done.returncode != 0
        assert message in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert not (tmp_path / "x.duckdb").exists()


def test_sweep_figures_carry_the_published_points_dashed() -> None:
    from kvscope.analysis.published import COLUMNS

    rows = [
        {"model": "Qwen3-32B", "profile": "qwen3-32b", "feature": f, "prompt_tokens": p,
         "ttft_ms": t, "ttft_published_ms": pub, "prefill_ms": t - 5.0,
         "compute_ms": t - 5.0 - (20.0 if f == "on" else 0.0),
         "transfer_ms": 20.0 if f == "on" else None, "prefill_published_ms": pub}
        for f, p, t, pub in [("on", 2000, 160.0, 122.0), ("on", 12000, 300.0, None),
                             ("off", 2000, 210.0, 158.0), ("off", 12000, 500.0, None)]
    ]
    frame = pl.DataFrame(rows).with_columns(
        [pl.lit(None).cast(t).alias(c) for c, t in COLUMNS.items() if c not in rows[0]])
    ttft = figures.sweep_ttft_vs_prompt(frame)
    names = {t.name: t for t in ttft.data}
    assert names["Qwen3-32B ON published"].line.dash == "dash"
    assert list(names["Qwen3-32B ON published"].x) == [2000]  # only what was published
    assert names["Qwen3-32B OFF simulated"].line.dash is None
    split = figures.sweep_prefill_split(frame)
    kinds = {(t.type, t.name) for t in split.data}
    assert ("bar", "Qwen3-32B ON transfer") in kinds and ("bar", "Qwen3-32B OFF compute") in kinds
    assert ("bar", "Qwen3-32B OFF transfer") not in kinds  # OFF pulls nothing
    assert ("scatter", "Qwen3-32B OFF published") in kinds
    assert "no data" in figures.sweep_ttft_vs_prompt(None).layout.annotations[0].text


def test_the_workload_defaults_are_each_published_sweeps_setup() -> None:
    # The numbers live in kvscope.published only; every published sweep ran the same chats.
    from kvscope import published

    default = published_sweep.generate(2000).summary()
    for sweep in published.SWEEPS:
        assert published_sweep.generate(
            2000, conversations=sweep.conversations, turns=sweep.turns,
            new_tokens=sweep.new_tokens, output_tokens=sweep.output_tokens,
            clients=sweep.clients).summary() == default, sweep.model
