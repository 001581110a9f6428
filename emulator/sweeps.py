"""``kvscope simulate --workload sweep``: the published bidirectional-KV sweep as simulator runs.

The setup of :mod:`kvscope.published`: 1P1D, prefix caching off on the prefill node only,
the feature ON and OFF (``kv_recompute_threshold`` and ``decoder_kv_blocks_ttl`` as the options
give them: their defaults, 64 and 480, are the published ones), for each
published model's cost profile, over shared prefixes from 2k to 24k tokens
(:data:`DEFAULT_PREFIX_TOKENS`: the published ends and points between them). Each run's workload
is :func:`kvscope.emulator.workloads.published_sweep.generate` at its prefix; the runs are
labelled ``<profile> prefix=<tokens> bidirectional-kv-xfer=<on|off>``. The ``published_sweep``
analysis then puts the published values beside the simulated ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvscope import published
from kvscope.emulator.simulator import SimulationSettings
from kvscope.emulator.workloads import published_sweep
from kvscope.emulator.workloads.model import Workload
from kvscope.errors import SettingError

DEFAULT_PREFIX_TOKENS = (2000, 4000, 8000, 12000, 16000, 20000, 24000)


@dataclass(frozen=True)
class SweepRun:
    """One run of the sweep: its settings and the prefix its workload starts with."""

    settings: SimulationSettings
    prefix_tokens: int

    def workload(self, block_size: int) -> Workload:
        """The run's workload at ``block_size`` tokens a block."""
        sweep = published.for_profile(self.settings.profile)
        if sweep is None:  # sweep_runs builds runs only for profiles with a published sweep
            raise SettingError(f"no published sweep for profile {self.settings.profile!r}")
        return published_sweep.generate(
            self.prefix_tokens, conversations=sweep.conversations, turns=sweep.turns,
            new_tokens=sweep.new_tokens, output_tokens=sweep.output_tokens,
            clients=sweep.clients, block_size=block_size)


def sweep_runs(base: SimulationSettings, profiles: Sequence[str] | None = None,
               prefix_tokens: Sequence[int] = DEFAULT_PREFIX_TOKENS) -> list[SweepRun]:
    """Every run of the sweep: per profile, prefix and feature state (ON first)."""
    names = list(profiles) if profiles else [s.profile for s in published.SWEEPS]
    for name in names:
        if published.for_profile(name) is None:
            known = ", ".join(s.profile for s in published.SWEEPS)
            raise SettingError(f"--workload sweep: no published sweep for profile {name!r}; "
                               f"known: {known}")
    if not prefix_tokens or min(prefix_tokens) < 1:
        raise SettingError("--prefix-tokens: give one or more positive token counts")
    runs = []
    for name in names:
        for prefix in prefix_tokens:
            for on in (True, False):
                label = (f"{base.label} {name} prefix={prefix} "
                         f"bidirectional-kv-xfer={'on' if on else 'off'}")
                settings = replace(
                    base, label=label, profile=name, prefill_nodes=1, decode_nodes=1,
                    prefill_bidirectional_kv_xfer=on, decode_bidirectional_kv_xfer=on,
                    prefill_prefix_caching=False)
                runs.append(SweepRun(settings, prefix))
    return runs


__all__ = ["DEFAULT_PREFIX_TOKENS", "SweepRun", "sweep_runs"]
