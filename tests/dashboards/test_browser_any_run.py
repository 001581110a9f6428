"""The dashboard reads on any run, in a real headless Chromium: a short single-run store (under a
minute) and the demo's store shape (its WEKA workload, its three runs and fault mix, simulated in
virtual time). Time figures draw more than one window, tables name runs by label, an outcome
has one colour on every page, one prefill engine draws no by-engine chart, the "pick a cause"
hint is not an error's red, and compare's placeholders name the pair it compares.

Skipped with the reason shown where Chromium or selenium is absent (test_browser.py's marks).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvscope.cli.demo import FAULT_MIX, DemoOptions
from kvscope.dashboards.app import DashboardServer, create_app
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic, weka
from tests.dashboards.test_browser import (
    browser,  # noqa: F401  (the fixture)
    figures_ready,
    idle,
    pytestmark,  # noqa: F401  (the skip marks)
    severe_logs,
    shot,
    wait_for,
)

PAGES = ("/", "/conversations", "/missed", "/retention", "/task-time", "/whatif", "/compare")
# The error style of kvscope's pages (.missing) as the browser computes it.
ERROR_RED = "rgb(170, 51, 51)"

_COLOURS = """
const out = {};
for (const id of arguments[0]) {
  const plot = document.querySelector('#' + id + ' .js-plotly-plot');
  if (!plot || !plot.data) continue;
  for (const t of plot.data) {
    if (t.name && t.marker && typeof t.marker.color === 'string') {
      (out[t.name] = out[t.name] || []).push(t.marker.color);
    }
  }
}
return out;
"""


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SimulationResult]:
    db = tmp_path_factory.mktemp("short") / "short.duckdb"
    workload = synthetic.generate(conversations=4, seed=3, turns_p50=4, max_turns=5,
                                  think_time_p50_s=2.0, think_time_p90_s=5.0,
                                  arrival_rate_per_s=0, reset_probability=0,
                                  subagent_probability=0)
    result = simulate(workload, db, SimulationSettings(profile="tiny", label="short run",
                                                       seed=5))
    return db, result


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[SimulationResult]]:
    options = DemoOptions()
    db = tmp_path_factory.mktemp("demo") / "kvscope.duckdb"
    workload = weka.load_csv(conversations=options.conversations, max_turns=options.max_turns,
                             token_scale=options.token_scale,
                             time_compression=options.time_scale)
    results = [simulate(workload, db, SimulationSettings(
        profile=options.profile, label=label, prefill_bidirectional_kv_xfer=on,
        decode_bidirectional_kv_xfer=on, faults=dict(mix), seed=7))
        for label, on, mix in (("feature OFF", False, ()), ("feature ON", True, ()),
                               ("feature ON + faults", True, FAULT_MIX))]
    return db, results


@pytest.fixture(scope="module")
def short_server(short_run: tuple[Path, SimulationResult]) -> Iterator[DashboardServer]:
    with DashboardServer(create_app(short_run[0]), "127.0.0.1", 0) as running:
        yield running


@pytest.fixture(scope="module")
def demo_server(demo_store: tuple[Path, list[SimulationResult]]) -> Iterator[DashboardServer]:
    with DashboardServer(create_app(demo_store[0]), "127.0.0.1", 0) as running:
        yield running


def _open(driver: Any, url: str, ids: tuple[str, ...] = ()) -> dict[str, Any]:
    driver.get(url)
    state = wait_for(lambda: figures_ready(driver, ids) if ids else idle(driver),
                     what=f"figures of {url}")
    time.sleep(0.5)  # let any late callback fail visibly
    assert "Callback error" not in driver.page_source
    assert not severe_logs(driver), (url, severe_logs(driver))
    return state if isinstance(state, dict) else {}


def _every_page_reads(driver: Any, server: DashboardServer, run_ids: list[str],
                      name: str) -> None:
    for path in PAGES:
        _open(driver, server.url + path)
        wait_for(lambda: idle(driver) and driver.find_elements("css selector", "main *"),
                 what=f"{path} content")
        time.sleep(1.0)
        shot(driver, f"{name}-{path.strip('/') or 'overview'}")
        text = driver.find_element("css selector", "main").text
        for run_id in run_ids:
            # The run's id alone (request and trace ids may start with it).
            alone = re.search(rf"(?<![0-9a-f]){run_id}(?![0-9a-f])", text)
            assert alone is None, f"{path} shows the hex run id {run_id}"


def test_a_short_single_run_reads(short_server: DashboardServer, browser: Any,  # noqa: F811
                                  short_run: tuple[Path, SimulationResult]) -> None:
    from selenium.webdriver.common.by import By

    db, result = short_run
    span = result.duration_s if hasattr(result, "duration_s") else None
    state = _open(browser, short_server.url + "/", ("overview-reuse", "overview-ttft"))
    # Under a minute: more than one window, not one point.
    for figure_id in ("overview-reuse", "overview-ttft"):
        assert state[figure_id]["points"] > 4, (figure_id, state[figure_id], span)
    slider = browser.find_element(By.ID, "filter-time").text
    assert "." not in slider, f"time slider reads {slider!r}"
    _open(browser, short_server.url + "/missed")
    wait_for(lambda: browser.find_elements(By.ID, "missed-hint"), what="the cause hint")
    assert not browser.find_elements(By.ID, "missed-by-engine")  # one engine: no repeat
    hint = browser.find_element(By.ID, "missed-hint")
    assert hint.value_of_css_property("color") != ERROR_RED
    _every_page_reads(browser, short_server, [result.run_id], "short")


def test_the_demo_store_reads(demo_server: DashboardServer, browser: Any,  # noqa: F811
                              demo_store: tuple[Path, list[SimulationResult]]) -> None:
    from selenium.webdriver.common.by import By

    _, results = demo_store
    _open(browser, demo_server.url + "/", ("overview-outcomes",))
    overview = browser.execute_script(_COLOURS, ["overview-outcomes"])
    _open(browser, demo_server.url + "/missed", ("missed-over-time",))
    missed = browser.execute_script(_COLOURS, ["missed-over-time"])
    shared = set(overview) & set(missed)
    assert shared, (overview, missed)
    for outcome in shared:
        assert set(overview[outcome]) == set(missed[outcome]), outcome
    # Missed reuse over time: one panel per run that missed.
    panels = browser.execute_script(
        "return document.querySelector('#missed-over-time .js-plotly-plot')"
        ".layout.annotations.map(a => a.text)")
    assert {"feature OFF", "feature ON + faults"} <= set(panels), panels
    _open(browser, demo_server.url + "/compare", ("compare-ttft",))
    placeholders = [browser.find_element(By.ID, i).text for i in ("compare-a", "compare-b")]
    table = browser.find_element(By.ID, "compare-table").text
    assert placeholders and "feature ON" in placeholders[0], placeholders
    picked = placeholders[0].strip().removeprefix("run A (default: ").removesuffix(")")
    assert picked in table, (picked, table)
    _every_page_reads(browser, demo_server, [r.run_id for r in results], "demo")
