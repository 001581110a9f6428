"""The contract tier runs only where vLLM 0.33.0 is installed; elsewhere it says so once."""

from __future__ import annotations

import importlib.metadata

import pytest

from tests.vllm_contract.conftest import SKIP_REASON, VLLM_AVAILABLE


@pytest.mark.skipif(not VLLM_AVAILABLE, reason=SKIP_REASON)
def test_the_tier_runs_against_vllm_0_33_0() -> None:
    assert importlib.metadata.version("vllm") == "0.33.0"
    assert importlib.metadata.version("nixl") == "1.5.1"
