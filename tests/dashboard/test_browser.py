"""The dashboard in a real browser, following a real run with a fault from start to end.

`keepstep dashboard` is started on a free port over an empty runs folder and opened in
headless Chromium (through chromedriver and selenium) before the run exists; then
`keepstep run` trains 3 nodes and kills one. The page must notice the run, show it live,
and end with the run's real numbers: one recovery bar per recovery in the summary, split
into phases that add up to its MTTR, the world-size dip, and the loss curve (examples/mlp.py
logs its loss) with one point per step, equal to the summary's. The screenshot and the view
it drew are kept under $KEEPSTEP_TEST_ARTIFACTS (default: the test's tmp folder).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver

from keepstep.dashboard.server import DashboardApp, DashboardServer
from keepstep.dashboard.trainjobs import FakeTrainJobs

from .test_data import FAULTS, finished_inputs

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "examples" / "mlp.py")
RUN_TIMEOUT_S = 200.0

pytestmark = pytest.mark.slow


def _binary(env_name: str, name: str) -> str:
    path = os.environ.get(env_name) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found (Debian: apt-get install chromium chromium-driver)")
    return path


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = _binary("KEEPSTEP_CHROMIUM", "chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1150"):
        options.add_argument(arg)
    driver = webdriver.Chrome(
        options=options, service=Service(_binary("KEEPSTEP_CHROMEDRIVER", "chromedriver"))
    )
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


def start_dashboard(root: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "keepstep", "dashboard", "--run-dir", str(root),
         "--port", "0"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
            line = proc.stderr.readline()
            if line.startswith("keepstep dashboard: http://"):
                return proc, line.split()[2]
            if not line:
                break
    proc.kill()
    pytest.fail(f"keepstep dashboard did not print its URL (exit {proc.wait(10)})")


def stop(proc: subprocess.Popen[str], sig: int) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
    return proc.returncode


def page(driver: WebDriver, script: str) -> Any:
    return driver.execute_script(script)


@pytest.mark.timeout(360)
def test_dashboard_follows_a_run_with_a_fault(
    tmp_path: Path, etcd_binary: str, browser: WebDriver
) -> None:
    artifacts = Path(os.environ.get("KEEPSTEP_TEST_ARTIFACTS") or tmp_path / "artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "runs"
    root.mkdir()
    dashboard, url = start_dashboard(root)
    run: subprocess.Popen[str] | None = None
    try:
        browser.get(url)
        # The page is up (and has polled once) before the run exists.
        deadline = time.monotonic() + 30
        while not page(browser, "return document.getElementById('updated').textContent"):
            assert time.monotonic() < deadline, "the page never polled"
            time.sleep(0.2)
        run = subprocess.Popen(
            [sys.executable, "-m", "keepstep", "run", "--nodes", "3",
             "--global-batch", "24", "--micro-batch", "4", "--steps", "20", "--seed", "1",
             "--fault", "kill-node:1@step=6", "--run-dir", str(root / "kill-node"),
             "--timeout", str(RUN_TIMEOUT_S - 20), MLP, "--sleep", "0.01"],
            env={**os.environ, "KEEPSTEP_ETCD_BIN": etcd_binary},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        seen: list[str] = []
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            status = page(browser, "return window.keepstep.view && window.keepstep.view.status")
            if status and (not seen or seen[-1] != status):
                seen.append(status)
            if status == "finished":
                break
            time.sleep(0.3)
        output, _ = run.communicate(timeout=60)
        assert run.returncode == 0, output[-3000:]
        assert seen[-1:] == ["finished"], f"the page saw {seen}; run output:\n{output[-2000:]}"
        assert "live" in seen, f"the page never showed the run live: {seen}"
        summary = json.loads((root / "kill-node" / "summary.json").read_text())
        check_page(browser, summary)
        shot = artifacts / "dashboard-kill-node.png"
        assert browser.save_screenshot(str(shot))
        view = page(browser, "return window.keepstep.view")
        (artifacts / "dashboard-kill-node.json").write_text(json.dumps(view, indent=2))
        print(f"dashboard screenshot: {shot}")
        console = browser.get_log("browser")  # type: ignore[no-untyped-call]
        assert [e for e in console if e["level"] == "SEVERE"] == []
    finally:
        if run is not None:
            stop(run, signal.SIGTERM)
        code = stop(dashboard, signal.SIGINT)
    assert code == 0, "Ctrl-C ends the dashboard cleanly"


def check_page(driver: WebDriver, summary: dict[str, Any]) -> None:
    recoveries = summary["recoveries"]
    assert len(recoveries) == 1 and recoveries[0]["cause"] == "kill-node"
    # One bar per recovery, stacked from one trace per phase; its phases sum to the MTTR.
    bars = page(driver, "return document.getElementById('recoveries').data")
    assert [t["name"] for t in bars] == [
        "detect", "agree", "communicator", "restore", "replan", "first-step"
    ]  # fmt: skip
    labels = sorted({label for t in bars for label in t["y"]})
    assert len(labels) == len(recoveries)
    for i, r in enumerate(recoveries):
        total = sum(t["x"][i] for t in bars)
        assert total == pytest.approx(r["mttr_s"], abs=1e-6)
        assert bars[0]["x"][i] == pytest.approx(r["detect_s"], abs=1e-9)
    drawn_bars = page(driver, "return document.querySelectorAll('#recoveries g.point').length")
    assert drawn_bars >= len(recoveries)
    # The world-size line has the dip, and per step it ends where the summary does.
    world = page(driver, "return document.getElementById('world').data[0]")
    sizes, steps = world["y"], world["text"]
    assert sizes[0] == 3 and sizes[-1] == 2 and sorted(set(sizes)) == [2, 3]
    assert sizes == sorted(sizes, reverse=True)  # never back up: n1 stays dead
    last = {step: size for step, size in zip(steps, sizes, strict=True)}
    assert [last[s] for s in range(20)] == summary["world_size_by_step"]
    # Throughput: a value for every step interval, broken once where the recovery lies.
    rate = page(driver, "return document.getElementById('throughput').data[0].y")
    assert rate.count(None) == len(recoveries)
    assert all(v > 0 for v in rate if v is not None)
    shading = page(driver, "return document.querySelectorAll('#throughput .shapelayer path')")
    assert len(shading) >= len(recoveries)
    # The loss curve: one point per step, each the value of the commit that stands.
    (curve,) = page(driver, "return document.getElementById('metrics').data")
    assert curve["name"] == "loss" and curve["x"] == list(range(20))
    assert curve["y"] == summary["metrics"]["loss"]
    assert all(v is not None and v > 0 for v in curve["y"])
    assert page(driver, "return document.querySelectorAll('#metrics g.trace path.js-line')")
    text = page(driver, "return document.getElementById('kpi-recoveries').textContent")
    assert text == str(len(recoveries))
    assert page(driver, "return document.getElementById('kpi-step').textContent") == "20 / 20"
    # The run list was read before the run's view: when the run ended in between, the page
    # polls once more (POLL_MS later) and the label follows.
    deadline = time.monotonic() + 15
    while (
        chosen := page(driver, "return document.getElementById('run').selectedOptions[0].text")
    ) != "kill-node (finished)" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert chosen == "kill-node (finished)"


def test_cluster_table_lists_trainjobs(tmp_path: Path, browser: WebDriver) -> None:
    job = {
        "metadata": {"name": "mlp", "namespace": "ml"},
        "spec": {"trainer": {"numNodes": 4, "numSteps": 100}},
        "status": {"phase": "Running", "nodes": 3, "worldSize": 3, "step": 42,
                   "samplesPerSecond": 812.4, "recoveries": 1, "lastMttrSeconds": 0.35},
    }  # fmt: skip
    app = DashboardApp(tmp_path, FakeTrainJobs([job]))
    with DashboardServer(app) as server:
        browser.get(server.url)
        deadline = time.monotonic() + 30
        rows: list[list[str]] = []
        while not rows:
            assert time.monotonic() < deadline, "the TrainJobs table stayed empty"
            time.sleep(0.2)
            rows = page(
                browser,
                "return [...document.querySelectorAll('#trainjobs tbody tr')]"
                ".map(tr => [...tr.cells].map(td => td.textContent))",
            )
        assert rows == [["ml", "mlp", "Running", "3 / 4", "3", "42 / 100", "812", "1", "350 ms"]]
        assert page(browser, "return document.getElementById('cluster').hidden") is False


def test_a_run_that_logged_nothing_says_so(tmp_path: Path, browser: WebDriver) -> None:
    done = finished_inputs()  # its commits carry no metrics
    run = tmp_path / "quiet"
    run.mkdir()
    lines = "".join(json.dumps(e) + "\n" for e in done.events)
    (run / "events-n0.jsonl").write_text(lines)
    (run / "faults.json").write_text(json.dumps(FAULTS))
    (run / "summary.json").write_text(json.dumps(done.summary))
    with DashboardServer(DashboardApp(tmp_path, FakeTrainJobs([]))) as server:
        browser.get(server.url)
        deadline = time.monotonic() + 30
        while page(browser, "return window.keepstep.draws") == 0:
            assert time.monotonic() < deadline, "the page never drew the run"
            time.sleep(0.2)
        assert page(browser, "return document.getElementById('metrics').data") == []
        note = page(browser, "return document.querySelector('#metrics .annotation').textContent")
        assert note.startswith("no metrics logged")
        console = browser.get_log("browser")  # type: ignore[no-untyped-call]
        assert [e for e in console if e["level"] == "SEVERE"] == []
