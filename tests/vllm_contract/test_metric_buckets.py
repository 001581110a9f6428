"""kvscope's TTFT histograms use the buckets of vLLM 0.33.0's time_to_first_token_seconds."""

from __future__ import annotations

from vllm.v1.metrics.buckets import TIME_TO_FIRST_TOKEN_BUCKETS, histogram_buckets

from kvscope.exposition import VLLM_TTFT_BUCKETS_S


def test_ttft_buckets_are_vllms() -> None:
    assert tuple(VLLM_TTFT_BUCKETS_S) == tuple(TIME_TO_FIRST_TOKEN_BUCKETS)
    # What vLLM's Prometheus logger actually passes (no override configured).
    assert tuple(histogram_buckets("time_to_first_token")) == VLLM_TTFT_BUCKETS_S
