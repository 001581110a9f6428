"""The reuse rules of vLLM 0.33.0's NIXL D→P readback, written once for every layer of kvscope.

    params.py     kv_transfer_params fields and keys, the offer check, the threshold, the
                  pull count, the worker's expiry guard, remote_num_tokens by scheduling mode
    content.py    what a chat message's content is as prompt text (text parts joined)
    boundaries.py keyed chained hashes of a conversation's messages: does a turn continue the
                  last (the reuse guard, the ledger, the emulator's truth)
    router.py     the proxy's per-conversation cache of decode's params (single use, TTL)
    validity.py   which of decode's blocks a read puts where, and whether they match the prompt
    taint.py      which later turns read KV an invalid load computed (prefix cache, retention)
    outcomes.py   the closed list of per-turn outcomes and their evidence templates
    decisions.py  every outcome as one ordered table of rules over named facts, with a scalar
                  evaluator and a polars rendering

Pure: no I/O, no clock, nothing above ``kvscope.semconv`` and ``kvscope.boundary_key``. The
emulator's model, the vLLM instrumentor, the proxy, the ledger and what-if import these; none
re-spells them.
"""

__all__ = ["boundaries", "content", "decisions", "outcomes", "params", "router", "taint",
           "validity"]
