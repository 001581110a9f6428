"""The physics cost model: work counted from the model's shape, priced at the hardware's
published limits, constants recovered by the fit, and no negative time."""

from __future__ import annotations

import dataclasses

import pytest

from kvscope.emulator import physics


def test_prefill_flops_and_the_ideal_time_follow_the_model_and_the_gpus() -> None:
    engine = physics.published_engines()["qwen3-32b"]
    # 2 x 32.8 B x 1000 linear FLOPs, 4 x 64 layers x 8192 x 1000 x 500 causal attention.
    assert engine.prefill_flops(1000, 0) == pytest.approx(2 * 32.8e9 * 1000
                                                          + 4 * 64 * 8192 * 1000 * 500)
    assert engine.peak_flops == 8 * 989e12  # bf16 on 8 x H200
    ideal = engine.prefill_ideal_ms(24_000, 0)
    assert ideal == pytest.approx(1000 * engine.prefill_flops(24_000, 0) / (8 * 989e12))
    # One token: reading the weights once bounds it, not the FLOPs.
    assert engine.prefill_ideal_ms(1, 0) == pytest.approx(1000 * 65.6e9 / (8 * 4.8e12))
    glm = physics.published_engines()["glm-5-fp8"]
    assert glm.peak_flops == 8 * 1979e12  # fp8 weights on H200


def test_the_fit_recovers_constants_that_made_the_points() -> None:
    engines = physics.published_engines()
    truth = physics.Constants({
        ("qwen3-32b", "fixed"): 80.0, ("qwen3-32b", "inverse"): 2.5,
        ("glm-5-fp8", "fixed"): 120.0, ("glm-5-fp8", "inverse"): 10.0,
        ("link", "latency"): 9.0, ("link", "descriptor"): 0.0005, ("link", "inverse"): 1.25})
    made = [dataclasses.replace(p, published_ms=physics.predict(engines, truth, p))
            for p in physics.published_points()]
    fitted = physics.fit(engines, made)
    for column, value in truth.values.items():
        assert fitted.values[column] == pytest.approx(value, rel=1e-6), column


def test_a_negative_time_is_an_error_not_a_number() -> None:
    engines = physics.published_engines()
    point = physics.published_points()[0]
    bad = physics.Constants({("qwen3-32b", "fixed"): -500.0, ("qwen3-32b", "inverse"): 1.0,
                             ("link", "latency"): 0.0, ("link", "descriptor"): 0.0,
                             ("link", "inverse"): 1.0})
    with pytest.raises(physics.NegativeTimeError, match="below zero"):
        physics.predict(engines, bad, point)


def test_a_published_point_is_the_mean_of_its_turns_costs_not_the_mean_turns_cost() -> None:
    engine = physics.published_engines()["qwen3-32b"]
    on = next(p for p in physics.published_points() if p.label == "prefill ON 24k")
    assert len(on.turns) == 100 and sum(1 for t in on.turns if t.pulled_tokens) == 90
    # A chat's first turn computes its whole prompt; the others 150 tokens after the pull.
    first = on.turns[0]
    assert first.pulled_tokens == 0 and first.computed_on_tokens == first.prompt_tokens
    per_turn = [engine.prefill_ideal_ms(t.computed_on_tokens,
                                        t.prompt_tokens - t.computed_on_tokens)
                for t in on.turns]
    coefficient = physics.terms(engine, on)[("qwen3-32b", "inverse")]
    assert coefficient == pytest.approx(sum(per_turn) / len(per_turn))
    mean_turn = dataclasses.replace(on, turns=())
    assert physics.terms(engine, mean_turn)[("qwen3-32b", "inverse")] > 1.2 * coefficient
    # The read's coefficients are the mean per read (the published transfer is per read).
    transfer = next(p for p in physics.published_points() if p.label == "transfer 24k")
    assert physics.terms(engine, transfer)[("link", "latency")] == pytest.approx(1.0)
    assert physics.terms(engine, on)[("link", "latency")] == pytest.approx(0.9)
