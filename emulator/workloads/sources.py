"""One way to load a workload by kind: ``synthetic`` (seeded), ``weka`` (the shipped CSV, a raw
``trace_*.json`` or a folder of them) or ``mooncake`` (a JSONL trace). ``kvscope replay`` and
``kvscope simulate`` both load through :func:`load`."""

from __future__ import annotations

from pathlib import Path

from kvscope.emulator.workloads.model import DEFAULT_BLOCK_SIZE, Workload, WorkloadError
from kvscope.errors import SettingError

__all__ = ["KINDS", "load"]

KINDS = ("synthetic", "weka", "mooncake")


def load(kind: str, **options: object) -> Workload:
    """The workload of ``kind`` (:func:`_load`); :class:`WorkloadError` when it has no turn (an
    empty trace, a folder of empty traces): a run of nothing is never recorded."""
    workload = _load(kind, **options)  # type: ignore[arg-type]
    if workload.num_requests == 0:
        raise WorkloadError(f"{workload.source or kind}: no turns to run (an empty trace?)")
    return workload


def _load(kind: str, *, trace: str | Path | None = None, conversations: int | None = None,
         max_turns: int | None = None, seed: int = 0, token_scale: float = 1.0,
         arrival_rate_per_s: float = 0.0, time_compression: float = 1.0,
         block_size: int = DEFAULT_BLOCK_SIZE) -> Workload:
    """The workload of ``kind``; :class:`SettingError` naming the option that is wrong.

    ``conversations`` is the number of sessions (synthetic; default its generator's) or the first
    traces / sessions of a trace (default: all); ``time_compression`` divides a trace's waits and
    start times; ``seed`` seeds the synthetic workload and the WEKA arrivals.
    """
    if kind not in KINDS:
        raise SettingError(f"--workload {kind!r}: choose one of {', '.join(KINDS)}")
    if time_compression <= 0:
        raise SettingError(f"--time-scale={time_compression}: must be > 0")
    if conversations is not None and conversations < 1:
        raise SettingError(f"--conversations={conversations}: must be >= 1")
    raw_weka = kind == "weka" and trace is not None and (
        Path(trace).is_dir() or Path(trace).suffix == ".json")
    # An option the kind does not read is refused, never silently dropped.
    given = {"--trace": trace is not None, "--token-scale": token_scale != 1.0,
             "--arrival-rate": arrival_rate_per_s != 0.0, "a workload seed": seed != 0,
             "--time-scale": time_compression != 1.0}
    unused = {"synthetic": ("--trace", "--token-scale", "--arrival-rate", "--time-scale"),
              "weka": ("--token-scale",) if raw_weka else (),
              "mooncake": ("--token-scale", "--arrival-rate", "a workload seed")}[kind]
    ignored = [flag for flag in unused if given[flag]]
    if ignored:
        raise SettingError(f"--workload {kind}{' (raw traces)' if raw_weka else ''} does not "
                           f"use {', '.join(ignored)}")
    if kind == "synthetic":
        from kvscope.emulator.workloads.synthetic import generate

        overrides: dict[str, object] = {"seed": seed, "block_size": block_size}
        if conversations is not None:
            overrides["conversations"] = conversations
        if max_turns is not None:
            overrides["max_turns"] = max_turns
        return generate(**overrides)
    if kind == "weka":
        from kvscope.emulator.workloads import weka

        path = Path(trace) if trace is not None else None
        if path is not None and (path.is_dir() or path.suffix == ".json"):
            files = sorted(path.glob("trace_*.json")) if path.is_dir() else [path]
            if not files:
                raise SettingError(f"--trace {path}: no trace_*.json files in this folder")
            if conversations is not None:
                files = files[:conversations]
            return weka.load_raw(files, max_turns=max_turns, time_compression=time_compression,
                                 arrival_rate_per_s=arrival_rate_per_s, seed=seed,
                                 block_size=block_size)
        return weka.load_csv(path, conversations=conversations, max_turns=max_turns,
                             token_scale=token_scale, time_compression=time_compression,
                             arrival_rate_per_s=arrival_rate_per_s, seed=seed,
                             block_size=block_size)
    from kvscope.emulator.workloads import mooncake

    if trace is None:
        raise SettingError("--trace is required with --workload mooncake")
    return mooncake.load(trace, conversations=conversations, max_turns=max_turns,
                         time_compression=time_compression, block_size=block_size)
