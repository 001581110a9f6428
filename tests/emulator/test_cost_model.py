"""The cost profiles meet the published sweep means at both ends and stay physical beyond them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvscope import published
from kvscope.emulator.cost_model import (
    GLM5_FP8_BLOG,
    PROFILES,
    QWEN3_32B_BLOG,
    fit_profile,
    profile,
)
from kvscope.emulator.workloads import published_sweep

CASES = [("qwen3-32b", published.QWEN3_32B), ("glm-5-fp8", published.GLM5_FP8)]


def _means(name: str, sweep: published.PublishedSweep, end: int) -> dict[str, float]:
    """The profile's per-turn prices averaged over the sweep's generated turns at one end.

    Turn by turn (whole-block reads, the first-token clamp): not through the fit's mean mix.
    """
    p = profile(name)
    work = published_sweep.generate(
        sweep.prompt_tokens[end], conversations=sweep.conversations, turns=sweep.turns,
        new_tokens=sweep.new_tokens, output_tokens=sweep.output_tokens)
    sums = {"ttft_off": 0.0, "ttft_on": 0.0, "prefill_off": 0.0, "prefill_on": 0.0, "wire": 0.0}
    turns = reads = 0
    for conv in work.conversations:
        for turn in conv.turns:
            turns += 1
            prompt, pulled = turn.prompt_tokens, turn.shared_prefix_tokens  # ON: the history
            wire = p.transfer_ms(p.kv_bytes(pulled)) if pulled else 0.0
            reads += bool(pulled)
            sums["wire"] += wire
            sums["prefill_off"] += p.prefill_ms(prompt)
            sums["prefill_on"] += p.prefill_ms(prompt - pulled, pulled, pulled) + wire
            sums["ttft_off"] += p.ttft_ms(prompt)
            sums["ttft_on"] += p.ttft_ms(prompt, 0, pulled)
    out = {k: v / turns for k, v in sums.items()}
    out["wire"] = sums["wire"] / reads
    return out


@pytest.mark.parametrize(("name", "sweep"), CASES)
@pytest.mark.parametrize("end", [0, 1])
def test_mean_over_the_sweeps_turns_meets_the_published_ends(
        name: str, sweep: published.PublishedSweep, end: int) -> None:
    m = _means(name, sweep, end)
    print(f"\n{name} {sweep.prompt_tokens[end]}: {m}")
    # The fit solves prefill and transfer exactly at the mean mix; per turn, only the whole
    # blocks of each read and the clamp differ from it.
    assert m["prefill_off"] == pytest.approx(sweep.prefill_off_ms[end], rel=0.01)
    # GLM-5's ON ends are a least-squares fit (g held at 0): about 5 % off each.
    exact = profile(name).load_ms_per_pulled_token > 0
    assert m["prefill_on"] == pytest.approx(sweep.prefill_on_ms[end], rel=0.01 if exact else 0.06)
    assert m["wire"] == pytest.approx(sweep.transfer_on_ms[end], rel=0.01)
    # TTFT: one first-token line for ON and OFF fitted by least squares to four gaps.
    assert m["ttft_off"] == pytest.approx(sweep.ttft_off_ms[end], rel=0.15)
    assert m["ttft_on"] == pytest.approx(sweep.ttft_on_ms[end], rel=0.15)


@pytest.mark.parametrize(("name", "sweep"), CASES)
def test_one_request_of_prefix_and_new_tokens_is_not_what_was_calibrated(
        name: str, sweep: published.PublishedSweep) -> None:
    # The old reading (each point one request of prefix + 150 new tokens) is now priced below
    # the published mean at the short end: the mean turn re-sends ~2.2k tokens of history.
    p = profile(name)
    prompt = sweep.prompt_tokens[0]
    assert p.prefill_ms(prompt) < 0.85 * sweep.prefill_off_ms[0]


@pytest.mark.parametrize("name", sorted(PROFILES))
@given(prompt=st.integers(1, 200_000), pulled_share=st.floats(0.0, 1.0))
def test_times_positive_and_monotone(name: str, prompt: int, pulled_share: float) -> None:
    p = PROFILES[name]
    pulled = int((prompt - 1) * pulled_share)
    assert p.prefill_ms(prompt) > 0 and p.ttft_ms(prompt, 0, pulled) > 0
    assert p.prefill_ms(prompt + 1) >= p.prefill_ms(prompt)
    assert p.transfer_ms(p.kv_bytes(pulled + 16)) >= p.transfer_ms(p.kv_bytes(pulled))
    assert p.first_token_ms(prompt) >= 0 and p.decode_token_ms(prompt) > 0


def test_long_prompts_favour_the_pull() -> None:
    for name in ("qwen3-32b", "glm-5-fp8"):
        p = PROFILES[name]
        assert p.ttft_ms(100_000, 0, 99_850) < p.ttft_ms(100_000) / 1.5


def test_kv_bytes_per_token_from_model_shapes() -> None:
    assert PROFILES["qwen3-32b"].kv_bytes_per_token == 64 * 8 * 128 * 2 * 2
    assert PROFILES["glm-5-fp8"].kv_bytes_per_token == 78 * 576 * 2
    assert PROFILES["qwen3-32b"].kv_bytes(17) == 2 * 16 * 262_144  # whole blocks move


def test_fit_is_exact_on_its_own_calibration_points() -> None:
    cal = QWEN3_32B_BLOG
    lo, hi = cal.mix
    # The mix is the generator's: prefix + 2,175 tokens on average, 9 of 10 turns pull.
    assert (lo.prompt_tokens, lo.pull_share, lo.pulled_tokens) == (4175.0, 0.9, 4250.0)
    assert hi.computed_on_tokens == (24_150 + 9 * 150) / 10
    p = fit_profile("x", 262_144, cal)
    assert p.prefill_ms(4175) == pytest.approx(153.0)
    assert p.transfer_ms(round(lo.read_blocks * 16 * 262_144)) == pytest.approx(30.0, abs=1e-3)
    on = (p.prefill_ms(lo.computed_on_tokens) + lo.pull_share * (
        p.pull_fixed_ms + p.load_ms_per_pulled_token * lo.pulled_tokens + 30.0))
    assert on == pytest.approx(128.0)


def test_a_negative_pull_slope_is_refitted_at_zero() -> None:
    # GLM-5's published ON ends solve exactly only with g < 0 (pulled turns cheaper the longer
    # the pull): the fit keeps g = 0 and fits h to both ends instead.
    p = fit_profile("x", 89_856, GLM5_FP8_BLOG)
    assert p.load_ms_per_pulled_token == 0.0 and p.pull_fixed_ms > 0
    assert p.prefill_ms(GLM5_FP8_BLOG.mix[1].prompt_tokens) == pytest.approx(2331.0)


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="qwen3-32b"):
        profile("nope")
