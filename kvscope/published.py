"""Published measurements of bidirectional KV transfer: the one place kvscope keeps them.

Source: the vLLM project blog post "Improve TTFT for Multi-Turn Agentic Workloads with
Bi-Directional KV Transfer in vLLM" (2026-10-12) and the reproduction scripts published with it,
as summarised in ``shared/reference/published-results.md``. The figures are the vendor's own,
not independently reproduced.

Setup: 1 prefill + 1 decode node (8 × H200 each, TP 8, EFA, NIXL LIBFABRIC), prefix caching off
on the prefill node only, ``kv_recompute_threshold`` 64, ``decoder_kv_blocks_ttl`` 480;
vLLM's multi-turn benchmark with 10 conversations × 10 turns, about 150 new input and 300 output
tokens a turn, 2 clients, the shared prefix swept from 2k tokens. Only the two ends of each
sweep are published (2k and 24k tokens for Qwen3-32B, 2k and 20k for GLM-5-FP8): every point in
between is "not measured". TTFT is the client's; prefill the proxy's "Prefill done in N ms";
transfer the prefill node's D→P READ time inside the ON prefill.

The emulator's cost profiles are solved from these numbers (``emulator/cost_model.py``), and the
``published_sweep`` analysis compares simulated sweeps with them.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = ("vLLM blog, 'Improve TTFT for Multi-Turn Agentic Workloads with Bi-Directional KV "
          "Transfer in vLLM' (2026-10-12); shared/reference/published-results.md")

# Quantities, as the analysis and the report name them.
TTFT = "ttft_ms"
PREFILL = "prefill_ms"
TRANSFER = "transfer_ms"


@dataclass(frozen=True)
class PublishedSweep:
    """One model's published sweep: the setup and the values at its two ends (ms)."""

    model: str  # as the blog names it
    profile: str  # the emulator's cost profile for it
    prompt_tokens: tuple[int, int]  # the swept shared prefix at the two published ends
    new_tokens: int
    output_tokens: int
    conversations: int
    turns: int
    clients: int
    ttft_off_ms: tuple[float, float]
    ttft_on_ms: tuple[float, float]
    prefill_off_ms: tuple[float, float]
    prefill_on_ms: tuple[float, float]
    transfer_on_ms: tuple[float, float]

    def value(self, quantity: str, feature_on: bool, prompt_tokens: int) -> float | None:
        """The published value at ``prompt_tokens``; None where nothing was published."""
        if prompt_tokens not in self.prompt_tokens:
            return None
        end = self.prompt_tokens.index(prompt_tokens)
        table = {
            (TTFT, False): self.ttft_off_ms, (TTFT, True): self.ttft_on_ms,
            (PREFILL, False): self.prefill_off_ms, (PREFILL, True): self.prefill_on_ms,
            (TRANSFER, True): self.transfer_on_ms,
        }
        values = table.get((quantity, feature_on))
        return None if values is None else values[end]


QWEN3_32B = PublishedSweep(
    model="Qwen3-32B",
    profile="qwen3-32b",
    prompt_tokens=(2000, 24000),
    new_tokens=150,
    output_tokens=300,
    conversations=10,
    turns=10,
    clients=2,
    ttft_off_ms=(158.0, 778.0),
    ttft_on_ms=(122.0, 460.0),
    prefill_off_ms=(153.0, 744.0),
    prefill_on_ms=(128.0, 414.0),
    transfer_on_ms=(30.0, 130.0),
)
GLM5_FP8 = PublishedSweep(
    model="GLM-5-FP8",
    profile="glm-5-fp8",
    prompt_tokens=(2000, 20000),
    new_tokens=150,
    output_tokens=300,
    conversations=10,
    turns=10,
    clients=2,
    ttft_off_ms=(500.0, 2334.0),
    ttft_on_ms=(358.0, 702.0),
    prefill_off_ms=(500.0, 2331.0),
    prefill_on_ms=(316.0, 541.0),
    transfer_on_ms=(29.0, 110.0),
)
SWEEPS: tuple[PublishedSweep, ...] = (QWEN3_32B, GLM5_FP8)


def for_profile(profile: str) -> PublishedSweep | None:
    """The published sweep of the model a cost profile stands for; None for other profiles."""
    return next((s for s in SWEEPS if s.profile == profile), None)


__all__ = ["GLM5_FP8", "PREFILL", "PublishedSweep", "QWEN3_32B", "SOURCE", "SWEEPS", "TRANSFER",
    "TTFT", "for_profile"]
