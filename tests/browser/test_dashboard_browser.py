"""Real browser: JupyterLab on localhost, headless Chromium runs notebooks/03_dashboard.ipynb.

Checks that the dashboard widget renders and that its numbers change while a generation runs, and
keeps a screenshot (``$NBGEN_ARTIFACTS`` or tests/browser/artifacts/dashboard.png).
Needs Debian's chromium and Playwright for Python (tests/browser/setup.sh) and the embedded model.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "notebooks", "03_dashboard.ipynb")
CHROMIUM = os.environ.get("NBGEN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = os.environ.get("NBGEN_ARTIFACTS", os.path.join(ROOT, "tests", "browser", "artifacts"))

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _embedded_model_ready() -> bool:
    from nbgen.models.embedded import embedded_model_ready

    return embedded_model_ready()


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on 127.0.0.1 serving a copy of the dashboard notebook."""
    pytest.importorskip("jupyterlab")
    pytest.importorskip("playwright.sync_api")
    if not CHROMIUM:
        pytest.skip("chromium not installed (tests/browser/setup.sh)")
    if not _embedded_model_ready():
        pytest.skip("embedded model not fetched (python -m nbgen.models fetch)")
    shutil.copy(NOTEBOOK, tmp_path / "dashboard.ipynb")
    port, token = _free_port(), "nbgen-browser-test"
    log = open(tmp_path / "jupyter.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         "--allow-root", "--LabApp.news_url=", "--LabApp.extension_manager=readonly", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail("jupyter lab exited:\n" + open(tmp_path / "jupyter.log").read()[-3000:])
                time.sleep(0.5)
        else:
            pytest.fail("jupyter lab did not start in 60 s")
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _dash_numbers(page) -> dict:
    return page.evaluate("""() => {
        const d = document.querySelector('.nbgen-dashboard');
        if (!d) return null;
        return {out: Number(d.dataset.totalOutputTokens || 0), running: Number(d.dataset.running || 0),
                tok_s: Number(d.dataset.outputTokS || 0), status: d.dataset.status};
    }""")


def test_dashboard_renders_and_updates_in_jupyterlab(jupyterlab) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    base, token = jupyterlab
    os.makedirs(ARTIFACTS, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            page.goto(f"{base}/lab/tree/dashboard.ipynb?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            # the kernel must be up before "Run All" (its status shows in the toolbar)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
            # Run > Run All Cells, as a person would
            # a click can land before JupyterLab wires its menus: retry until a cell starts running
            started = "() => [...document.querySelectorAll('.jp-InputPrompt')].some(e => /\\[(\\*|\\d+)\\]/.test(e.textContent))"
            for attempt in range(6):
                page.wait_for_timeout(1000)
                dialog = page.locator(".jp-Dialog .jp-mod-accept")
                if dialog.count():  # "Select Kernel" can pop up while the session starts: accept it
                    dialog.first.click()
                    continue
                try:
                    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click(timeout=5_000)
                    page.get_by_text("Run All Cells", exact=True).first.click(timeout=5_000)
                    page.wait_for_function(started, timeout=20_000)
                    break
                except Exception:  # a dialog got in the way, or the menu was not wired yet
                    page.screenshot(path=os.path.join(ARTIFACTS, f"not-started-{attempt}.png"))
                    page.keyboard.press("Escape")
            else:
                pytest.fail("could not start the notebook (see not-started-*.png)")
            page.wait_for_selector(".nbgen-dashboard", timeout=300_000)  # engine load + first render
            seen, t_end = [], time.time() + 400
            while time.time() < t_end:
                nums = _dash_numbers(page)
                if nums:
                    seen.append(nums)
                    if nums["running"] > 0 and len(seen) % 4 == 0:
                        page.screenshot(path=os.path.join(ARTIFACTS, "dashboard.png"))
                    if nums["status"] != "live":
                        break
                time.sleep(0.25)
            page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-final.png"), full_page=True)
        finally:
            browser.close()
    running_samples = [s for s in seen if s["running"] > 0]
    assert running_samples, f"never saw a running request: {seen[-5:]}"
    # the total output tokens moved while requests were running: live updates, not one render
    mid = {s["out"] for s in running_samples}
    assert len(mid) >= 2, f"numbers did not change during the generation: {sorted(mid)}"
    # the final total (the last live sample or the snapshot published at shutdown): 8 prompts x 24 tokens
    assert max(s["out"] for s in seen) == 8 * 24, seen[-3:]  # the notebook's batch: 8 prompts x 24 tokens (ignore_eos)
    assert seen[-1]["status"] == "engine shut down"
    assert os.path.exists(os.path.join(ARTIFACTS, "dashboard.png"))
