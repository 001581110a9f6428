"""Seeded generator of agentic coding sessions shaped like the real WEKA / Claude Code traces.

A session starts with a system prompt and a user task, then alternates model calls and tool
results: each follow-up appends the model's reply and one tool result to the history. Tool waits
are lognormal with a heavy tail (defaults: p50 10 s, p90 167 s, as measured on the traces). A
context reset (random, or compaction when the prompt would exceed ``max_context_tokens``) keeps
the system prompt and task and replaces the rest with a summary. A sub-agent is a child
conversation (``parent_id``) with the parent's system prompt and its own task, spawned after a
parent turn; the parent's next turn waits for the child's estimated duration. Sessions arrive as a
Poisson process, optionally capped at ``max_concurrent_sessions`` open at once (estimated).

Same config (seed included) ⇒ identical workload.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass

from kvscope.emulator.workloads.model import (
    DEFAULT_BLOCK_SIZE,
    FOLLOW_UP_OVERHEAD_TOKENS,
    GENERATION_PROMPT_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    Conversation,
    Turn,
    Workload,
    WorkloadError,
    mix_seed,
)

_Z90 = 1.2815515655446004  # standard normal quantile of 0.9


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of the synthetic agentic workload; every size is in tokens, every time in seconds."""

    conversations: int = 8
    seed: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    system_prompt_tokens: int = 2048
    # One product, one system prompt: sessions share it (a prefix-cache hit across sessions).
    shared_system_prompt: bool = True
    task_tokens_p50: int = 200
    turns_p50: float = 20.0
    turns_sigma: float = 0.8
    max_turns: int = 60
    new_input_tokens_p50: int = 700
    new_input_tokens_sigma: float = 1.3
    max_new_input_tokens: int = 20_000
    output_tokens_p50: int = 200
    output_tokens_sigma: float = 0.8
    max_output_tokens: int = 4_000
    think_time_p50_s: float = 10.0
    think_time_p90_s: float = 167.0
    max_think_time_s: float = 3_600.0
    reset_probability: float = 0.017
    max_context_tokens: int = 128_000
    summary_tokens: int = 4_000
    subagent_probability: float = 0.02
    subagent_turns_p50: float = 10.0
    arrival_rate_per_s: float = 0.2
    max_concurrent_sessions: int = 0  # 0: no cap
    # Estimated seconds one model call takes; only used to place sub-agents and capped arrivals.
    est_turn_s: float = 2.0

    def validate(self) -> None:
        """Raise :class:`WorkloadError` naming the first invalid field."""
        checks = {
            "conversations": self.conversations >= 0,
            "block_size": self.block_size > 0,
            "system_prompt_tokens": self.system_prompt_tokens > MESSAGE_OVERHEAD_TOKENS,
            "max_turns": self.max_turns >= 1,
            "think_time_p90_s": self.think_time_p90_s >= self.think_time_p50_s > 0,
            "reset_probability": 0.0 <= self.reset_probability <= 1.0,
            "subagent_probability": 0.0 <= self.subagent_probability <= 1.0,
            "arrival_rate_per_s": self.arrival_rate_per_s >= 0.0,
            "max_concurrent_sessions": self.max_concurrent_sessions >= 0,
            "max_context_tokens": self.max_context_tokens
            > self.system_prompt_tokens + self.summary_tokens,
        }
        for name, ok in checks.items():
            if not ok:
                raise WorkloadError(
                    f"synthetic workload: invalid {name}={getattr(self, name)!r}"
                )


def _lognormal(rng: random.Random, p50: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, rng.lognormvariate(math.log(p50), sigma)))


