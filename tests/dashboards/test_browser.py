"""The dashboard in a real headless Chromium (Debian's chromium + chromedriver, via Selenium).

Every page loads without callback errors on simulated ON / OFF / faults runs, the key figures
hold data, a filter change updates them, and the Conversations waterfall of a known conversation
shows the outcome labels the simulator's ground truth gives. Screenshots go to
``test-artifacts/dashboards/``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvscope.dashboards.app import DashboardServer, create_app
from kvscope.dashboards.pages import pages
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path(shutil.which("chromedriver") or "/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboards"

try:
    import selenium  # noqa: F401
    HAVE_SELENIUM = True
except ImportError:
    HAVE_SELENIUM = False

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists() or not CHROMEDRIVER.exists(),
                       reason="headless Chromium not installed (Debian: apt-get install chromium "
                       "chromium-driver); the dashboard was not opened in a browser"),
    pytest.mark.skipif(not HAVE_SELENIUM, reason="selenium not installed (test extra); the "
                       "dashboard was not opened in a browser"),
]

# Figures each page must draw with data (dcc.Graph ids).
KEY_FIGURES = {
    "/": ("overview-reuse", "overview-outcomes", "overview-ttft", "overview-memory"),
    "/conversations": ("conversation-waterfall",),
    "/missed": ("missed-over-time", "missed-tokens"),
    "/retention": ("retention-memory", "retention-classes", "retention-holds"),
    "/task-time": ("task-decomposition", "task-ttft"),
    "/whatif": ("whatif-curves",),
    "/compare": ("compare-ttft",),
}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[SimulationResult]]:
    db = tmp_path_factory.mktemp("browser") / "runs.duckdb"
    workload = synthetic.generate(conversations=6, seed=11)
    results = [
        simulate(workload, db, SimulationSettings(
            profile="tiny", label=label, prefill_bidirectional_kv_xfer=on,
            decode_bidirectional_kv_xfer=on, faults=faults, seed=seed))
        for label, on, faults, seed in (
            ("feature ON", True, {}, 1), ("feature OFF", False, {}, 2),
            ("faults", True, {"transfer_fail": 0.3, "handshake_fail": 0.2}, 3))
    ]
    return db, results


@pytest.fixture(scope="module")
def server(simulated: tuple[Path, list[SimulationResult]]) -> Iterator[DashboardServer]:
    with DashboardServer(create_app(simulated[0]), "127.0.0.1", 0) as running:
        yield running


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,2400",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                              options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# --- helpers ----------------------------------------------------------------------------------

_FIGURE_STATE = """
const out = {};
for (const id of arguments[0]) {
  const holder = document.getElementById(id);
  const plot = holder && holder.querySelector('.js-plotly-plot');
  if (!plot || !plot.data) { out[id] = null; continue; }
  const points = plot.data.reduce((n, t) => n + ((t.x && t.x.length) || 0)
                                   + ((t.y && t.y.length) || 0), 0);
  const notes = ((plot.layout && plot.layout.annotations) || []).map(a => a.text);
  out[id] = {traces: plot.data.length, points: points, notes: notes,
             names: plot.data.map(t => t.name || '')};
}
return out;
"""


def wait_for(predicate: Any, timeout: float = 45.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def idle(driver: Any) -> bool:
    """Dash has no callback in flight (the renderer marks the document while loading)."""
    return bool(driver.execute_script(
        "return document.readyState === 'complete' && "
        "!document.querySelector('[data-dash-is-loading=\"true\"]');"))


def figures_ready(driver: Any, ids: tuple[str, ...]) -> dict[str, Any] | None:
    state = driver.execute_script(_FIGURE_STATE, list(ids))
    return state if all(state.get(i) for i in ids) and idle(driver) else None


def severe_logs(driver: Any) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE"]


def shot(driver: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


# --- tests ------------------------------------------------------------------------------------


def test_every_page_loads_with_data_and_no_callback_errors(
        server: DashboardServer, browser: Any) -> None:
    assert {p.path for p in pages()} == set(KEY_FIGURES)
    for path, ids in KEY_FIGURES.items():
        browser.get(server.url + path)
        state = wait_for(lambda ids=ids: figures_ready(browser, ids), what=f"figures of {path}")
        time.sleep(0.5)  # let any late callback fail visibly
        shot(browser, path.strip("/") or "overview")
        for figure_id, figure in state.items():
            assert figure["traces"] > 0 and figure["points"] > 0, (path, figure_id, figure)
            assert not any(str(n).startswith("no data") or "not measured:" in str(n)
                           for n in figure["notes"]), (path, figure_id, figure["notes"])
        errors = severe_logs(browser)
        assert not errors, (path, errors)
        # Dash's own error surface (dev tools) is off, so a failed callback shows as a 500.
        assert "Callback error" not in browser.page_source


def test_run_filter_updates_figures(server: DashboardServer, browser: Any,
                                    simulated: tuple[Path, list[SimulationResult]]) -> None:
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    before = wait_for(lambda: figures_ready(browser, ("overview-reuse",)), what="overview")
    names_before = set(before["overview-reuse"]["names"])
    assert any(n.startswith("feature OFF") for n in names_before), names_before
    box = browser.find_element(
        By.XPATH, "//*[@id='filter-runs']//label[normalize-space()='feature OFF']//input")
    box.click()

    def changed() -> dict[str, Any] | None:
        state = figures_ready(browser, ("overview-reuse",))
        if state and set(state["overview-reuse"]["names"]) != names_before:
            return state
        return None

    after = wait_for(changed, what="reuse figure after unticking feature OFF")
    names_after = set(after["overview-reuse"]["names"])
    assert not any(n.startswith("feature OFF") for n in names_after), names_after
    assert any(n.startswith("feature ON") for n in names_after), names_after
    shot(browser, "overview-filtered")
    assert not severe_logs(browser)


def test_conversation_waterfall_shows_the_true_outcomes(
        server: DashboardServer, browser: Any,
        simulated: tuple[Path, list[SimulationResult]]) -> None:
    from selenium.webdriver.common.by import By

    faults = simulated[1][2]
    # The faults run's conversation with the most distinct outcomes is the telling one.
    by_conversation: dict[str, list[tuple[int, str]]] = {}
    for row in faults.truth:
        by_conversation.setdefault(row.conversation_id, []).append((row.turn_index, row.outcome))
    conversation, truth = max(by_conversation.items(),
                              key=lambda kv: (len({o for _, o in kv[1]}), len(kv[1])))
    expected = [f"turn {t}: {o}" for t, o in sorted(truth)]
    browser.get(f"{server.url}/conversations?run={faults.run_id}&conversation={conversation}")
    wait_for(lambda: figures_ready(browser, ("conversation-waterfall",)), what="waterfall")

    def labels() -> list[str] | None:
        items = browser.find_elements(By.CSS_SELECTOR, "#conversation-outcomes li")
        return [i.text for i in items] or None

    assert wait_for(labels, what="outcome labels") == expected
    state = figures_ready(browser, ("conversation-waterfall",))
    assert state is not None
    shot(browser, "conversation-waterfall")
    assert not severe_logs(browser)
