"""The base install is what a vLLM process needs, and the plugin imports nothing heavier.

A vLLM process with kvscope's plugin loads the plugin, the instrumentor, OTLP export and the GPU
sampler. Those run in a subprocess here whose imports of the extras' packages fail (as they do
where only ``pip install kvscope`` ran), and must neither fail nor load any of them; the CLI
lists every command and names the extra a command needs.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("duckdb", "pyarrow", "polars", "dash", "plotly", "aiohttp", "grpc", "pandas",
         "prometheus_client", "rich", "clickhouse_connect", "chdb")

BLOCK = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_the_plugin_path_loads_no_extra() -> None:
    done = _run(f"""
from kvscope.collector.vllm import plugin
from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor
from kvscope.collector.otel import setup_telemetry
from kvscope.collector.gpu import GpuSampler
plugin.enable("http://127.0.0.1:9")  # vLLM is absent here: off, and says so
telemetry = setup_telemetry("vllm-prefill", otlp_endpoint="http://127.0.0.1:9")
telemetry.shutdown()
print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_cli_names_the_extra_a_command_needs() -> None:
    done = _run("""
from kvscope import cli
print("rc", cli.main(["serve", "--db", "unused.duckdb"]))
""")
    assert done.stdout.strip() == "rc 2", done.stderr
    # Which of the extra's packages is imported first is incidental; the extra is not.
    assert re.search(r"kvscope serve: error: needs the 'store' extra \((aiohttp|duckdb|pyarrow|"
                     r"polars|grpc) is not installed\): pip install 'kvscope\[store\]'",
                     done.stderr), done.stderr


def test_the_base_dependencies_hold_none_of_the_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    base = " ".join(project["dependencies"])
    assert not [p for p in ("duckdb", "pyarrow", "polars", "plotly", "dash", "aiohttp", "grpcio")
                if p in base]
    assert set(project["optional-dependencies"]) >= {"store", "analysis", "dashboard", "all"}


def test_every_package_of_an_extra_is_named_when_missing() -> None:
    # A command that hits any of them says which extra brings it (kvscope.cli.missing_extra).
    from kvscope.cli import _EXTRA_OF

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    module = {"grpcio": "grpc", "clickhouse-connect": "clickhouse_connect"}
    for extra in ("store", "dashboard", "clickhouse"):
        for requirement in project["optional-dependencies"][extra]:
            name = re.split(r"[<>=\[ ]", requirement, maxsplit=1)[0]
            if name == "kvscope":
                continue
            assert _EXTRA_OF.get(module.get(name, name)) == extra, (extra, name)


def test_version_answers_on_the_base_install_and_loads_no_extra() -> None:
    done = _run(f"""
from kvscope import cli
rc = cli.main(["version"])
print("rc", rc, sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
""")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"kvscope \S+ \(store schema \d+\)", lines[0]), done.stdout
    assert lines[-1] == "rc 0 []"


def test_main_configures_only_the_command_it_runs() -> None:
    # Building every command's options imports the emulator, the proxy and the store; running
    # one command must not (each configure imports what its own options need).
    done = _run("""
from kvscope import cli
print("rc", cli.main(["settings"]))
print(sorted(m for m in sys.modules if m.startswith(("kvscope.emulator", "kvscope.collector"))))
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _help_then(command: str, then: str = "") -> subprocess.CompletedProcess[str]:
    """``kvscope COMMAND --help`` (and the code ``then``) with the extras blocked."""
    return _run(f"""
from kvscope import cli
try:
    cli.main([{command!r}, "--help"])
except SystemExit as exc:
    print("exit", exc.code)
{then}
""")


def test_proxy_help_lists_its_flags_and_running_it_names_the_extra() -> None:
    # The options import no extra (vLLM's proxy flags, the declared deployment settings); the
    # proxy itself needs aiohttp, from the 'store' extra, and says so.
    done = _help_then("proxy", 'print("rc", cli.main(["proxy", "--no-telemetry"]))')
    assert done.returncode == 0, done.stderr
    for flag in ("--prefiller-host", "--decoder-port", "--router-ttl", "--reuse-guard",
                 "--decode-params", "--db"):
        assert flag in done.stdout, (flag, done.stdout)
    assert done.stdout.strip().splitlines()[-2:] == ["exit 0", "rc 2"], done.stdout
    assert ("kvscope proxy: error: needs the 'store' extra (aiohttp is not installed): "
            "pip install 'kvscope[store]'") in done.stderr, done.stderr


# One run of every command as a user would type it; on the base install each either answers
# or names the extra it needs, with the pip command (never a traceback or a usage error).
RUNS = {
    "version": [], "settings": ["--markdown"], "sql": ["x.duckdb", "SELECT 1"],
    "serve": ["--db", "x.duckdb"], "proxy": ["--no-telemetry"], "emulate": [],
    "replay": ["--conversations", "1"], "simulate": ["--db", "x.duckdb"],
    "dashboard": ["x.duckdb"], "analyze": ["x.duckdb"], "ledger": ["x.duckdb"],
    "report": ["x.duckdb"], "grafana": [], "alerts": [], "compare": ["x.duckdb"],
    "whatif": ["x.duckdb"],
    "gpu-sampler": ["--otlp-endpoint", "http://127.0.0.1:9", "--duration-s", "0"],
    "ingest": ["--db", "x.duckdb", "f.log"], "demo": ["--out", "demo-out"],
}


def test_every_command_answers_or_names_its_extra_on_the_base_install(tmp_path: Path) -> None:
    from kvscope.cli import COMMANDS

    assert sorted(RUNS) == sorted(c.name for c in COMMANDS)
    done = _run(f"""
import contextlib, io, os
os.chdir({str(tmp_path)!r})
from kvscope import cli
for name, argv in {RUNS!r}.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main([name, *argv])
        except SystemExit as exc:
            rc = exc.code
    print(name, rc, err.getvalue().strip().splitlines()[-1:] if err.getvalue() else "")
""")
    assert done.returncode == 0, done.stderr
    answers = done.stdout.strip().splitlines()
    assert len(answers) == len(RUNS), done.stdout
    extra = re.compile(r"kvscope (\S+): error: needs the '(store|dashboard)' extra \(\w+ is not "
                       r"installed\): pip install 'kvscope\[(store|dashboard)\]'")
    for line in answers:
        name, rc = line.split()[:2]
        if rc == "0":
            continue
        assert rc == "2" and extra.search(line), line


def test_help_of_a_command_without_its_extra_names_the_extra() -> None:
    done = _help_then("simulate")
    assert done.returncode == 0, done.stderr
    assert "pip install 'kvscope[store]'" in " ".join(done.stdout.split()), done.stdout
    assert done.stdout.strip().endswith("exit 0")
