"""Stores several test modules share: simulated ones (seeded, so every build gives the same
rows), and one way to read a store back."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvscope.emulator.simulator import (
    FAULT_HANDSHAKE,
    FAULT_NO_CONVERSATION_ID,
    FAULT_PREEMPT,
    FAULT_STRIP_METADATA,
    FAULT_TRANSFER,
    SimulationSettings,
    simulate,
)
from kvscope.emulator.workloads import synthetic
from kvscope.emulator.workloads.model import Workload
from kvscope.store.database import open_readonly


def on_off_store(db: Path, *, seed: int, conversations: int, turns_p50: int, max_turns: int,
                 on_label: str = "ON") -> Path:
    """Feature ON and OFF over one calm workload (no resets, no subagents, waits 5-20 s); P's
    own prefix cache off, so reuse is remote. Different run seeds: request ids never repeat."""
    workload = calm_workload(seed=seed, conversations=conversations, turns_p50=turns_p50,
                             max_turns=max_turns)
    for label, on, run_seed in ((on_label, True, 1), ("OFF", False, 2)):
        simulate(workload, db, SimulationSettings(
            profile="qwen3-32b", label=label, prefill_bidirectional_kv_xfer=on,
            decode_bidirectional_kv_xfer=on, prefill_prefix_caching=False, seed=run_seed))
    return db


def calm_workload(*, seed: int, conversations: int, turns_p50: int, max_turns: int,
                  **sizes: int) -> Workload:
    """A workload with no resets, no subagents and tool waits of 5-20 s; ``sizes`` overrides
    other fields of the synthetic workload (token counts)."""
    return synthetic.generate(
        seed=seed, conversations=conversations, turns_p50=turns_p50, max_turns=max_turns,
        think_time_p50_s=5, think_time_p90_s=20, reset_probability=0.0,
        subagent_probability=0.0, **sizes)


def busy_workload(*, turns_p50: int, max_turns: int, conversations: int = 8) -> Workload:
    """Conversations (eight by default) with a shared system prompt, long and short tool waits,
    resets and subagents: a workload on which faults leave many different outcomes."""
    return synthetic.generate(
        seed=5, conversations=conversations, turns_p50=turns_p50, max_turns=max_turns,
        system_prompt_tokens=700, new_input_tokens_p50=250, think_time_p50_s=4,
        think_time_p90_s=30, reset_probability=0.08, subagent_probability=0.1)


# Faults that, on busy_workload, leave turns of every kind of miss beside the reused ones.
FAULT_MIX = {FAULT_NO_CONVERSATION_ID: 0.15, FAULT_STRIP_METADATA: 0.1, FAULT_TRANSFER: 0.1,
             FAULT_HANDSHAKE: 0.05, FAULT_PREEMPT: 0.1}


def simulate_faults(workload: Workload, db: Path) -> None:
    """Simulate ``workload`` into ``db`` as the run labelled "faults": FAULT_MIX, a 20 s decode
    TTL, failed loads recomputed."""
    simulate(workload, db, SimulationSettings(profile="tiny", label="faults", seed=17,
                                              faults=FAULT_MIX, decoder_kv_blocks_ttl=20.0,
                                              kv_load_failure_policy="recompute"))


def query(db: Path, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
    """Every row ``sql`` (with bound ``params``) gives on the store ``db``, read-only."""
    con = open_readonly(db)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()
