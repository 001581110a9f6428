"""The emulator: a stand-in for a vLLM P/D deployment with bidirectional KV transfer.

    reuse_model/     the scheduler/worker behaviour of vLLM 0.33.0's NIXL readback, as a model
    cost_model.py    prefill/decode/transfer times per model profile; turn_mix.py the mean turn
                     composition the profiles are calibrated on
    physics.py       prefill/transfer times from the model's shape and the hardware's limits
    capacity.py      decode KV blocks from a GPU profile; turns waiting for blocks
    model_config.py  a model's shape read from its config.json (--model-config)
    tokens.py, faults.py, ground_truth.py   token streams, injected faults, per-turn truth
                     (account_turn labels a turn with the decision table)
    servers.py       the HTTP prefill/decode engines (``kvscope emulate``); launcher.py starts them
    openai_api.py    vLLM's OpenAI-compatible request and response shapes the engines speak
    vllm_metrics.py  the engines' /metrics: vLLM's own reuse counters, counted where vLLM does
    replay.py        replays a workload over HTTP through a proxy
    simulator.py     the virtual-time simulator (``kvscope simulate`` is kvscope.cli.simulate);
                     span_process.py its span builders, here or in a span process
    sweeps.py        the runs of a sweep: every combination of swept settings, and the
                     published ON/OFF sweep
    workloads/       synthetic, WEKA and Mooncake workloads
"""

__all__ = [
    "capacity", "cost_model", "faults", "ground_truth", "launcher", "model_config", "openai_api",
    "physics",
    "replay", "reuse_model", "servers", "simulator", "span_process", "sweeps", "tokens",
    "turn_mix", "vllm_metrics", "workloads",
]
