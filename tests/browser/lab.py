"""Drive JupyterLab in headless Chromium the way a person does (the browser tests' shared driver).

``LabServer`` runs ``jupyter lab`` on 127.0.0.1 over a folder (its own settings and workspaces, so
nothing of the user's JupyterLab leaks in; kernels import nbgen from this checkout).
``Notebook`` is one open notebook in a Playwright page: wait for the kernel, Run > Run All Cells
from the menu, wait (bounded) until every code cell has an execution count, read the outputs from
the DOM, save with Ctrl+S and read the saved file back.

Everything that waits has a bound; on a timeout it screenshots into ``ARTIFACTS`` and fails naming
the cells still ``[*]`` and the errors shown so far.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
CHROMIUM = os.environ.get("NBGEN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# failure screenshots (git-ignored); the screenshots the docs show go to IMAGES
ARTIFACTS = os.environ.get("NBGEN_ARTIFACTS", os.path.join(ROOT, "tests", "browser", "artifacts"))
IMAGES = os.environ.get("NBGEN_BROWSER_IMAGES", os.path.join(ROOT, "docs", "images"))
VIEWPORT = {"width": 1280, "height": 900}
MAX_SHOT_HEIGHT = 6000  # px: a full-notebook screenshot is cut there (keeps the PNGs modest)

# JupyterLab settings for the test server: no news / update pop-ups over the notebook
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}

# --- DOM queries (JupyterLab 4.6) -----------------------------------------------------------------
WIDGET_ERROR_TEXTS = ("Error displaying widget", "model not found")

_JS_CELLS = """(panelSel) => {
  const nb = document.querySelector(panelSel + ' .jp-Notebook');
  if (!nb) return null;
  return [...nb.querySelectorAll(':scope .jp-Cell')].map((c, i) => {
    const code = c.classList.contains('jp-CodeCell');
    const prompt = code ? (c.querySelector('.jp-InputArea-prompt')?.textContent || '').trim() : '';
    const src = (c.querySelector('.jp-InputArea-editor .cm-content')?.innerText || '').trim();
    return {index: i, code, prompt, source: src.split('\\n')[0].slice(0, 80)};
  });
}"""

_JS_OUTPUTS = """(path) => {
  // per cell: the output area's text, and the text of each output whose model says "error"
  // (JupyterLab 4.6 renders an error like a stderr stream: data-mime-type is
  // application/vnd.jupyter.stderr for both, so the kind comes from the output model)
  const app = window.jupyterapp;
  const panel = app && [...app.shell.widgets('main')].find(w => w.context && w.context.path === path);
  if (!panel) return null;
  return panel.content.widgets.map((cell, i) => {
    const area = cell.outputArea;
    if (!area) return {index: i, errors: [], text: '', types: []};
    const types = [];
    for (let k = 0; k < area.model.length; k++) types.push(area.model.get(k).type);
    const children = area.widgets;
    const errors = types.flatMap((t, k) => t === 'error' ?
        [children[k] ? children[k].node.innerText : (area.model.get(k).toJSON().traceback || []).join('\\n')] : []);
    return {index: i, errors, text: area.node.innerText, types};
  });
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def notebook_names() -> list[str]:
    """Every notebook in notebooks/ (stem), so a new notebook is tested without editing the tests."""
    return sorted(f[:-len(".ipynb")] for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb"))


def requirements_missing() -> Optional[str]:
    """Why the browser tests cannot run here (None when they can)."""
    for mod in ("jupyterlab", "playwright.sync_api", "nbformat"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} not installed (tests/browser/setup.sh)"
    if not CHROMIUM:
        return "chromium not installed (tests/browser/setup.sh)"
    from nbgen.models.embedded import embedded_model_ready

    if not embedded_model_ready():
        return "embedded model not fetched (python -m nbgen.models fetch)"
    return None


class LabServer:
    """``jupyter lab`` on 127.0.0.1 serving ``root_dir``."""

    def __init__(self, root_dir: str, state_dir: str, start_timeout: float = 120.0) -> None:
        self.root_dir, self.state_dir = root_dir, state_dir
        self.port, self.token = free_port(), "nbgen-browser-test-" + uuid.uuid4().hex[:8]
        self.base = f"http://127.0.0.1:{self.port}"
        settings = os.path.join(state_dir, "settings")
        for rel, value in _SETTINGS.items():
            path = os.path.join(settings, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(value, f)
        env = dict(os.environ)
        # kernels import nbgen from this checkout (an editable install may point elsewhere)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["JUPYTERLAB_SETTINGS_DIR"] = settings
        env["JUPYTERLAB_WORKSPACES_DIR"] = os.path.join(state_dir, "workspaces")
        env["JUPYTER_CONFIG_DIR"] = os.path.join(state_dir, "config")  # no user jupyter_server_config
        env.pop("JUPYTER_TOKEN", None)
        self.log_path = os.path.join(state_dir, "jupyter.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root_dir}", "--allow-root",
             "--LabApp.news_url=", "--LabApp.extension_manager=readonly",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.expose_app_in_browser=True"],  # window.jupyterapp: which outputs are errors
            stdout=self._log, stderr=subprocess.STDOUT, cwd=root_dir, env=env)
        t_end = time.time() + start_timeout
        while True:
            try:
                self.api("GET", "/api/status")
                break
            except OSError:
                if self.proc.poll() is not None:
                    self.stop()
                    pytest.fail("jupyter lab exited:\n" + self.log_tail())
                if time.time() > t_end:
                    self.stop()
                    pytest.fail(f"jupyter lab did not answer within {start_timeout:.0f} s:\n" + self.log_tail())
                time.sleep(0.5)

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def api(self, method: str, path: str, timeout: float = 30) -> Any:
        req = urllib.request.Request(self.base + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def url(self, path: str, workspace: str) -> str:
        """``path`` opened in a workspace of its own (no notebook of an earlier test is restored)."""
        return f"{self.base}/lab/workspaces/{workspace}/tree/{path}?token={self.token}"

    def shutdown_kernels(self) -> None:
        """Shut down every session and kernel (what "Shut Down All Kernels" does)."""
        try:
            for s in self.api("GET", "/api/sessions"):
                self.api("DELETE", f"/api/sessions/{s['id']}", timeout=60)
            for k in self.api("GET", "/api/kernels"):
                self.api("DELETE", f"/api/kernels/{k['id']}", timeout=60)
        except OSError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.shutdown_kernels()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


@dataclass
class RunResult:
    """What a Run All left: per code cell the prompt, and the errors seen in the DOM."""

    seconds: float
    cells: list[dict]
    dom_errors: list[str] = field(default_factory=list)
    widget_errors: list[str] = field(default_factory=list)
    stderr_tracebacks: list[str] = field(default_factory=list)  # e.g. an exception logged by asyncio


class Notebook:
    """One notebook open in JupyterLab in a page of its own."""

    def __init__(self, server: LabServer, browser: Any, path: str, name: Optional[str] = None) -> None:
        self.server, self.path = server, path
        self.name = name or os.path.splitext(os.path.basename(path))[0]
        self.context = browser.new_context(viewport=dict(VIEWPORT))
        self.page = self.context.new_page()
        self.page.set_default_timeout(60_000)
        self.panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook shown in the main area
        self.console: list[str] = []
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}") if m.type == "error" else None)

    # --- opening ---------------------------------------------------------------------------------
    def open(self, timeout: float = 180) -> "Notebook":
        """Load JupyterLab on the notebook and wait until its kernel is idle."""
        self.page.goto(self.server.url(self.path, "ws-" + uuid.uuid4().hex[:8]), timeout=timeout * 1000)
        self.page.wait_for_selector(f"{self.panel} .jp-Notebook .jp-Cell", timeout=timeout * 1000)
        self.wait_kernel_idle(timeout)
        self.hide_sidebar()
        return self

    def kernel_status(self) -> Optional[str]:
        """The toolbar's execution indicator: "idle", "busy", "starting", ... (None before it shows)."""
        return self.page.evaluate(
            "(p) => document.querySelector(p + ' .jp-Notebook-ExecutionIndicator')?.dataset.status || null",
            self.panel)

    def _accept_dialog(self) -> bool:
        """Accept a "Select Kernel" (or similar) dialog that popped up while the session starts."""
        dialog = self.page.locator(".jp-Dialog .jp-mod-accept")
        if dialog.count():
            try:
                dialog.first.click(timeout=5_000)
                return True
            except Exception:
                pass
        return False

    def session_kernel_state(self) -> Optional[str]:
        """The server's word on this notebook's kernel ("idle", "busy", "starting"; None: no session)."""
        try:
            for s in self.server.api("GET", "/api/sessions"):
                if s.get("path") == self.path and s.get("kernel"):
                    return s["kernel"].get("execution_state")
        except OSError:
            pass
        return None

    def wait_kernel_idle(self, timeout: float = 180) -> None:
        """Until the notebook's kernel runs and is idle, on the server and in the page, for 1 s.

        (The toolbar's indicator says "idle" for a moment before the session exists, and a cell run
        then does nothing.)
        """
        t_end, since = time.time() + timeout, None
        while time.time() < t_end:
            self._accept_dialog()
            if self.kernel_status() == "idle" and self.session_kernel_state() == "idle":
                since = since or time.time()
                if time.time() - since >= 1.0:
                    return
            else:
                since = None
            self.page.wait_for_timeout(300)
        self.fail_with_screenshot(f"kernel of {self.path} not idle within {timeout:.0f} s "
                                  f"(status {self.kernel_status()!r})")

    def hide_sidebar(self) -> None:
        """Collapse the left sidebar (file browser) so the notebook gets the width."""
        tab = self.page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
        try:
            if tab.count():
                tab.first.click(timeout=5_000)
        except Exception:
            pass

    # --- running ---------------------------------------------------------------------------------
    def cells(self) -> list[dict]:
        return self.page.evaluate(_JS_CELLS, self.panel) or []

    def outputs(self) -> list[dict]:
        """Per cell: ``text`` (the output area as shown), ``errors`` (shown text of error outputs), ``types``."""
        out = self.page.evaluate(_JS_OUTPUTS, self.path)
        if out is None:
            pytest.fail(f"{self.path} is not open in JupyterLab (window.jupyterapp has no such panel)")
        return out

    def run_all(self) -> None:
        """Run > Run All Cells from the menu bar; retried until a cell has started.

        A click can land before JupyterLab has wired its menus, or a kernel dialog can get in the way.
        """
        # started: a cell shows [*], or the prompts changed (a saved notebook has counts already)
        started = ("([p, before]) => { const now = [...document.querySelectorAll(p + ' .jp-InputArea-prompt')]"
                   ".map(e => e.textContent.trim()); return now.some(t => t.includes('*')) || "
                   "JSON.stringify(now) !== JSON.stringify(before); }")
        before = self.page.evaluate("(p) => [...document.querySelectorAll(p + ' .jp-InputArea-prompt')]"
                                    ".map(e => e.textContent.trim())", self.panel)
        for attempt in range(6):
            self.page.wait_for_timeout(1000)
            if self._accept_dialog():
                continue
            try:
                self.page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click(timeout=5_000)
                self.page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click(timeout=5_000)
                self.page.wait_for_function(started, arg=[self.panel, before], timeout=20_000)
                return
            except Exception:
                self.screenshot_artifact(f"{self.name}-not-started-{attempt}")
                self.page.keyboard.press("Escape")
        self.fail_with_screenshot(f"could not start Run All on {self.path} (see {self.name}-not-started-*.png)")

    def wait_all_executed(self, timeout: float, sample: Optional[Callable[[], None]] = None,
                          poll_s: float = 0.5) -> RunResult:
        """Wait until every code cell shows ``[n]`` and the kernel is idle (at most ``timeout`` s).

        Fails at once (no waiting out the bound) when the kernel is idle, nothing is ``[*]`` and some
        cell never ran: Run All stopped at an error. On the bound it fails naming the cells still
        ``[*]``. ``sample`` is called on every poll (to watch a widget while cells run).
        """
        t0 = time.time()
        idle_since: Optional[float] = None
        while True:
            if sample is not None:
                sample()
            cells = [c for c in self.cells() if c["code"]]
            running = [c for c in cells if "*" in c["prompt"]]
            unrun = [c for c in cells if not re.search(r"\[\d+\]", c["prompt"])]
            idle = self.kernel_status() == "idle"
            if idle and not running:
                idle_since = idle_since or time.time()
                if not unrun and time.time() - idle_since >= 1.0:
                    return self._result(time.time() - t0, cells)
                if unrun and time.time() - idle_since >= 5.0:  # Run All stopped (an error cell)
                    res = self._result(time.time() - t0, cells)
                    self.fail_with_screenshot(
                        f"Run All of {self.path} stopped after {res.seconds:.0f} s; cells never run: "
                        f"{_describe(unrun)}\nerrors shown:\n{_errors_text(res)}")
            else:
                idle_since = None
            if time.time() - t0 > timeout:
                res = self._result(time.time() - t0, cells)
                self.fail_with_screenshot(
                    f"Run All of {self.path} did not finish within {timeout:.0f} s (a hang?): running "
                    f"{_describe(running[:1])}; queued behind it: {_describe(running[1:])}; "
                    f"kernel {self.kernel_status()!r}\nerrors shown so far:\n{_errors_text(res)}")
            time.sleep(poll_s)

    def _result(self, seconds: float, cells: list[dict]) -> RunResult:
        res = RunResult(seconds, cells)
        for o in self.outputs():
            res.dom_errors += [f"cell {o['index']}: {e.strip()}" for e in o["errors"]]
            if not o["errors"] and "Traceback (most recent call last)" in o["text"]:
                tb = o["text"][o["text"].index("Traceback (most recent call last)"):]
                res.stderr_tracebacks.append(f"cell {o['index']} (printed, not an error output): " + tb[:600])
            for t in WIDGET_ERROR_TEXTS:
                if t in o["text"]:
                    line = next(ln for ln in o["text"].splitlines() if t in ln)
                    res.widget_errors.append(f"cell {o['index']}: {line.strip()}")
        return res

    def prompt(self, index: int) -> str:
        return self.cells()[index]["prompt"]

    def run_cell(self, index: int, timeout: float = 30) -> str:
        """Select cell ``index`` (a click on its prompt) and press Shift+Enter; returns the prompt it
        had before, once it shows ``[*]`` (or already a new count)."""
        before = self.prompt(index)
        cell = self.page.locator(f"{self.panel} .jp-Notebook .jp-Cell").nth(index)
        cell.locator(".jp-InputPrompt").first.click()
        self.page.keyboard.press("Escape")  # command mode
        self.page.keyboard.press("Shift+Enter")
        t_end = time.time() + timeout
        while self.prompt(index) == before:
            if time.time() > t_end:
                self.fail_with_screenshot(f"cell {index} of {self.path} did not start within {timeout:.0f} s "
                                          f"of Shift+Enter (kernel {self.kernel_status()!r})")
            self.page.wait_for_timeout(200)
        return before

    def wait_cell(self, index: int, before: str, timeout: float, what: str = "") -> float:
        """Wait until cell ``index`` shows a count other than ``before`` and the kernel is idle;
        the seconds waited (fails on the bound, naming ``what``)."""
        t0 = time.time()
        while True:
            p = self.prompt(index)
            if re.search(r"\[\d+\]", p) and p != before and self.kernel_status() == "idle":
                return time.time() - t0
            if time.time() - t0 > timeout:
                self.fail_with_screenshot(
                    f"cell {index} of {self.path} {what or 'did not finish'} within {timeout:.0f} s "
                    f"(prompt {p!r}, kernel {self.kernel_status()!r})")
            self.page.wait_for_timeout(250)

    def interrupt(self) -> None:
        """The toolbar's stop button (Interrupt the kernel)."""
        self.page.locator(f"{self.panel} .jp-Toolbar-item[data-jp-item-name='interrupt'] button").first.click()

    # --- saving ----------------------------------------------------------------------------------
    def save(self, timeout: float = 60) -> dict:
        """Ctrl+S (File > Save Notebook if the keys did not save); the saved notebook as JSON."""
        disk = os.path.join(self.server.root_dir, self.path)
        before = os.stat(disk).st_mtime_ns if os.path.exists(disk) else 0
        self.page.locator(f"{self.panel} .jp-Notebook").first.click(position={"x": 5, "y": 5})
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("Control+s")
        t_end, tried_menu = time.time() + timeout, False
        while os.path.exists(disk) and os.stat(disk).st_mtime_ns == before:
            if time.time() > t_end:
                self.fail_with_screenshot(f"{self.path} was not saved within {timeout:.0f} s")
            if not tried_menu and time.time() > t_end - timeout / 2:
                tried_menu = True
                self.page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()
                self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Save Notebook$")).first.click()
            self._accept_dialog()  # e.g. "notebook changed on disk" or a trust prompt
            self.page.wait_for_timeout(300)
        # the write may be in progress: parse until the JSON is whole
        for _ in range(20):
            try:
                with open(disk) as f:
                    return json.load(f)
            except json.JSONDecodeError:
                time.sleep(0.25)
        with open(disk) as f:
            return json.load(f)

    # --- screenshots -----------------------------------------------------------------------------
    def screenshot(self, path: str, full: bool = True) -> str:
        """PNG of the page, 1280 wide; ``full``: tall enough for the whole notebook (capped)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not full:
            self.page.screenshot(path=path)
            return path
        # grow (or shrink) the window by what the notebook's last cell lies below (above) its view
        extra = self.page.evaluate("""(p) => {
            const o = document.querySelector(p + ' .jp-WindowedPanel-outer');
            const cells = document.querySelectorAll(p + ' .jp-Notebook .jp-Cell');
            if (!o || !cells.length) return 0;
            const bottom = cells[cells.length - 1].getBoundingClientRect().bottom + o.scrollTop + 24;
            return bottom - o.getBoundingClientRect().bottom;
        }""", self.panel)
        height = max(480, min(VIEWPORT["height"] + int(extra), MAX_SHOT_HEIGHT))
        self.page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
        try:
            self.page.wait_for_timeout(500)  # relayout; content-visibility cells get painted
            self.page.evaluate("(p) => { const o = document.querySelector(p + ' .jp-WindowedPanel-outer');"
                               " if (o) o.scrollTop = 0; }", self.panel)
            self.page.wait_for_timeout(300)
            self.page.screenshot(path=path)
        finally:
            self.page.set_viewport_size(dict(VIEWPORT))
        _shrink_png(path)
        return path

    def screenshot_artifact(self, stem: str) -> str:
        path = os.path.join(ARTIFACTS, stem + ".png")
        try:
            return self.screenshot(path)
        except Exception:
            return path

    def fail_with_screenshot(self, msg: str) -> None:
        shot = self.screenshot_artifact(f"{self.name}-failed")
        pytest.fail(f"{msg}\nscreenshot: {shot}", pytrace=False)

    def close(self) -> None:
        try:
            self.context.close()
        except Exception:
            pass


def saved_errors(nb_json: dict) -> list[str]:
    """Error outputs of a saved notebook: ``cell i: Ename: evalue``."""
    errs = []
    for i, cell in enumerate(nb_json.get("cells", [])):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errs.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}")
    return errs


def _shrink_png(path: str) -> None:
    """A 256-colour palette PNG (a screenshot of JupyterLab loses nothing visible): ~2.5x smaller."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        q = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    q.save(path, optimize=True)


def _describe(cells: list[dict]) -> str:
    return ", ".join(f"cell {c['index']} {c['prompt'] or '[ ]'} `{c['source']}`" for c in cells) or "none"


def _errors_text(res: RunResult) -> str:
    lines = [e[:1500] for e in res.dom_errors] + res.widget_errors + res.stderr_tracebacks
    return "\n".join(lines) if lines else "(none)"
