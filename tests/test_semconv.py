"""The semantic conventions are declared once, and nothing else spells their keys."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from kvscope import semconv

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ["kvscope", "collector", "analysis", "dashboards", "emulator", "tests"]
# File names such as "kvscope.duckdb" are not telemetry keys either.
FILE_SUFFIXES = (".duckdb", ".html", ".json", ".jsonl", ".csv", ".parquet", ".py", ".log")
KEY = re.compile(r"^(kvscope|gen_ai)\.[a-z0-9_.]+$")
# Module paths are not telemetry keys.
MODULE_PREFIXES = ("kvscope.collector", "kvscope.analysis", "kvscope.dashboards",
                   "kvscope.emulator", "kvscope.store", "kvscope.cli", "kvscope.settings",
                   "kvscope.semconv", "kvscope.errors", "kvscope.reuse",
                   "kvscope.fit", "kvscope.tables")


def _literal_keys(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if (KEY.match(value) and not value.startswith(MODULE_PREFIXES)
                    and not value.endswith(FILE_SUFFIXES)):
                found.append((node.lineno, value))
    return sorted(found)


def test_no_module_outside_semconv_spells_a_key() -> None:
    offenders = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            # semconv.py declares the names; this file checks them against DESIGN §3.
            if path in (ROOT / "kvscope" / "semconv.py", Path(__file__).resolve()):
                continue
            offenders += [f"{path.relative_to(ROOT)}:{line}: {key!r}"
                          for line, key in _literal_keys(path)]
    assert offenders == [], "use kvscope.semconv constants instead:\n" + "\n".join(offenders)


def test_the_scanner_catches_a_literal(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('span.set_attribute("kvscope.turn.index", 1)\nx = "gen_ai.request.model"\n')
    assert [key for _, key in _literal_keys(sample)] == ["kvscope.turn.index",
                                                          "gen_ai.request.model"]


def test_every_design_span_and_metric_is_declared() -> None:
    spans = {c.name for c in semconv.spans()}
    assert spans == {
        "kvscope.turn", "kvscope.input_processing", "kvscope.generation", "kvscope.tool_wait",
        "kvscope.reuse_decision", "kvscope.kv_transfer", "kvscope.kv_retention",
        # A failed request a client retried (kvscope ingest of a proxy log; issue 30).
        "kvscope.turn_attempt",
    }
    assert {c.name for c in semconv.metrics()} >= {
        "kvscope.gpu.memory.used_bytes", "kvscope.gpu.memory.total_bytes",
        "kvscope.kv.retained_bytes",
    }


def test_declarations_have_descriptions_and_units_in_names() -> None:
    # Prometheus-exposed metrics spell seconds out, as Prometheus conventions ask.
    suffixes = {"tokens": ("_tokens",), "bytes": ("_bytes",), "By": ("_bytes",),
                "s": ("_s", "_seconds"), "ms": ("_ms",)}
    for convention in semconv.REGISTRY.values():
        assert convention.description.strip(), convention.name
        if convention.unit in suffixes:
            assert convention.name.endswith(suffixes[convention.unit]), convention.name


def test_genai_names_follow_the_opentelemetry_conventions() -> None:
    assert semconv.GEN_AI_CONVERSATION_ID == "gen_ai.conversation.id"
    assert semconv.GEN_AI_USAGE_INPUT_TOKENS == "gen_ai.usage.input_tokens"
    assert semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS == "gen_ai.usage.cache_read.input_tokens"


def test_no_constant_is_assigned_twice() -> None:
    """A second assignment silently re-points every user of a name (the registry only sees two
    different keys): ``VLLM_REQUEST_ID`` once named both kvscope's hook attribute and vLLM's
    ``gen_ai.request.id``, and the later one won everywhere."""
    tree = ast.parse(Path(semconv.__file__).read_text())
    names = Counter(target.id for node in tree.body if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Name))
    assert [name for name, count in names.items() if count > 1] == []
