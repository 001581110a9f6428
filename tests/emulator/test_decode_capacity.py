"""Decode memory: a hardware profile sizes each decode engine's KV blocks, retained handles take
them, and a turn that does not fit waits (vLLM 0.33.0's scheduler: a waiting request that cannot
allocate stays queued; retained blocks are never taken back). ``--decode-cache-blocks`` and
``--gpu`` change results."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.emulator import capacity
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic
from kvscope.emulator.workloads.model import Workload


def test_kv_blocks_from_the_gpu_the_weights_and_the_model_config() -> None:
    engine = capacity.hardware("h100-80gb", "qwen3-32b")
    # 0.9 x 80 GB - 32.8 B x 2 bytes = 6.4 GB; a block is 16 x 262,144 bytes.
    assert engine.kv_cache_bytes() == pytest.approx(0.9 * 80e9 - 65.6e9)
    assert engine.kv_blocks(16) == int((0.9 * 80e9 - 65.6e9) // (16 * 262_144)) == 1525
    assert capacity.hardware("h100-80gb", "qwen3-32b", tensor_parallel_size=2).kv_blocks(16) \
        == int((2 * 0.9 * 80e9 - 65.6e9) // (16 * 262_144))
    assert capacity.hardware("h200-141gb", "qwen3-32b", 0.95).kv_blocks(16) > 10 * 1525
    # An MLA latent (one KV head) is replicated on every GPU: 8 GPUs hold one GPU's blocks,
    # each GPU's free bytes after its eighth of the 744 GB of weights, not 8 times as many.
    glm = capacity.hardware("h200-141gb", "glm-5-fp8", tensor_parallel_size=8)
    assert glm.kv_blocks(16) == int((0.9 * 141e9 - 744e9 / 8) // (16 * 89_856)) == 23_579
    with pytest.raises(capacity.CapacityError, match="leave no room for a KV cache"):
        capacity.hardware("h100-80gb", "glm-5-fp8").kv_blocks(16)
    with pytest.raises(capacity.CapacityError, match="no model config for profile 'tiny'"):
        SimulationSettings(profile="tiny", gpu="h100-80gb")


def _workload() -> Workload:
    # Twelve conversations at once, long prompts, waits well under the TTL: decode retains a
    # handle per conversation between its turns.
    return synthetic.generate(seed=4, conversations=12, turns_p50=5, max_turns=6,
                              system_prompt_tokens=2000, new_input_tokens_p50=1500,
                              think_time_p50_s=20, think_time_p90_s=60, arrival_rate_per_s=0,
                              reset_probability=0.0, subagent_probability=0.0)


def _run(tmp_path: Path, name: str, **settings: object) -> SimulationResult:
    return simulate(_workload(), tmp_path / f"{name}.duckdb",
                    SimulationSettings(label=name, **settings))


def _ttft_p50(result: SimulationResult) -> float:
    return statistics.median(r.ttft_ms for r in result.truth if r.ttft_ms is not None)


def test_retained_blocks_make_turns_wait_when_decode_is_small(tmp_path: Path) -> None:
    roomy = _run(tmp_path, "roomy")
    small = _run(tmp_path, "small", decode_cache_blocks=4000)
    assert roomy.decode_kv_blocks == 1 << 22 and small.decode_kv_blocks == 4000
    assert roomy.decode_queued_turns == 0 and roomy.decode_queue_s == 0.0
    assert roomy.decode_peak_blocks > 4000  # retained + running blocks the roomy run held
    assert small.decode_queued_turns > 0 and small.decode_queue_s > 0
    assert small.decode_peak_blocks <= 4000
    waited = [r for r in small.truth if r.decode_queue_s > 0]
    assert len(waited) == small.decode_queued_turns
    assert sum(r.decode_queue_s for r in waited) == pytest.approx(small.decode_queue_s)
    assert _ttft_p50(small) > _ttft_p50(roomy)
    # Without the feature decode retains nothing: the same small engine never waits as long.
    off = _run(tmp_path, "off", decode_cache_blocks=4000, prefill_bidirectional_kv_xfer=False,
               decode_bidirectional_kv_xfer=False)
    assert off.decode_queue_s < small.decode_queue_s


def test_a_gpu_profile_caps_the_decode_blocks(tmp_path: Path) -> None:
    # qwen3-32b on one H100: 1,525 blocks (24k tokens) for the retained handles of 12 chats.
    one = _run(tmp_path, "h100", gpu="h100-80gb")
    two = _run(tmp_path, "h100x2", gpu="h100-80gb", tensor_parallel_size=2)
    assert one.decode_kv_blocks == 1525
    assert two.decode_kv_blocks > 10 * one.decode_kv_blocks
    assert one.decode_queue_s > two.decode_queue_s >= 0.0
    assert _ttft_p50(one) > _ttft_p50(two)


def test_decode_cache_blocks_changes_what_simulate_prints(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "simulate", "--db", str(tmp_path / "s.duckdb"),
         "--conversations", "12", "--sweep", "decode-cache-blocks=600,4194304"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "decode-cache-blocks=" in line]
    assert len(rows) == 2
    # The TTFT columns differ: the small engine's turns waited for blocks, as its line says.
    assert rows[0].split()[-2:] != rows[1].split()[-2:]
    waited = [line for line in done.stderr.splitlines() if "for decode KV blocks" in line]
    assert len(waited) == 1 and "decode-cache-blocks=600" in waited[0]
    assert "(600 a decode engine" in waited[0]


def test_the_wait_shows_in_the_ledger_the_ladder_and_the_retention_cost(tmp_path: Path) -> None:
    from kvscope.analysis.registry import AnalysisContext, run

    small = _run(tmp_path, "small", decode_cache_blocks=4000)
    roomy = _run(tmp_path, "roomy")
    for result, name in ((small, "small"), (roomy, "roomy")):
        with AnalysisContext.open(tmp_path / f"{name}.duckdb") as ctx:
            turns = ctx.ledger()
            steps = run(ctx, "ladder")
            cost = run(ctx, "retention_cost")
        # The ledger times decode's queue from what the spans show (the proxy's decode leg to
        # decode's P->D read); it is what the simulator made the turns wait, turn by turn.
        truth = {r.x_request_id: r.decode_queue_s for r in result.truth if r.decode_request_id}
        measured = dict(zip(turns["x_request_id"], turns["decode_queue_ms"], strict=True))
        assert truth and set(truth) <= set(measured)
        for x_request_id, waited_s in truth.items():
            assert measured[x_request_id] == pytest.approx(waited_s * 1000, abs=1e-3)
        assert (turns["decode_queue_ms"] > 0).sum() == result.decode_queued_turns
        [capacity_row] = steps.filter(steps["step"] == "capacity_bounded").iter_rows(named=True)
        assert capacity_row["decode_queue_s"] == pytest.approx(result.decode_queue_s)
        assert f"{result.decode_queue_s:.1f} s in all" in capacity_row["evidence"]
        assert cost["decode_queue_s_total"].sum() == pytest.approx(result.decode_queue_s)
    assert small.decode_queue_s > 0 and roomy.decode_queue_s == 0
