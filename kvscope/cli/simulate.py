"""``kvscope simulate``: the virtual-time simulator on a workload, one run or a sweep, into a store.

Every :class:`~kvscope.emulator.simulator.SimulationSettings` field is an option, named as vLLM
names it where vLLM has the knob (:data:`OPTIONS`). ``--sweep KEY=V1,V2`` (repeatable) runs every
combination of the listed values into the same store, each run labelled with its values
(:func:`expand`); :func:`run_all` runs them with a progress line on stderr (turns sent / total,
virtual time, turns a second). The command ends with a summary per run read back from the store
through the analysis registry (the ``verdict`` analysis: reuse, top miss causes, retained GiB·s,
TTFT p50 / p90), so its numbers are those ``kvscope report`` shows for the same store;
``--workload sweep`` prints the published sweep beside its simulation instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvscope import progress, published, settings
from kvscope.cli import deployment
from kvscope.cli.options import add_setting, add_workload_scaling, required
from kvscope.emulator.capacity import GPUS, NO_GPU
from kvscope.emulator.cost_model import PROFILES
from kvscope.emulator.simulator import (
    COST_MODELS,
    SIM_FAULTS,
    SimulationResult,
    SimulationSettings,
    iter_truth,
    simulate,
)
from kvscope.emulator.sweeps import BOTH_SIDES, Sweep
from kvscope.emulator.sweeps import expand as sweeps_expand
from kvscope.emulator.workloads.model import Workload
from kvscope.errors import SettingError
from kvscope.reuse.params import (
    FAILURE_POLICY_FAIL,
    FAILURE_POLICY_RECOMPUTE,
    SCHEDULING_ASYNC,
    SCHEDULING_MODES,
    SCHEDULING_SYNC,
)
from kvscope.settings import parse_bool
from kvscope.tables import NOT_MEASURED

WORKLOADS = ("synthetic", "weka", "mooncake", "sweep")
_DEFAULTS = SimulationSettings()


@dataclass(frozen=True)
class Option:
    """One :class:`SimulationSettings` field as a command-line option."""

    field: str
    flag: str
    parse: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None
    setting: str | None = None  # the kvscope setting that gives its default (env var too)

    @property
    def declared(self) -> deployment.Flag | None:
        """The shared declaration of this option (:mod:`kvscope.cli.deployment`), if any."""
        return next((f for f in deployment.FLAGS.values() if f.flag == self.flag), None)

    @property
    def default(self) -> Any:
        if self.field == "label":
            return settings.resolve("run_label") or _DEFAULTS.label
        if self.setting is not None:
            return settings.resolve(self.setting)
        return getattr(_DEFAULTS, self.field)

    def value(self, raw: str, where: str) -> Any:
        """``raw`` parsed and checked; SettingError naming ``where`` otherwise."""
        try:
            # A setting's own parser checks its range too (a TTL must be > 0), as everywhere.
            value = (settings.SETTINGS[self.setting].parse(raw) if self.setting is not None
                     else self.parse(raw))
        except (ValueError, TypeError) as exc:
            raise SettingError(f"{where}: {exc}") from None
        if self.choices is not None and value not in self.choices:
            raise SettingError(f"{where}: choose one of {', '.join(self.choices)}")
        return value


# Every SimulationSettings field but ``faults`` (``--fault NAME=P``); a test holds this to the
# dataclass. Flags are vLLM's where vLLM has the knob.
OPTIONS: tuple[Option, ...] = (
    Option("label", "--run-label", str,
           "run label (a sweep appends each run's KEY=VALUE pairs)"),
    Option("profile", "--profile", str, "cost-model profile timing prefill, transfer, decode",
           tuple(sorted(PROFILES))),
    Option("cost_model", "--cost-model", str,
           "how the profile's model is timed: fitted (solved on the published sweep) or physics "
           "(its config on the GPU's published limits: --gpu, else the published 8 x H200; "
           "docs/benchmarks.md, the physics cost model)", COST_MODELS),
    Option("model_config", "--model-config", str,
           "a model's config.json (Hugging Face layout) to size and time instead of the "
           "profile's model: with --cost-model physics; the efficiency is borrowed from the "
           "fitted model of its family (MoE or MLA: glm-5-fp8; dense: qwen3-32b)"),
    Option("prefill_nodes", "--prefill-nodes", int, "prefill engines (round robin)"),
    Option("decode_nodes", "--decode-nodes", int, "decode engines (round robin)"),
    Option("prefill_bidirectional_kv_xfer", "--prefill-bidirectional-kv-xfer", parse_bool,
           "prefill reads KV back from decode (kv_connector_extra_config bidirectional_kv_xfer)"),
    Option("decode_bidirectional_kv_xfer", "--decode-bidirectional-kv-xfer", parse_bool,
           "decode keeps finished turns' KV and offers it (bidirectional_kv_xfer)"),
    Option("kv_recompute_threshold", "--kv-recompute-threshold", int,
           "fewest reusable tokens worth pulling from decode", setting="kv_recompute_threshold"),
    Option("decoder_kv_blocks_ttl", "--decoder-kv-blocks-ttl", float,
           "seconds decode keeps a finished turn's KV blocks", setting="decoder_kv_blocks_ttl"),
    Option("router_ttl", "--router-ttl", float,
           "seconds the proxy keeps decode's metadata per conversation", setting="router_ttl"),
    Option("kv_load_failure_policy", "--kv-load-failure-policy", str,
           "what prefill does after a failed KV load (vLLM's default: fail)",
           (FAILURE_POLICY_FAIL, FAILURE_POLICY_RECOMPUTE)),
    # Hidden: --[no-]async-scheduling (vLLM's flag) is how the command line names it.
    Option("scheduling", "--scheduling", str,
           "the engines' scheduler (vLLM's default: async; sync never runs decode's last token)",
           SCHEDULING_MODES),
    Option("reuse_guard", "--reuse-guard", parse_bool,
           "the proxy sends MISS params when a history does not continue the turn whose "
           "decode KV it holds (kvscope proxy --reuse-guard)"),
    Option("prefill_prefix_caching", "--enable-prefix-caching", parse_bool,
           "prefix caching on the prefill engines (--no-enable-prefix-caching: off, as the "
           "vLLM blog's P)"),
    Option("prefill_cache_blocks", "--prefill-cache-blocks", int,
           "KV blocks each prefill engine's prefix cache may hold (vLLM: num_gpu_blocks)"),
    Option("decode_cache_blocks", "--decode-cache-blocks", int,
           "KV blocks each decode engine may hold (vLLM: num_gpu_blocks); retained handles "
           "and running requests share them, a turn that does not fit waits"),
    Option("gpu", "--gpu", str,
           "size each decode engine's KV blocks from this GPU's memory, the profile's model "
           "config and --gpu-memory-utilization (caps --decode-cache-blocks; none: off)",
           (NO_GPU, *sorted(GPUS))),
    Option("gpu_memory_utilization", "--gpu-memory-utilization", float,
           "share of GPU memory vLLM may use (with --gpu)"),
    Option("tensor_parallel_size", "--tensor-parallel-size", int,
           "GPUs per decode engine (with --gpu: weights and KV heads split over them)"),
    Option("decode_clock_offset_s", "--decode-clock-offset", float,
           "seconds decode's clock is ahead of prefill's (times the decode index)"),
    Option("seed", "--seed", int, "seed of fault draws and request-id suffixes"),
    Option("model", "--served-model-name", str, "model name the runs record (vLLM's flag)"),
)
_BY_FIELD = {o.field: o for o in OPTIONS}
_BY_NAME = {**_BY_FIELD, **{o.flag.removeprefix("--"): o for o in OPTIONS}}


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare the ``kvscope simulate`` options on ``parser``."""
    parser.add_argument("--workload", choices=WORKLOADS, default="synthetic",
                        help="workload source (default: synthetic); sweep: the published "
                             "bidirectional-KV sweep (1P1D, P prefix caching off, ON and OFF, "
                             "per published model's profile; see --prefix-tokens)")
    parser.add_argument("--prefix-tokens", default=None, metavar="N1,N2,...",
                        help="sweep: the shared prefixes to run (default: 2000,4000,8000,"
                             "12000,16000,20000,24000)")
    deployment.add(parser, "trace")
    add_setting(parser, "db", metavar="DB")
    deployment.add(parser, "truth")
    parser.add_argument("--conversations", type=int, default=None,
                        help="sessions (synthetic, default 8), first traces (weka) or first "
                             "sessions (mooncake); default: all of a trace")
    add_workload_scaling(parser)
    deployment.add(parser, "workload_seed")
    for option in OPTIONS:
        if option.declared is not None:
            deployment.add(parser, option.declared.dest, unset=True, dest=option.field,
                           raw=True)
            continue
        kwargs: dict[str, Any] = {"dest": option.field, "default": None}
        if option.parse is parse_bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            help_default = "on" if option.default else "off"
        else:
            kwargs["type"] = str
            kwargs["metavar"] = option.field.upper()
            if option.choices is not None:
                kwargs["choices"] = option.choices
                kwargs.pop("metavar")
            help_default = repr(option.default)
        env = (f"; env {settings.SETTINGS[option.setting].env_var}"
               if option.setting is not None else "")
        shown = f"{option.help} (default {help_default}{env})"
        parser.add_argument(option.flag, **kwargs,
                            help=argparse.SUPPRESS if option.field == "scheduling" else shown)
    deployment.add(parser, "async_scheduling", unset=True)
    deployment.add(parser, "bidirectional_kv_xfer", unset=True)
    deployment.add_fault(parser)
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="one run per value (repeatable: every combination); KEY is an "
                             "option above, e.g. decoder-kv-blocks-ttl=60,480 or "
                             "bidirectional-kv-xfer=on,off")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def _faults(items: Sequence[str]) -> dict[str, float]:
    faults: dict[str, float] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if name not in SIM_FAULTS:
            raise SettingError(f"--fault {item!r}: unknown fault; known: {', '.join(SIM_FAULTS)}")
        try:
            p = float(raw) if sep else 1.0
        except ValueError:
            raise SettingError(f"--fault {item!r}: {raw!r} is not a probability") from None
        if not 0.0 <= p <= 1.0:
            raise SettingError(f"--fault {item!r}: the probability must be within [0, 1]")
        faults[name] = p
    return faults


