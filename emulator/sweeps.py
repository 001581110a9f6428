"""The runs of a simulation sweep: every combination of swept settings, and the published sweep.

:func:`expand` makes one :class:`SimulationSettings` per combination of the values of
:class:`Sweep` s (``kvscope simulate --sweep KEY=V1,V2``), each labelled with its values.

:func:`sweep_runs` is ``kvscope simulate --workload sweep``: the published bidirectional-KV
sweep as simulator runs. The setup of :mod:`kvscope.published`: 1P1D, prefix caching off on the
prefill node only, the feature ON and OFF (``kv_recompute_threshold`` and
``decoder_kv_blocks_ttl`` as the options give them: their defaults, 64 and 480, are the
published ones), for each published model's cost profile, over shared prefixes from 2k to 24k
tokens (:data:`DEFAULT_PREFIX_TOKENS`: the published ends and points between them). Each run's
workload is :func:`kvscope.emulator.workloads.published_sweep.generate` at its prefix; the runs
are labelled ``<profile> prefix=<tokens> bidirectional-kv-xfer=<on|off>``. The
``published_sweep`` analysis then puts the published values beside the simulated ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from kvscope import published
from kvscope.emulator.simulator import SimulationSettings
from kvscope.emulator.workloads import published_sweep
from kvscope.emulator.workloads.model import Workload
from kvscope.errors import SettingError

# The label key of a sweep over both sides' bidirectional_kv_xfer (the feature on/off).
BOTH_SIDES = "bidirectional_kv_xfer"


@dataclass(frozen=True)
class Sweep:
    """One swept setting: the field (or :data:`BOTH_SIDES`), its values, parsed, and the name
    the run labels give it (the option's flag)."""

    field: str
    values: tuple[Any, ...]
    name: str


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _settings(values: Mapping[str, Any], where: str) -> SimulationSettings:
    try:
        return SimulationSettings(**values)
    except ValueError as exc:
        raise SettingError(f"{where}: {exc}") from None


def expand(base: SimulationSettings, sweeps: Sequence[Sweep],
           check: Callable[[Mapping[str, Any], str], SimulationSettings] = _settings,
           ) -> list[SimulationSettings]:
    """One settings per combination of swept values, each labelled with its values.

    ``check`` builds each (SettingError naming the combination where it is not valid).
    """
    if not sweeps:
        return [base]
    out = []
    for combo in itertools.product(*(s.values for s in sweeps)):
        values = {f.name: getattr(base, f.name) for f in fields(base)}
        parts = []
        for sweep, value in zip(sweeps, combo, strict=True):
            if sweep.field == BOTH_SIDES:
                values["prefill_bidirectional_kv_xfer"] = value
                values["decode_bidirectional_kv_xfer"] = value
            else:
                values[sweep.field] = value
            parts.append(f"{sweep.name}={_show(value)}")
        values["label"] = " ".join([base.label, *parts])
        out.append(check(values, "--sweep " + " ".join(parts)))
    return out


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


__all__ = ["BOTH_SIDES", "DEFAULT_PREFIX_TOKENS", "Sweep", "SweepRun", "expand", "sweep_runs"]
