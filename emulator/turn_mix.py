"""The mean composition of a workload's turns as the simulator prices them, for calibration.

A published TTFT or prefill figure is a mean over every turn of a benchmark, not the cost of
one request: for the published sweep (10 chats × 10 turns behind a shared prefix, P prefix
caching off) a turn recomputes its whole prompt with the feature OFF, and with it ON pulls the
chat's previous prompt + answer from decode — except each chat's first turn, which has nothing
to pull. :func:`turn_mix` reads those means off the workload the simulator runs, with the
connector's own counting rules (:mod:`kvscope.reuse.params`), so a cost profile solved against
them (``emulator/cost_model.py``) is priced on the same tokens the simulator will charge.

Assumed, as in the published runs: no prefix cache on P (nothing local), decode still holds
the previous turn's blocks when the next turn arrives (no think time; ``decoder_kv_blocks_ttl``
480 s outlasts a chat), the async scheduler and a stop token (decode offers prompt + output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvscope.emulator.workloads.model import Workload
from kvscope.reuse.params import below_threshold, pull_count, remote_num_tokens


@dataclass(frozen=True)
class TurnMix:
    """Means over a workload's turns (tokens, blocks, shares), with the feature ON and OFF."""

    turns: int
    prompt_tokens: float  # mean prompt: what P computes with the feature OFF
    computed_on_tokens: float  # mean tokens P computes with the feature ON
    pull_share: float  # share of turns that read KV from decode with the feature ON
    pulled_tokens: float  # mean tokens per read
    read_blocks: float  # mean whole blocks per read (a partial last block moves whole)


@dataclass(frozen=True)
class TurnShape:
    """One turn as P prices it: its prompt, what it computes and pulls with the feature ON."""

    prompt_tokens: int
    computed_on_tokens: int
    pulled_tokens: int  # 0: no read
    read_blocks: int  # whole blocks of the read (a partial last block moves whole)


def turn_shapes(workload: Workload, kv_recompute_threshold: int = 64) -> list[TurnShape]:
    """Each of ``workload``'s turns with P's prefix cache off (see the module docstring)."""
    out: list[TurnShape] = []
    for conv in workload.conversations:
        previous = None
        for turn in conv.turns:
            count = 0
            if previous is not None and turn.shared_prefix_tokens > 0 and not turn.reset:
                offered = remote_num_tokens(previous.prompt_tokens + previous.output_tokens)
                count = max(pull_count(offered, turn.prompt_tokens, 0), 0)
                if below_threshold(count, kv_recompute_threshold):
                    count = 0
            # A full hit still computes the last token.
            out.append(TurnShape(turn.prompt_tokens, max(turn.prompt_tokens - count, 1), count,
                                 math.ceil(count / workload.block_size)))
            previous = turn
    return out


def turn_mix(workload: Workload, kv_recompute_threshold: int = 64) -> TurnMix:
    """The means of ``workload``'s turns with P's prefix cache off (see the module docstring)."""
    shapes = turn_shapes(workload, kv_recompute_threshold)
    turns = len(shapes)
    prompts = sum(t.prompt_tokens for t in shapes)
    computed = sum(t.computed_on_tokens for t in shapes)
    reads = sum(1 for t in shapes if t.pulled_tokens)
    pulled = sum(t.pulled_tokens for t in shapes)
    blocks = sum(t.read_blocks for t in shapes)
    if not turns:
        raise ValueError(f"workload {workload.name!r} has no turns to calibrate on")
    return TurnMix(
        turns=turns,
        prompt_tokens=prompts / turns,
        computed_on_tokens=computed / turns,
        pull_share=reads / turns,
        pulled_tokens=pulled / reads if reads else 0.0,
        read_blocks=blocks / reads if reads else 0.0,
    )


__all__ = ["TurnMix", "TurnShape", "turn_mix", "turn_shapes"]