def base_settings(args: argparse.Namespace) -> SimulationSettings:
    """The settings the options give (before any sweep)."""
    values: dict[str, Any] = {}
    for option in OPTIONS:
        raw = getattr(args, option.field, None)
        if raw is None:
            values[option.field] = option.default
        elif isinstance(raw, bool):
            values[option.field] = raw
        else:
            values[option.field] = option.value(raw, f"{option.flag}={raw}")
    if values["label"] == "":
        values["label"] = _DEFAULTS.label
    if args.async_scheduling is not None and args.scheduling is None:
        values["scheduling"] = SCHEDULING_ASYNC if args.async_scheduling else SCHEDULING_SYNC
    if args.bidirectional_kv_xfer is not None:
        for name in ("prefill_bidirectional_kv_xfer", "decode_bidirectional_kv_xfer"):
            if getattr(args, name, None) is None:
                values[name] = args.bidirectional_kv_xfer
    values["faults"] = _faults(args.fault)
    return _checked(values, "options")


def _checked(values: Mapping[str, Any], where: str) -> SimulationSettings:
    for name in ("prefill_nodes", "decode_nodes"):
        if values[name] < 1:
            raise SettingError(f"{where}: {_BY_FIELD[name].flag} must be >= 1")
    try:
        return SimulationSettings(**values)
    except ValueError as exc:
        raise SettingError(f"{where}: {exc}") from None


