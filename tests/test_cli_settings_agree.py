"""The commands that describe one P/D deployment agree on every setting they share.

``emulate``, ``simulate``, ``replay`` and ``proxy``: an option two of them take has one flag, one
default and one help (:mod:`kvscope.cli.deployment` declares it once), except the few that
``deployment.PER_COMMAND`` names with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope import cli
from kvscope.cli import deployment
from kvscope.cli.analysis import sql_params

COMMANDS = ("emulate", "simulate", "replay", "proxy")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in COMMANDS}


def _shown(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Flag → action of every option ``--help`` shows."""
    return {flag: action for action in parser._actions if action.help != argparse.SUPPRESS
            for flag in action.option_strings if flag not in ("-h", "--help")}


def _shared() -> dict[str, dict[str, argparse.Action]]:
    by_flag: dict[str, dict[str, argparse.Action]] = {}
    for command, parser in _parsers().items():
        for flag, action in _shown(parser).items():
            by_flag.setdefault(flag, {})[command] = action
    return {flag: seen for flag, seen in by_flag.items() if len(seen) > 1}


def test_two_commands_taking_one_option_agree_on_its_help_and_default() -> None:
    shared = _shared()
    assert {"--served-model-name", "--seed", "--run-label", "--async-scheduling",
            "--kv-load-failure-policy", "--decode-clock-offset", "--prefill-cache-blocks",
            "--fault"} <= set(shared)
    for flag, seen in shared.items():
        if flag in deployment.PER_COMMAND:
            continue
        helps = {command: action.help for command, action in seen.items()}
        assert len(set(helps.values())) == 1, f"{flag}: {helps}"
        # A parsed default of None is "not given" (a setting's environment, a sweep); the help
        # then carries the declared default, compared above.
        defaults = {c: a.default for c, a in seen.items() if a.default is not None}
        assert len({repr(v) for v in defaults.values()}) <= 1, f"{flag}: {defaults}"


def test_every_per_command_exception_still_differs() -> None:
    shared = _shared()
    for flag in deployment.PER_COMMAND:
        assert flag in shared, f"{flag} is no longer shared: drop it from PER_COMMAND"
        helps = {a.help for a in shared[flag].values()}
        defaults = {repr(a.default) for a in shared[flag].values()}
        assert len(helps) > 1 or len(defaults) > 1, f"{flag} agrees now: drop the exception"


def test_declared_defaults_are_the_libraries_defaults() -> None:
    from kvscope.emulator.replay import DEFAULT_MODEL as REPLAY_MODEL
    from kvscope.emulator.servers import DEFAULT_MODEL, EmulatorConfig
    from kvscope.emulator.simulator import SimulationSettings

    sim = {f.name: f.default for f in dataclasses.fields(SimulationSettings)}
    emu = {f.name: f.default for f in dataclasses.fields(EmulatorConfig)}
    flags = deployment.FLAGS
    assert flags["model"].default == DEFAULT_MODEL == REPLAY_MODEL == sim["model"]
    assert flags["kv_load_failure_policy"].default == sim["kv_load_failure_policy"] \
        == emu["kv_load_failure_policy"] == "fail"  # vLLM 0.33.0's KVTransferConfig default
    assert flags["decode_clock_offset_s"].default == sim["decode_clock_offset_s"]
    assert flags["prefill_cache_blocks"].default == sim["prefill_cache_blocks"]
    assert flags["seed"].default == sim["seed"] == emu["seed"]
    assert (sim["scheduling"] == "async") is flags["async_scheduling"].default


def test_old_spellings_still_parse_without_being_shown() -> None:
    parse = cli.build_parser().parse_args
    emulate = parse(["emulate", "--model", "m", "--prefix-cache-blocks", "7",
                     "--no-enable-prefix-caching"])
    assert (emulate.model, emulate.prefill_cache_blocks, emulate.prefill_prefix_caching) == (
        "m", 7, False)
    simulate = parse(["simulate", "--label", "plan", "--scheduling", "sync"])
    assert (simulate.label, simulate.scheduling) == ("plan", "sync")
    assert parse(["simulate", "--no-async-scheduling"]).async_scheduling is False
    help_text = _parsers()["emulate"].format_help()
    assert "--prefix-cache-blocks" not in help_text and "--prefill-cache-blocks" in help_text


def test_seed_seeds_the_engines_and_workload_seed_the_workload(
        capsys: pytest.CaptureFixture[str]) -> None:
    parse = cli.build_parser().parse_args
    replay = parse(["replay", "--workload-seed", "4"])
    assert replay.workload_seed == 4 and not hasattr(replay, "seed")
    old = parse(["replay", "--seed", "5"])  # replay's old spelling: still the workload's
    assert old.workload_seed == 5
    assert "--seed is deprecated here; use --workload-seed" in capsys.readouterr().err
    assert "fault draws" in deployment.FLAGS["seed"].help


def test_sql_binds_name_value_params_and_still_takes_the_old_positional_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert sql_params("SELECT $run, $x", ["run=r1", "x=a=b"]) == {"run": "r1", "x": "a=b"}
    assert capsys.readouterr().err == ""
    assert sql_params("SELECT ?", ["r1"]) == ["r1"]
    assert "deprecated" in capsys.readouterr().err


def test_sql_param_end_to_end(tmp_path: Path) -> None:
    from kvscope.store.database import open_store

    store = tmp_path / "s.duckdb"
    open_store(str(store)).close()
    out = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "sql", str(store), "SELECT $n::INT + 1 AS v",
         "--param", "n=41", "--format", "csv"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["v", "42"]


def test_emulate_and_simulate_name_faults_from_one_vocabulary() -> None:
    from kvscope.emulator import faults
    from kvscope.emulator.simulator import SIM_FAULTS

    names = {v for k, v in vars(faults).items() if k.isupper() and isinstance(v, str)}
    assert set(SIM_FAULTS) <= names and set(faults.FAULTS) <= names
    assert sorted(set(SIM_FAULTS) & set(faults.FAULTS)) == [
        "clock_skew", "handshake_fail", "invalid_params", "preempt_after_read",
        "strip_stream_metadata", "transfer_fail"]