class _Builder:
    def __init__(self, cfg: SyntheticConfig) -> None:
        self.cfg = cfg
        self.think_sigma = math.log(cfg.think_time_p90_s / cfg.think_time_p50_s) / _Z90

    def think(self, rng: random.Random) -> float:
        value = _lognormal(
            rng, self.cfg.think_time_p50_s, self.think_sigma, 0.0, self.cfg.max_think_time_s
        )
        return round(value, 3)

    def session(
        self, conv_id: str, start_s: float, system_seed: int, turns_p50: float,
        parent_id: str | None, out: list[Conversation],
    ) -> float:
        """Append the session and its sub-agents to ``out``; return its estimated duration."""
        cfg = self.cfg
        rng = random.Random(mix_seed(cfg.seed, "conversation", conv_id))
        num_turns = max(
            1, min(cfg.max_turns, round(rng.lognormvariate(math.log(turns_p50), cfg.turns_sigma)))
        )
        system = cfg.system_prompt_tokens
        task = MESSAGE_OVERHEAD_TOKENS + round(
            _lognormal(rng, cfg.task_tokens_p50, 0.7, 1, 20 * cfg.task_tokens_p50)
        )
        base = system + task  # the prefix a reset keeps
        turns: list[Turn] = []
        children: list[Conversation] = []
        elapsed = 0.0
        prompt = base + GENERATION_PROMPT_TOKENS
        output = round(_lognormal(rng, cfg.output_tokens_p50, cfg.output_tokens_sigma, 1,
                                  cfg.max_output_tokens))
        turns.append(Turn(1, 0.0, prompt, output, 0, prompt))
        pending_wait = 0.0  # extra wait: the parent waits for a sub-agent it spawned
        for index in range(2, num_turns + 1):
            think = self.think(rng) + pending_wait
            pending_wait = 0.0
            words = round(_lognormal(rng, cfg.new_input_tokens_p50, cfg.new_input_tokens_sigma, 1,
                                     cfg.max_new_input_tokens))
            history = prompt + output
            grown = history + words + FOLLOW_UP_OVERHEAD_TOKENS
            if rng.random() < cfg.reset_probability or grown > cfg.max_context_tokens:
                summary = round(_lognormal(rng, cfg.summary_tokens, 0.3, 1, cfg.summary_tokens * 2))
                prompt = base + summary + MESSAGE_OVERHEAD_TOKENS + GENERATION_PROMPT_TOKENS
                shared, reset = base, True
            else:
                prompt, shared, reset = grown, history, False
            output = round(_lognormal(rng, cfg.output_tokens_p50, cfg.output_tokens_sigma, 1,
                                      cfg.max_output_tokens))
            elapsed += cfg.est_turn_s + think
            turns.append(Turn(index, think, prompt, output, shared, prompt - shared, reset))
            if parent_id is None and index < num_turns and rng.random() < cfg.subagent_probability:
                child_id = f"{conv_id}.sa{len(children) + 1}"
                child_start = start_s + elapsed + cfg.est_turn_s
                duration = self.session(
                    child_id, child_start, system_seed, cfg.subagent_turns_p50, conv_id, children
                )
                pending_wait = duration + cfg.est_turn_s
        out.append(
            Conversation(
                id=conv_id,
                start_s=round(start_s, 3),
                turns=tuple(turns),
                parent_id=parent_id,
                seed=mix_seed(cfg.seed, "content", conv_id),
                system_seed=system_seed,
                system_prompt_tokens=system,
                task_tokens=task,
            )
        )
        out.extend(children)
        return elapsed + cfg.est_turn_s


def generate(config: SyntheticConfig | None = None, **overrides: object) -> Workload:
    """Generate a synthetic agentic workload; ``overrides`` replace config fields by name."""
    cfg = config or SyntheticConfig()
    if overrides:
        unknown = sorted(set(overrides) - set(asdict(cfg)))
        if unknown:
            raise WorkloadError(f"synthetic workload: unknown option(s) {', '.join(unknown)}")
        cfg = SyntheticConfig(**{**asdict(cfg), **overrides})
    cfg.validate()
    builder = _Builder(cfg)
    arrivals = random.Random(mix_seed(cfg.seed, "arrivals"))
    lanes: list[float] = []  # estimated end times of open sessions, when capped
    out: list[Conversation] = []
    clock = 0.0
    for number in range(cfg.conversations):
        if number and cfg.arrival_rate_per_s > 0:
            clock += arrivals.expovariate(cfg.arrival_rate_per_s)
        start = clock
        if cfg.max_concurrent_sessions and len(lanes) >= cfg.max_concurrent_sessions:
            start = max(start, heapq.heappop(lanes))
        conv_id = f"syn-{cfg.seed}-{number:05d}"
        system_seed = (
            mix_seed(cfg.seed, "system") if cfg.shared_system_prompt
            else mix_seed(cfg.seed, "system", conv_id)
        )
        duration = builder.session(conv_id, start, system_seed, cfg.turns_p50, None, out)
        if cfg.max_concurrent_sessions:
            heapq.heappush(lanes, start + duration)
    return Workload(
        name=f"synthetic-seed{cfg.seed}",
        block_size=cfg.block_size,
        conversations=tuple(out),
        source="synthetic",
        settings=asdict(cfg),
    )


__all__ = ["SyntheticConfig", "generate"]