def parse_sweep(text: str) -> Sweep:
    """``KEY=V1,V2,...`` as a :class:`Sweep` (KEY: a field or flag name, or
    ``bidirectional-kv-xfer`` for both sides)."""
    key, sep, raw = text.partition("=")
    key = key.strip().removeprefix("--")
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not sep or not values:
        raise SettingError(f"--sweep {text!r}: expected KEY=V1,V2,...")
    if key.replace("_", "-") == "bidirectional-kv-xfer":
        return Sweep(BOTH_SIDES,
                     tuple(_BY_FIELD["prefill_bidirectional_kv_xfer"].value(v, f"--sweep {text!r}")
                           for v in values), "bidirectional-kv-xfer")
    option = _BY_NAME.get(key) or _BY_NAME.get(key.replace("_", "-"))
    if option is None or option.field == "label":
        known = ", ".join(o.flag.removeprefix("--") for o in OPTIONS if o.field != "label")
        raise SettingError(f"--sweep {text!r}: unknown key {key!r}; known: {known}, "
                           "bidirectional-kv-xfer")
    return Sweep(option.field, tuple(option.value(v, f"--sweep {text!r}") for v in values),
                 option.flag.removeprefix("--"))


def expand(base: SimulationSettings, sweeps: Sequence[Sweep]) -> list[SimulationSettings]:
    """One settings per combination of swept values (:func:`kvscope.emulator.sweeps.expand`),
    checked as the options are."""
    return sweeps_expand(base, sweeps, _checked)


