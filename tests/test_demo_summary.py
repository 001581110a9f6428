"""``make demo``'s summary explains itself: missed reuse and the correctness alarm are told apart,
the conversation count is the traces' (which ``--help`` gives) with their subagents, and the time
taken is printed once."""

from __future__ import annotations

from kvscope import cli
from kvscope.cli import demo


def test_no_missed_reuse_beside_an_alarm_says_why_both_hold() -> None:
    lines = demo.run_lines("feature ON + faults", 0.912, 800.0, 1500.0, [], 2)
    assert "missed reuse: no turn" in lines[0] and "misses: none" not in lines[0]
    assert lines[1].strip().startswith("ALARM: 2 turn(s) did reuse decode's KV, but KV that "
                                       "does not match their prompt")
    assert "counted apart from missed reuse" in lines[1]


def test_missed_reuse_names_its_top_causes_and_unmeasured_numbers() -> None:
    [line] = demo.run_lines("feature OFF", None, None, None,
                            [("no_decode_metadata", 0.9), ("first_turn", 0.1)], 0)
    assert "missed reuse: no_decode_metadata 90 %, first_turn 10 %" in line
    assert "reuse not measured" in " ".join(line.split()) and "p50 not measured" in line


def test_help_and_banner_agree_on_what_conversations_counts() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    help_text = " ".join(sub.choices["demo"].format_help().split())  # type: ignore[attr-defined]
    assert "WEKA traces to replay (default 10; their subagents are conversations" in help_text
    line = demo.banner(demo.DemoOptions(), 12, 80)
    assert line.startswith("kvscope demo: 10 WEKA Claude Code traces (12 conversations with "
                           "their subagents), 80 turns")
