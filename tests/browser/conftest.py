"""Fixtures of the browser tests: one JupyterLab server and one headless Chromium for the session.

The server serves a temporary copy of notebooks/ (tests save into it, never into the repository);
each test opens its notebooks in a fresh browser context and its kernels are shut down afterwards.
"""
from __future__ import annotations

import os
import shutil

import pytest

from tests.browser.lab import CHROMIUM, NOTEBOOKS, LabServer, Notebook, requirements_missing


@pytest.fixture(scope="package")
def lab_server(tmp_path_factory):
    why = requirements_missing()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("lab_root")
    for f in os.listdir(NOTEBOOKS):
        if f.endswith(".ipynb"):
            shutil.copy(os.path.join(NOTEBOOKS, f), root / f)
    server = LabServer(str(root), str(tmp_path_factory.mktemp("lab_state")))
    yield server
    server.stop()


# package scope: Playwright's sync API keeps an asyncio loop running in this thread while it is
# open, so it must be closed before the rest of the suite calls asyncio.run()
@pytest.fixture(scope="package")
def browser(lab_server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture
def open_notebook(lab_server, browser):
    """``open_notebook(path)``: the notebook (relative to the server root) open in a new page, kernel
    idle. Its pages are closed and every kernel is shut down when the test ends."""
    opened: list[Notebook] = []

    def _open(path: str) -> Notebook:
        nb = Notebook(lab_server, browser, path)
        opened.append(nb)
        return nb.open()

    yield _open
    for nb in opened:
        nb.close()
    lab_server.shutdown_kernels()


@pytest.fixture(scope="package")
def run_all_results() -> dict:
    """name -> "ok" or the failure message of that notebook's Run All (the reopen tests reuse it)."""
    return {}