# --- workload -----------------------------------------------------------------------------------


def load_workload(args: argparse.Namespace, block_size: int) -> Workload:
    """The workload the options describe, at ``block_size`` tokens a block."""
    from kvscope.emulator.workloads import sources

    return sources.load(args.workload, trace=args.trace, conversations=args.conversations,
                        max_turns=args.max_turns, seed=args.workload_seed,
                        token_scale=args.token_scale, arrival_rate_per_s=args.arrival_rate,
                        time_compression=args.time_scale, block_size=block_size)


def sweep_plans(args: argparse.Namespace, base: SimulationSettings
                ) -> list[tuple[SimulationSettings, Callable[[int], Workload]]]:
    """``--workload sweep``: the published sweep's runs, each with its own workload."""
    from kvscope.emulator.sweeps import DEFAULT_PREFIX_TOKENS, sweep_runs

    if args.sweep:
        raise SettingError("--sweep cannot be combined with --workload sweep (it runs its own "
                           "sweep; narrow it with --profile and --prefix-tokens)")
    if args.trace is not None:
        raise SettingError("--trace is not used with --workload sweep")
    prefixes: tuple[int, ...] = DEFAULT_PREFIX_TOKENS
    if args.prefix_tokens is not None:
        try:
            prefixes = tuple(int(v) for v in args.prefix_tokens.split(",") if v.strip())
        except ValueError:
            raise SettingError(f"--prefix-tokens={args.prefix_tokens}: expected token counts "
                               "such as 2000,24000") from None
    profiles = [base.profile] if args.profile is not None else None
    return [(run.settings, run.workload) for run in sweep_runs(base, profiles, prefixes)]


def describe(workload: Workload) -> str:
    """One line about a workload (with the Mooncake grouping summary where there is one)."""
    from kvscope.emulator.workloads.mooncake import import_summary

    summary = workload.summary()
    line = (f"workload {workload.name}: {summary['conversations']} conversations, "
            f"{summary['requests']:,} turns, {summary['prompt_tokens']:,} prompt tokens")
    grouping = import_summary(workload)
    if grouping is not None:
        line += f"\n  mooncake grouping: {grouping.line()}"
    return line


# --- progress -----------------------------------------------------------------------------------


