"""The cost profiles reproduce the published sweep endpoints and stay physical beyond them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvscope.emulator.cost_model import (
    GLM5_FP8_BLOG,
    PROFILES,
    QWEN3_32B_BLOG,
    Calibration,
    fit_profile,
    profile,
)

CASES = [("qwen3-32b", QWEN3_32B_BLOG), ("glm-5-fp8", GLM5_FP8_BLOG)]


def _virtual_ttft(name: str, cal: Calibration, end: int) -> tuple[float, float]:
    """TTFT OFF (P recomputes the whole prompt, no prefix cache) and ON (pull all but new)."""
    p = profile(name)
    prompt = cal.prompt_tokens[end]
    return p.ttft_ms(prompt), p.ttft_ms(prompt, 0, prompt - cal.new_tokens)


@pytest.mark.parametrize(("name", "cal"), CASES)
@pytest.mark.parametrize("end", [0, 1])
def test_ttft_within_15_percent_of_published(name: str, cal: Calibration, end: int) -> None:
    off, on = _virtual_ttft(name, cal, end)
    assert off == pytest.approx(cal.ttft_off_ms[end], rel=0.15)
    assert on == pytest.approx(cal.ttft_on_ms[end], rel=0.15)


@pytest.mark.parametrize(("name", "cal"), CASES)
def test_prefill_and_transfer_against_published(name: str, cal: Calibration) -> None:
    p = profile(name)
    print(f"\n{name}: prompt | prefill OFF model/pub | prefill ON model/pub | D->P model/pub (ms)")
    for end, prompt in enumerate(cal.prompt_tokens):
        pulled = prompt - cal.new_tokens
        wire = p.transfer_ms(p.kv_bytes(pulled))
        pre_off = p.prefill_ms(prompt)
        pre_on = p.prefill_ms(cal.new_tokens, pulled, pulled) + wire
        print(
            f"  {prompt:>6} | {pre_off:7.0f} / {cal.prefill_off_ms[end]:7.0f}"
            f" | {pre_on:6.0f} / {cal.prefill_on_ms[end]:6.0f}"
            f" | {wire:5.0f} / {cal.transfer_on_ms[end]:5.0f}"
        )
        assert pre_off == pytest.approx(cal.prefill_off_ms[end], rel=0.15)
        assert pre_on == pytest.approx(cal.prefill_on_ms[end], rel=0.15)
        assert wire == pytest.approx(cal.transfer_on_ms[end], rel=0.15)


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
    p = fit_profile("x", 262_144, QWEN3_32B_BLOG)
    assert p.prefill_ms(2000) == pytest.approx(153.0)
    assert p.transfer_ms(262_144 * 1850) == pytest.approx(30.0)


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="qwen3-32b"):
        profile("nope")
