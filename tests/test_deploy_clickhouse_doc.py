"""docs/deploy-clickhouse.md: its Collector configuration and commands match what kvscope reads."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from kvscope import cli, semconv, settings
from kvscope.store import query
from kvscope.store.schema import GAUGE_TABLE, TRACES_TABLE

DOC = Path(__file__).resolve().parent.parent / "docs" / "deploy-clickhouse.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture(scope="module")
def config() -> dict:
    (block,) = _blocks("yaml")
    parsed: dict = yaml.safe_load(block)
    return parsed


def _commands() -> list[list[str]]:
    lines = [line for block in _blocks("sh") for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("kvscope ")]


def _exports() -> dict[str, str]:
    found = {}
    for block in _blocks("sh"):
        for line in block.splitlines():
            if line.startswith("export "):
                key, _, value = line[len("export "):].partition("=")
                found[key] = value
    return found


def test_the_exporter_writes_the_tables_kvscope_reads(config: dict) -> None:
    exporter = config["exporters"]["clickhouse"]
    assert exporter["traces_table_name"] == TRACES_TABLE == query.TRACES
    assert exporter["metrics_tables"]["gauge"]["name"] == GAUGE_TABLE == query.GAUGES
    assert urlsplit(exporter["endpoint"]).scheme in ("tcp", "clickhouse", "http", "https")
    # The database the exporter writes is the one every kvscope command reads.
    databases = {c[c.index("--clickhouse-database") + 1] for c in _commands()
                 if "--clickhouse-database" in c}
    assert databases == {exporter["database"]}


def test_both_pipelines_go_otlp_batch_clickhouse(config: dict) -> None:
    for signal in ("traces", "metrics"):
        pipeline = config["service"]["pipelines"][signal]
        assert pipeline == {"receivers": ["otlp"], "processors": ["batch"],
                            "exporters": ["clickhouse"]}, signal
    assert "batch" in config["processors"]


def test_the_sources_point_at_the_collectors_otlp_http_port(config: dict) -> None:
    port = int(config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1])
    endpoint = _exports()[settings.SETTINGS["otlp_endpoint"].env_var]
    assert urlsplit(endpoint).port == port
    for command in _commands():
        if "--otlp-endpoint" in command:
            assert command[command.index("--otlp-endpoint") + 1] == endpoint
    # Runs are named by the resource attribute kvscope reads them from.
    resource = _exports()["OTEL_RESOURCE_ATTRIBUTES"]
    assert resource.split("=", 1)[0] == semconv.RUN_ID


def test_the_kvscope_commands_parse_and_read_clickhouse() -> None:
    parser = cli.build_parser()
    reading = {"ledger", "analyze", "whatif", "compare", "report", "dashboard"}
    seen = set()
    for command in _commands():
        args = parser.parse_args(command[1:])
        if args.command in reading:
            seen.add(args.command)
            assert args.clickhouse and args.file is None or args.command == "analyze"
    assert seen == reading
    exports = _exports()
    for name in ("clickhouse_user", "clickhouse_password"):
        assert settings.SETTINGS[name].env_var in exports
