"""Loaded by every Python process of the tier's vLLM servers (``PYTHONPATH``): NIXL's progress
thread waits ``TIER_NIXL_PROGRESS_DELAY_US`` between polls instead of none.

nixl 1.5.1's Python agent (``nixl/_api.py``) sets ``agent_config.pthrDelay = 0``, and vLLM
passes no setting for it: the UCX progress thread then polls its workers with a zero timeout for
ever, one core per NIXL server (measured: an idle P/D pair held 1.0 core each; with a 1 ms delay
0.03, and a 3-turn conversation took 3.6 s instead of 47-65 s on this 2-core machine). On a GPU
host that thread has a core to itself; here four servers' threads starve everything else, and
vLLM's 5 s handshake wait then fails. The delay changes when NIXL polls, not what it transfers.

Not part of kvscope: the tier's own server setting, as ``UCX_TLS`` is.
"""

import os
import sys

_DELAY_US = int(os.environ.get("TIER_NIXL_PROGRESS_DELAY_US") or 0)


def _patch(delay_us: int) -> None:
    import nixl._api as api  # the backend nixl chose (nixl_cu12 here), as vLLM imports it

    base = api.nixlBind.nixlAgentConfig
    field = base.__dict__["pthrDelay"]

    class AgentConfig(base):  # type: ignore[misc, valid-type]
        """nixl's agent config whose progress delay is at least ``delay_us``."""

        @property
        def pthrDelay(self) -> int:  # noqa: N802 (nixl's name)
            return int(field.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            field.__set__(self, max(int(value), delay_us))

    api.nixlBind.nixlAgentConfig = AgentConfig


if _DELAY_US > 0:
    try:
        _patch(_DELAY_US)
    except Exception as exc:  # the server still starts, spinning as nixl starts it
        print(f"tier sitecustomize: NIXL's progress delay not set ({exc!r})", file=sys.stderr)