def _virtual(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


class ProgressLine:
    """The progress of one run on a stream: turns sent / total, virtual time, turns a second
    (drawn by :class:`kvscope.progress.Line`: rich on a terminal, a plain line at most every
    ``every_s`` seconds elsewhere, so logs stay short)."""

    def __init__(self, prefix: str, total: int, stream: TextIO, every_s: float = 5.0) -> None:
        self.total = total
        self.started = time.monotonic()
        self._line = progress.Line(prefix, total, stream, every_s=every_s)

    def _text(self, turns: int, virtual_s: float) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        share = f" ({100 * turns / self.total:.0f}%)" if self.total else ""
        return (f"{turns:,}/{self.total:,} turns{share}, virtual {_virtual(virtual_s)}, "
                f"{turns / elapsed:,.0f} turns/s")

    def __call__(self, turns: int, virtual_s: float) -> None:
        self._line.update(turns, lambda: self._text(turns, virtual_s))

    def close(self) -> None:
        """Stop drawing (idempotent; :meth:`done` calls it)."""
        self._line.close()

    def done(self, result: SimulationResult) -> None:
        """The run's closing line: turns, spans, wall time, rate."""
        elapsed = time.monotonic() - self.started
        text = (f"{result.turns:,} turns, {result.spans:,} spans in "
                f"{elapsed:.1f} s ({result.turns / max(elapsed, 1e-9):,.0f} turns/s), "
                f"virtual {_virtual(result.virtual_seconds)}")
        if result.decode_queued_turns:
            text += (f"; {result.decode_queued_turns:,} turns waited "
                     f"{_virtual(result.decode_queue_s)} in all for decode KV blocks "
                     f"({result.decode_kv_blocks:,} a decode engine, at most "
                     f"{result.decode_peak_blocks:,} held)")
        self._line.finish(text)


def run_each(runs: Sequence[tuple[SimulationSettings, Callable[[int], Workload]]],
             db: str | Path, *, stream: TextIO | None = None,
             truth: bool = True) -> Iterator[SimulationResult]:
    """Simulate each (plan, workload for a block size) into ``db`` in turn, with a progress
    line per run on ``stream``: runs whose workloads differ (the published sweep). ``truth``:
    label each turn's true outcome (what ``--truth`` writes)."""

    for number, (plan, workloads) in enumerate(runs, start=1):
        workload = workloads(plan.cost_profile().block_size)
        line = None
        if stream is not None:
            line = ProgressLine(f"[{number}/{len(runs)} {plan.label}]", workload.num_requests,
                                stream)
        try:
            result = simulate(workload, db, plan, progress=line, truth=truth)
        finally:
            if line is not None:
                line.close()
        if line is not None:
            line.done(result)
        yield result


def run_all(workloads: Callable[[int], Workload], plans: Sequence[SimulationSettings],
            db: str | Path, *, stream: TextIO | None = None,
            truth: bool = True) -> Iterator[SimulationResult]:
    """Simulate each plan into ``db`` in turn (``workloads`` gives the workload for a profile's
    block size); with ``stream``, a progress line per run."""
    yield from run_each([(plan, workloads) for plan in plans], db, stream=stream, truth=truth)


__all__ = ["OPTIONS", "Option", "ProgressLine", "SUMMARY_COLUMNS", "SWEEP_COLUMNS", "WORKLOADS",
    "base_settings", "configure", "describe", "expand", "load_workload", "parse_sweep", "run_all",
    "run_each", "run_simulate", "summary_rows", "sweep_plans", "sweep_rows"]


# --- the command ------------------------------------------------------------------------------


SUMMARY_COLUMNS = ("label", "turns", "reuse", "top miss causes", "retained GiB·s",
                   "TTFT p50 ms", "TTFT p90 ms")


def _pct(value: float | None) -> str:
    # One decimal (the verdict rounds to whole percents): a planner compares settings here.
    return NOT_MEASURED if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int) -> str:
    return NOT_MEASURED if value is None else f"{value:,.{digits}f}"


def summary_rows(db: str | Path, run_ids: Sequence[str]) -> list[tuple[str, ...]]:
    """Per run: reuse, top miss causes, retained GiB·s, TTFT p50 / p90, from the ``verdict``
    analysis of the registry (the numbers ``kvscope report`` shows)."""
    from kvscope.analysis import registry
    from kvscope.analysis.verdict import TOP_CAUSES

    with registry.AnalysisContext.open(db, runs=list(run_ids)) as ctx:
        verdict = registry.run(ctx, "verdict")
    by_id = {row["run_id"]: row for row in verdict.iter_rows(named=True)}
    rows: list[tuple[str, ...]] = []
    for run_id in run_ids:
        row = by_id.get(run_id, {})
        causes = ", ".join(
            f"{row[f'cause_{i}']} {_pct(row[f'cause_{i}_share'])}"
            for i in range(1, TOP_CAUSES + 1) if row.get(f"cause_{i}")
        ) or ("none" if row else NOT_MEASURED)
        turns = row.get("turns")
        rows.append((str(row.get("label") or run_id),
                     NOT_MEASURED if turns is None else f"{turns:,}",
                     _pct(row.get("token_reuse_rate")), causes,
                     _num(row.get("retained_gib_s"), 1), _num(row.get("ttft_p50_ms"), 0),
                     _num(row.get("ttft_p90_ms"), 0)))
    return rows


