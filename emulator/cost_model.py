"""Prefill, decode and KV-transfer timing for the emulator: named profiles fitted to published runs.

Shape of the model (milliseconds; ``new`` = tokens P computes, ``context`` = tokens already in
KV before them, ``pulled`` = tokens read D→P for this request):

* ``prefill_ms = a + b·new + c·new·(context + new/2) + [pulled > 0]·(h + g·pulled)`` — ``a`` is
  the fixed cost of the P leg as the proxy times it (HTTP, scheduling, the one-token sample);
  ``b`` the per-token work; ``c`` attention over the context (0 in the fitted profiles: the
  published OFF sweep grows linearly, and an unconstrained fit gives a negative ``c`` that would
  make 100k-token prompts free); ``g`` the pull path's per-token overhead beyond the wire
  (WAITING_FOR_REMOTE_KVS round trips, block registration, NIXL post time); ``h`` the pull
  path's fixed difference.
* ``transfer_ms = latency + bytes / bandwidth`` (one NIXL READ; bytes = blocks × block bytes).
* ``first_token_ms = e + f·prompt`` — the D leg up to the first streamed token (P→D pull of the
  blocks D lacks, the first decode step, proxy pass-through), fitted to TTFT − prefill.
* ``decode_ms_per_token = d0 + d1·context`` — assumed, not calibrated (the blog gives no TPOT).

TTFT (proxy view) = prefill leg + transfer (when pulling) + first-token leg.

Calibration. The profiles ``qwen3-32b`` and ``glm-5-fp8`` are solved by :func:`fit_profile`
from the published ends (:mod:`kvscope.published`; nothing between them was published). Each
published figure is a mean over the turns of 10 chats × 10 turns, so the fit prices the mean
turn, not one request of prefix + 150 tokens: :func:`kvscope.emulator.turn_mix.turn_mix` reads
the mean composition off the sweep's own workload (the generator the simulator runs) — OFF the
mean prompt (prefix + 2,175: the history is re-sent); ON the mean computed tokens (a chat's
first turn computes prefix + 150, the others 150), the share of turns that pull (90 %: first
turns pull nothing) and the tokens and whole blocks per read (prefix + 2,250 on average). Every
term is linear, so the mean price is the price at the mean composition: two transfer ends give
latency and bandwidth; two OFF and two ON prefill ends give ``a, b, g, h`` exactly, unless that
makes ``g < 0`` (a pull cheaper the longer it is, free past some length): then ``g = 0`` and
``h`` is the least-squares fit of both ON ends. The first-token line is the least-squares fit of
the four TTFT − prefill gaps at the mean prompt (one line for ON and OFF; the ``max(0, ·)`` clamp
is left out of the fit). Solved constants (2026-12-01):

========================  ==========  ==========
constant                  qwen3-32b   glm-5-fp8
========================  ==========  ==========
a  prefill fixed, ms      40.8        75.3
b  ms per computed token  0.02686     0.10172
g  ms per pulled token    0.00691     0 (exact fit: −0.00191)
h  pull fixed, ms         27.0        181.7 (exact fit: 207.0)
transfer latency, ms      10.6        9.8
bandwidth, GB/s           57.7        20.0
e  first token fixed, ms  −8.2        6.9
f  ms per prompt token    0.00184     0.00339
========================  ==========  ==========

With these, the simulated sweep meets every published end within ±15 % (``published_sweep``
analysis; figures in ``docs/benchmarks.md``). Every published point is a calibration point, so
that match tests only that the simulator composes the costs as the fit did (turn mix, whole-block
reads, the clamp); it says nothing of the points between the ends, of other prompt shapes, of
concurrency (the simulator does not queue) or of the model's shape (``c = 0``, linear pull path).
The same :func:`fit_profile` applies to any :class:`Calibration` of two ends and their turn mixes.

KV bytes per token come from the models' public configs:

* Qwen3-32B: 64 layers × 8 KV heads × head dim 128 × (K and V) × 2 bytes (bf16) = 262,144.
* GLM-5 (MLA, DeepSeek-style latent cache): assumed 78 layers × (kv_lora_rank 512 + rope dim 64)
  × 2 bytes (vLLM's default bf16 KV cache for the FP8 checkpoint) = 89,856; the sparse-attention
  indexer's small per-token cache is ignored. Assumption: the config could not be checked here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvscope import published
from kvscope.emulator.tokens import DEFAULT_BLOCK_SIZE
from kvscope.emulator.turn_mix import TurnMix, turn_mix
from kvscope.emulator.workloads import published_sweep
from kvscope.fit import solve_linear


@dataclass(frozen=True)
class CostProfile:
    """Timing constants of one model on one deployment (milliseconds, bytes)."""

    name: str
    kv_bytes_per_token: int
    prefill_fixed_ms: float
    prefill_ms_per_token: float
    transfer_latency_ms: float
    transfer_bytes_per_ms: float
    first_token_fixed_ms: float
    # Terms a profile may leave out (0: no such cost).
    prefill_ms_per_token_context: float = 0.0
    load_ms_per_pulled_token: float = 0.0
    pull_fixed_ms: float = 0.0
    first_token_ms_per_prompt_token: float = 0.0
    decode_ms_per_token: float = 8.0
    decode_ms_per_token_context: float = 0.0001
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block."""
        return self.block_size * self.kv_bytes_per_token

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of the whole blocks holding ``tokens`` tokens."""
        return math.ceil(tokens / self.block_size) * self.block_bytes

    def prefill_ms(self, new_tokens: int, context_tokens: int = 0, pulled_tokens: int = 0) -> float:
        """Prefill leg compute time, without the wire time of a pull."""
        return (
            self.prefill_fixed_ms
            + self.prefill_ms_per_token * new_tokens
            + self.prefill_ms_per_token_context * new_tokens * (context_tokens + new_tokens / 2)
            + (
                self.pull_fixed_ms + self.load_ms_per_pulled_token * pulled_tokens
                if pulled_tokens > 0
                else 0.0
            )
        )

    def transfer_ms(self, num_bytes: int) -> float:
        """One READ of ``num_bytes``; zero bytes (notify only) costs nothing measurable."""
        if num_bytes <= 0:
            return 0.0
        return self.transfer_latency_ms + num_bytes / self.transfer_bytes_per_ms

    def first_token_ms(self, prompt_tokens: int) -> float:
        """Decode leg up to the first streamed token (clamped: the fitted intercept can be < 0)."""
        return max(
            0.0, self.first_token_fixed_ms + self.first_token_ms_per_prompt_token * prompt_tokens
        )

    def decode_token_ms(self, context_tokens: int) -> float:
        """One decode step at ``context_tokens`` of context."""
        return self.decode_ms_per_token + self.decode_ms_per_token_context * context_tokens

    def ttft_ms(self, prompt_tokens: int, local_tokens: int = 0, pulled_tokens: int = 0) -> float:
        """Proxy-side TTFT of a turn: prefill leg (+ pull) + first-token leg."""
        context = local_tokens + pulled_tokens
        new = max(prompt_tokens - context, 1)  # a full hit still computes the last token
        wire = self.transfer_ms(self.kv_bytes(pulled_tokens)) if pulled_tokens else 0.0
        return (
            self.prefill_ms(new, context, pulled_tokens) + wire + self.first_token_ms(prompt_tokens)
        )


@dataclass(frozen=True)
class Calibration:
    """Published means of one sweep (ms) at its two ends, with the turns they average over."""

    prompt_tokens: tuple[int, int]  # the swept shared prefix at the two ends
    mix: tuple[TurnMix, TurnMix]  # the mean composition of the sweep's turns at each end
    prefill_off_ms: tuple[float, float]
    prefill_on_ms: tuple[float, float]
    transfer_on_ms: tuple[float, float]
    ttft_off_ms: tuple[float, float]
    ttft_on_ms: tuple[float, float]


def calibration(sweep: published.PublishedSweep, block_size: int = DEFAULT_BLOCK_SIZE,
                kv_recompute_threshold: int = 64) -> Calibration:
    """The calibration points of a published sweep: its two ends, over the sweep's own turns.

    Each end's turns come from the generator the simulator runs for that sweep
    (:func:`kvscope.emulator.workloads.published_sweep.generate`), so the mix is derived, not
    typed in.
    """
    mixes = tuple(
        turn_mix(
            published_sweep.generate(
                prefix, conversations=sweep.conversations, turns=sweep.turns,
                new_tokens=sweep.new_tokens, output_tokens=sweep.output_tokens,
                clients=sweep.clients, block_size=block_size),
            kv_recompute_threshold,
        )
        for prefix in sweep.prompt_tokens
    )
    return Calibration(
        prompt_tokens=sweep.prompt_tokens,
        mix=(mixes[0], mixes[1]),
        prefill_off_ms=sweep.prefill_off_ms,
        prefill_on_ms=sweep.prefill_on_ms,
        transfer_on_ms=sweep.transfer_on_ms,
        ttft_off_ms=sweep.ttft_off_ms,
        ttft_on_ms=sweep.ttft_on_ms,
    )


# The published numbers live in kvscope.published (one place); these are their calibrations.
QWEN3_32B_BLOG = calibration(published.QWEN3_32B)
GLM5_FP8_BLOG = calibration(published.GLM5_FP8)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    solution = solve_linear(matrix, rhs)
    if solution is None:
        raise ValueError("calibration points do not determine the profile")
    return solution


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope·x``."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y - slope * mean_x, slope


def fit_profile(name: str, kv_bytes_per_token: int, cal: Calibration,
                block_size: int = DEFAULT_BLOCK_SIZE) -> CostProfile:
    """Solve a profile's constants so its mean over the sweep's turns meets ``cal`` at both ends.

    Every term is linear, so a mean over turns is the model at the turns' mean composition:
    per end, OFF prefill = ``a + b·prompt``; transfer per read = ``latency + bytes/bandwidth``;
    ON prefill = ``a + b·computed + share·(h + g·pulled) + share·transfer`` (``share`` of turns
    pull, ``pulled`` and ``bytes`` per read). Six equations, six unknowns, solved exactly —
    unless that gives ``g < 0`` (the pull path would get cheaper the more it pulls, and long
    pulls would cost less than nothing): then ``g = 0`` and ``h`` is the least-squares fit of
    the two ON ends. First-token leg: least squares over the four TTFT − prefill gaps at the
    mean prompt (the ``max(0, ·)`` clamp of :meth:`CostProfile.first_token_ms` is not in it).
    """
    lo, hi = cal.mix
    bytes_lo, bytes_hi = (m.read_blocks * block_size * kv_bytes_per_token for m in cal.mix)
    bandwidth = (bytes_hi - bytes_lo) / (cal.transfer_on_ms[1] - cal.transfer_on_ms[0])
    latency = cal.transfer_on_ms[0] - bytes_lo / bandwidth
    rows, rhs = [], []
    for mix, ms in zip(cal.mix, cal.prefill_off_ms, strict=True):
        rows.append([1.0, mix.prompt_tokens, 0.0, 0.0])
        rhs.append(ms)
    # ON: the mean wire time over all turns is share × the published time per read.
    on_rhs = [ms - mix.pull_share * wire for mix, ms, wire
              in zip(cal.mix, cal.prefill_on_ms, cal.transfer_on_ms, strict=True)]
    for mix, ms in zip(cal.mix, on_rhs, strict=True):
        rows.append([1.0, mix.computed_on_tokens, mix.pull_share * mix.pulled_tokens,
                     mix.pull_share])
        rhs.append(ms)
    a, b, g, h = _solve(rows, rhs)
    if g < 0:
        g = 0.0
        a, b = _solve([r[:2] for r in rows[:2]], rhs[:2])
        rest = [ms - a - b * m.computed_on_tokens for m, ms in zip(cal.mix, on_rhs, strict=True)]
        h = sum(m.pull_share * r for m, r in zip(cal.mix, rest, strict=True)) / sum(
            m.pull_share**2 for m in cal.mix)
    e, f = _line(
        [lo.prompt_tokens, hi.prompt_tokens, lo.prompt_tokens, hi.prompt_tokens],
        [
            cal.ttft_off_ms[0] - cal.prefill_off_ms[0],
            cal.ttft_off_ms[1] - cal.prefill_off_ms[1],
            cal.ttft_on_ms[0] - cal.prefill_on_ms[0],
            cal.ttft_on_ms[1] - cal.prefill_on_ms[1],
        ],
    )
    return CostProfile(
        name=name,
        kv_bytes_per_token=kv_bytes_per_token,
        prefill_fixed_ms=a,
        prefill_ms_per_token=b,
        load_ms_per_pulled_token=g,
        pull_fixed_ms=h,
        transfer_latency_ms=latency,
        transfer_bytes_per_ms=bandwidth,
        first_token_fixed_ms=e,
        first_token_ms_per_prompt_token=f,
        block_size=block_size,
    )


QWEN3_32B_KV_BYTES_PER_TOKEN = 64 * 8 * 128 * 2 * 2
GLM5_KV_BYTES_PER_TOKEN = 78 * (512 + 64) * 2

PROFILES: dict[str, CostProfile] = {
    "qwen3-32b": fit_profile("qwen3-32b", QWEN3_32B_KV_BYTES_PER_TOKEN, QWEN3_32B_BLOG),
    "glm-5-fp8": replace(
        fit_profile("glm-5-fp8", GLM5_KV_BYTES_PER_TOKEN, GLM5_FP8_BLOG),
        decode_ms_per_token=20.0,
    ),
    # Fast, round numbers for tests and demos: millisecond-scale turns.
    "tiny": CostProfile(
        name="tiny",
        kv_bytes_per_token=1024,
        prefill_fixed_ms=2.0,
        prefill_ms_per_token=0.01,
        transfer_latency_ms=0.5,
        transfer_bytes_per_ms=1_000_000.0,
        first_token_fixed_ms=0.5,
        decode_ms_per_token=0.2,
        decode_ms_per_token_context=0.0,
    ),
}


def profile(name: str) -> CostProfile:
    """The named profile; raises KeyError listing the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown cost profile {name!r}; known: {', '.join(PROFILES)}") from None


__all__ = ["Calibration", "CostProfile", "GLM5_FP8_BLOG", "GLM5_KV_BYTES_PER_TOKEN", "PROFILES",
    "QWEN3_32B_BLOG", "QWEN3_32B_KV_BYTES_PER_TOKEN", "calibration", "fit_profile", "profile"]
