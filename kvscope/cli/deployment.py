"""Options of a P/D deployment that several commands take, each declared once.

``emulate``, ``simulate``, ``replay`` and ``proxy`` describe the same deployment: a setting any
two of them take is one :class:`Flag` here, with one flag, one default and one help, and
:func:`add` puts it on each command's parser (``tests/test_cli_settings_agree.py`` checks that
two commands never disagree on a flag's default or help). Flags are vLLM's where vLLM has the
knob (``--served-model-name``, ``--async-scheduling``, ``--kv-load-failure-policy``). An older
spelling stays accepted as a hidden alias, so scripts keep working.

Seeds: ``--seed`` seeds what the *engines* draw (faults, request-id suffixes, emulated outputs);
``--workload-seed`` seeds what the *workload* draws (synthetic content, arrivals).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvscope import settings

__all__ = ["FLAGS", "Flag", "PER_COMMAND", "add", "add_fault", "deprecated_alias"]


@dataclass(frozen=True)
class Flag:
    """One option several commands take: flag, default, help, type and older spellings."""

    dest: str
    flag: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # older spellings: accepted, not shown in --help
    setting: str | None = None  # the kvscope setting behind it (environment variable too)

    def full_help(self) -> str:
        """The help with its default (and environment variable), as every command shows it."""
        value = self.default
        if value is None:
            return self.help
        shown = ("on" if value else "off") if self.type is bool else repr(value)
        env = f"; env {settings.SETTINGS[self.setting].env_var}" if self.setting else ""
        return f"{self.help} (default {shown}{env})"


def _of_setting(name: str) -> Flag:
    """The option of a kvscope setting (its flag, type, default and help; env var too)."""
    setting = settings.SETTINGS[name]
    return Flag(name, setting.cli_flag, setting.type, setting.default, setting.help,
                setting=name)


FLAGS: dict[str, Flag] = {f.dest: f for f in (
    Flag("model", "--served-model-name", str, "kvscope-emulated",
         "model name the engines serve (vLLM's --served-model-name); replay sends it in each "
         "request, simulate records it", aliases=("--model",)),
    Flag("async_scheduling", "--async-scheduling", bool, True,
         "the engines' scheduler: async (vLLM's default off CPU; decode offers prompt + output "
         "after a stop token) or, with --no-async-scheduling, synchronous (prompt + output - 1)"),
    Flag("kv_load_failure_policy", "--kv-load-failure-policy", str, "fail",
         "what prefill does after a failed KV load (vLLM's kv_load_failure_policy): fail ends "
         "the request in error; recompute reschedules it",
         choices=("fail", "recompute")),
    Flag("prefill_cache_blocks", "--prefill-cache-blocks", int, 1 << 22,
         "KV blocks each prefill engine's prefix cache may hold (vLLM: num_gpu_blocks)",
         aliases=("--prefix-cache-blocks",)),
    # Not 0: each vLLM process has its own perf_counter epoch, and kv_transfer_params carry
    # decode's clock, so every run shows that nothing compares the two clocks.
    Flag("decode_clock_offset_s", "--decode-clock-offset", float, 1234.5,
         "seconds decode's perf_counter is ahead of prefill's (times the decode index)"),
    Flag("seed", "--seed", int, 0,
         "seed of what the engines draw: fault draws, request-id suffixes, emulated outputs "
         "(the workload's: --workload-seed)"),
    Flag("workload_seed", "--workload-seed", int, 0,
         "seed of the workload: synthetic content and weka arrivals"),
    Flag("run_label", "--run-label", str, "",
         settings.SETTINGS["run_label"].help + " Empty: emulate, simulated (the command's)",
         aliases=("--label",),
         setting="run_label"),
    *(_of_setting(name) for name in ("router_ttl", "decoder_kv_blocks_ttl",
                                     "kv_recompute_threshold")),
    Flag("bidirectional_kv_xfer", "--bidirectional-kv-xfer", bool, True,
         "D->P KV reuse on prefill and decode alike (kv_connector_extra_config "
         "bidirectional_kv_xfer on both; the feature on/off)"),
    Flag("prefill_prefix_caching", "--enable-prefix-caching", bool, True,
         "prefix caching on the prefill engines (--no-enable-prefix-caching: off, as the vLLM "
         "blog's P)"),
    Flag("trace", "--trace", str, None,
         "weka: traces_flat.csv (default: the shipped copy), a raw trace_*.json or a folder of "
         "them; mooncake: the JSONL trace (required)"),
    Flag("truth", "--truth", str, None,
         "also write every turn's ground truth here, as JSON lines (emulate with --db: "
         "<db>.truth.jsonl when left out)"),
    Flag("time_scale", "--time-scale", float, 1.0,
         "divide every think time (the wait after a turn's answer before the next turn; a "
         "trace's recorded send times too) and every conversation's start offset by this "
         "factor: 12 turns a 60 s tool wait into 5 s; token counts, the servers' timing and "
         "their TTLs are not scaled (kvscope emulate --time-scale scales those)"),
    Flag("reuse_guard", "--reuse-guard", bool, False,
         "send prefill vLLM's MISS params when the message history does not continue the turn "
         "whose decode KV the router holds (edited or truncated history, another client's "
         "request under the same conversation id); off, the proxy behaves exactly as vLLM's"),
)}

# Flags two commands spell alike but mean per command (each its own side or its own input),
# and why; the agreement test holds this list to the parsers (an entry whose commands agree
# again fails it, so the list cannot go stale).
PER_COMMAND: dict[str, str] = {
    "--time-scale": "emulate's scales the servers' model time (durations and TTLs); replay's "
                    "and simulate's the workload's waits, so a replay against an emulator "
                    "passes the same factor to both",
    "--conversations": "replay drives real servers in wall time and takes 8 conversations or "
                       "traces unless told; simulate runs in virtual time and takes a whole "
                       "trace (8 synthetic sessions)",
    "--workload": "simulate also runs the published sweep (--workload sweep), which needs no "
                  "servers; replay takes the workload sources only",
    "--profile": "emulate runs in wall time, so its default is the fast 'tiny' model; simulate "
                 "runs in virtual time and defaults to the published deployment's qwen3-32b",
}


def add(parser: argparse.ArgumentParser | Any, name: str, *,
        unset: bool = False, dest: str | None = None, raw: bool = False) -> argparse.Action:
    """Add the declared option ``name`` to ``parser`` (a parser or an argument group).

    The parsed value of an absent option is the declared default, or None with ``unset`` (for
    a caller that tells "not given" apart: the simulator's sweeps, a setting's environment
    variable); the help shows the declared default either way. Aliases are hidden options of
    the same dest. ``dest``: the attribute it parses into, where a command's record names the
    field otherwise (simulate's ``label``). ``raw``: keep the text, for a caller that parses
    and checks it itself (one-line errors naming the option, sweeps of the same values).
    """
    flag = FLAGS[name]
    default = None if unset or flag.setting else flag.default
    kwargs: dict[str, Any] = {"dest": dest or flag.dest, "default": default,
                              "help": flag.full_help()}
    if flag.type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = str if raw else flag.type
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        else:
            kwargs["metavar"] = flag.dest.upper()
    action = parser.add_argument(flag.flag, **kwargs)
    for alias in flag.aliases:
        hidden = {k: v for k, v in kwargs.items() if k not in ("help", "default")}
        parser.add_argument(alias, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **hidden)
    return action


def add_fault(parser: argparse.ArgumentParser) -> None:
    """``--fault NAME[=P]``: one help naming every fault and which command injects it."""
    from kvscope.emulator.faults import FAULTS
    from kvscope.emulator.simulator import SIM_FAULTS

    both = sorted(set(FAULTS) & set(SIM_FAULTS))
    only_emulate = sorted(set(FAULTS) - set(SIM_FAULTS))
    only_simulate = sorted(set(SIM_FAULTS) - set(FAULTS))
    parser.add_argument(
        "--fault", action="append", default=[], metavar="NAME[=P]",
        help="inject a fault into a share P of turns (P 1 when left out; repeatable): "
             + ", ".join(both) + "; emulate only: " + ", ".join(only_emulate)
             + "; simulate only: " + ", ".join(only_simulate))


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str,
                     **kwargs: Any) -> None:
    """Accept ``old`` (hidden from --help) for ``new``, with a one-line deprecation warning."""
    import sys

    class _Deprecated(argparse.Action):
        def __call__(self, p: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: Any, option_string: str | None = None) -> None:
            print(f"kvscope: {old} is deprecated here; use {new}", file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, action=_Deprecated, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)