def _write_truth(path: Path, results: Sequence[SimulationResult]) -> int:
    count = 0
    with path.open("w") as out:
        for result in results:
            for row in iter_truth(result):
                out.write(json.dumps(row) + "\n")
                count += 1
    return count


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``kvscope simulate``: the runs, the truth file, then one summary row per run."""
    from kvscope.tables import format_rows

    args.db = required(args, "db")
    base = base_settings(args)
    if args.workload == "sweep":
        return _main_published_sweep(args, base)
    plans = expand(base, [parse_sweep(s) for s in args.sweep])
    model = base.model_shape()
    if model is not None:
        print(f"model {model.name} ({base.model_config}): {model.parameters / 1e9:.1f} B "
              f"parameters, {model.active_parameters / 1e9:.1f} B active, "
              f"{model.kv_bytes_per_token:,} KV bytes a token; timed by the physics with "
              f"{model.family}'s fitted efficiency (borrowed, not fitted to this model)",
              file=sys.stderr)
    loaded: dict[int, Workload] = {}

    def workload_for(block_size: int) -> Workload:
        if block_size not in loaded:
            loaded[block_size] = load_workload(args, block_size)
            print(describe(loaded[block_size]), file=sys.stderr)
        return loaded[block_size]

    started = time.monotonic()
    stream = None if args.quiet else sys.stderr
    results = list(run_all(workload_for, plans, args.db, stream=stream,
                           truth=bool(args.truth)))
    if args.truth:
        rows = _write_truth(Path(args.truth), results)
        print(f"truth: {rows:,} rows in {args.truth}", file=sys.stderr)
    print(f"{len(results)} run(s) into {args.db} in {time.monotonic() - started:.1f} s")
    sys.stdout.write(format_rows(list(SUMMARY_COLUMNS),
                                 summary_rows(args.db, [r.run_id for r in results]), "table"))
    print(f"report: kvscope report {args.db} -o report.html")
    return 0


def _main_published_sweep(args: argparse.Namespace, base: SimulationSettings) -> int:
    """``--workload sweep``: the published sweep's runs, then simulated vs published per run."""
    from kvscope.analysis import registry
    from kvscope.tables import format_rows

    runs = sweep_plans(args, base)
    started = time.monotonic()
    stream = None if args.quiet else sys.stderr
    results = list(run_each(runs, args.db, stream=stream, truth=bool(args.truth)))
    if args.truth:
        rows = _write_truth(Path(args.truth), results)
        print(f"truth: {rows:,} rows in {args.truth}", file=sys.stderr)
    print(f"{len(results)} run(s) into {args.db} in {time.monotonic() - started:.1f} s")
    with registry.AnalysisContext.open(args.db, runs=[r.run_id for r in results]) as ctx:
        table = registry.run(ctx, "published_sweep")
    sys.stdout.write(format_rows(list(SWEEP_COLUMNS), sweep_rows(table), "table"))
    print(f"published: {published.SOURCE}")
    print(f"report: kvscope report {args.db} -o report.html")
    return 0


SWEEP_COLUMNS = ("model", "feature", "prompt", "TTFT ms", "published", "ratio", "prefill ms",
                 "published", "ratio", "transfer ms", "published", "ratio")


def sweep_rows(table: Any) -> list[tuple[str, ...]]:
    """The ``published_sweep`` result as text rows (what the command and the benchmark print)."""
    def ms(value: float | None) -> str:
        return _num(value, 0)

    def ratio(value: float | None) -> str:
        return NOT_MEASURED if value is None else f"{value:.2f}"

    return [
        (str(r["model"]), str(r["feature"]), f"{r['prompt_tokens']:,}", ms(r["ttft_ms"]),
         ms(r["ttft_published_ms"]), ratio(r["ttft_ratio"]), ms(r["prefill_ms"]),
         ms(r["prefill_published_ms"]), ratio(r["prefill_ratio"]), ms(r["transfer_ms"]),
         ms(r["transfer_published_ms"]), ratio(r["transfer_ratio"]))
        for r in table.iter_rows(named=True)
    ]
