"""Every notebook in notebooks/ under Run > Run All Cells in JupyterLab (headless Chromium), and the
widget notebooks saved, closed and reopened with their kernel gone.

Run All must finish within ``RUN_ALL_S`` with no error output (in the page or in the saved file)
and no "Error displaying widget"; a screenshot of each goes to docs/images/notebook-<name>.png.
03_dashboard's dashboard must also update while the batch runs and end on the batch's totals.
Reopened, the widget outputs must show their final numbers as static HTML (docs/images/reopened-*.png).
"""
from __future__ import annotations

import os
import re
import time

import pytest

from tests.browser.lab import ARTIFACTS, IMAGES, Notebook, notebook_names, saved_errors

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# Run All bound per notebook. Measured on the shared 2-core CPU box: 7-70 s each
# (kernel start + model load included); 300 s leaves room for a loaded machine and still ends a hang.
RUN_ALL_S = float(os.environ.get("NBGEN_BROWSER_RUN_ALL_S", "300"))
FAILED = pytest.fail.Exception
# 03_dashboard's batch: 8 prompts x 64 new tokens, long enough on a fast CPU for the dashboard's refreshes
# (every 0.33 s) to show the running total move at least once
NEW_TOKENS = 64


def _image(kind: str, name: str, ok: bool = True) -> str:
    """docs/images/<kind>-<name>.png for a passing run; the artifacts folder otherwise."""
    return os.path.join(IMAGES if ok else ARTIFACTS, f"{kind}-{name}.png")


class DashboardWatch:
    """Samples 03_dashboard's numbers on every poll while the cells run (the widget's live updates)."""

    JS = """(p) => {
        const d = document.querySelector(p + ' .nbgen-dashboard');
        if (!d) return null;
        return {out: Number(d.dataset.totalOutputTokens || 0), running: Number(d.dataset.running || 0),
                tok_s: Number(d.dataset.outputTokS || 0), status: d.dataset.status};
    }"""

    def __init__(self, nb: Notebook) -> None:
        self.nb, self.seen = nb, []

    def __call__(self) -> None:
        nums = self.nb.page.evaluate(self.JS, self.nb.panel)
        if nums:
            self.seen.append(nums)
            if nums["running"] > 0 and len([s for s in self.seen if s["running"]]) == 3:
                self.nb.screenshot(os.path.join(ARTIFACTS, "dashboard-live.png"), full=False)

    def check(self) -> None:
        seen = self.seen
        running = [s for s in seen if s["running"] > 0]
        assert running, f"the dashboard never showed a running request: {seen[-5:]}"
        # the total output tokens moved while requests were running: live updates, not one render
        mid = sorted({s["out"] for s in running})
        assert len(mid) >= 2, f"the dashboard's numbers did not change during the generation: {mid}"
        # the notebook's batch: 8 prompts x NEW_TOKENS tokens (ignore_eos)
        assert max(s["out"] for s in seen) == 8 * NEW_TOKENS, f"final total output tokens: {seen[-3:]}"
        assert seen[-1]["status"] == "engine shut down", f"the dashboard's last status: {seen[-1]}"


def run_all(nb: Notebook, name: str, results: dict, sample=None) -> None:
    """Run All, wait, save; records "ok" or the failure in ``results[name]``; asserts no errors."""
    results[name] = "did not finish"
    nb.run_all()
    try:
        res = nb.wait_all_executed(RUN_ALL_S, sample=sample, poll_s=0.1 if sample else 0.5)
    except FAILED as e:
        results[name] = f"Run All failed: {str(e)[:400]}"
        raise
    saved = nb.save()
    problems = []
    if res.dom_errors:
        problems.append("error outputs shown:\n" + "\n".join(e[:1500] for e in res.dom_errors))
    if res.widget_errors:
        problems.append("widget errors shown:\n" + "\n".join(res.widget_errors))
    if saved_errors(saved):
        problems.append("error outputs in the saved notebook:\n" + "\n".join(saved_errors(saved)))
    shot = nb.screenshot(_image("notebook", name, ok=not problems))
    print(f"{name}: Run All took {res.seconds:.0f} s; screenshot {shot}")
    results[name] = "ok" if not problems else "errors: " + problems[0][:400]
    assert not problems, "\n".join(problems) + f"\nscreenshot: {shot}"


@pytest.mark.parametrize("name", notebook_names())
def test_notebook_run_all(name, open_notebook, run_all_results) -> None:
    nb = open_notebook(f"{name}.ipynb")
    watch = DashboardWatch(nb) if name == "03_dashboard" else None
    run_all(nb, name, run_all_results, sample=watch)
    if watch is not None:
        watch.check()


# --- reopened: saved, kernel shut down, opened again --------------------------------------------------

def _static(nb: Notebook, selector: str) -> list[dict]:
    """Elements matching ``selector`` in the notebook's outputs: their data-* attributes and text."""
    return nb.page.evaluate("""([p, sel]) => [...document.querySelectorAll(p + ' .jp-OutputArea ' + sel)]
        .map(e => ({data: {...e.dataset}, text: e.innerText}))""", [nb.panel, selector])


def _check_dataframe(nb: Notebook) -> list[str]:
    bars = _static(nb, ".nbgen-progress")
    if not bars:
        return ["no static progress line (.nbgen-progress) in the outputs"]
    return [f"progress line not at its final count: {b['data']} {b['text']!r}" for b in bars
            if b["data"].get("n") != b["data"].get("total") or not re.search(r"(\d+)/\1 ", b["text"])]


def _check_dashboard(nb: Notebook) -> list[str]:
    d = _static(nb, ".nbgen-dashboard")
    if not d:
        return ["no static dashboard (.nbgen-dashboard) in the outputs"]
    data = d[0]["data"]
    problems = []
    if data.get("totalOutputTokens") != str(8 * NEW_TOKENS):
        problems.append(f"dashboard total output tokens {data.get('totalOutputTokens')!r}, want {8 * NEW_TOKENS}")
    if data.get("status") != "engine shut down":
        problems.append(f"dashboard status {data.get('status')!r}, want 'engine shut down'")
    return problems


def _check_stream(nb: Notebook) -> list[str]:
    s = _static(nb, ".nbgen-stream")
    if not s:
        return ["no static stream output (.nbgen-stream) in the outputs"]
    return [f"stream output not final or empty: {x['data']} {x['text'][:80]!r}" for x in s
            if x["data"].get("done") != "1" or not x["text"].strip()]


def _check_playground(nb: Notebook) -> list[str]:
    samples = _static(nb, ".nbgen-playground .nbgen-sample")
    if len(samples) < 2:
        return [f"want the playground's 2 samples as static HTML (.nbgen-sample), found {len(samples)}"]
    return [f"sample without text or tokens: {x['text'][:120]!r}" for x in samples
            if not re.search(r"[1-9]\d* tokens", x["text"]) or len(x["text"].strip().splitlines()) < 2]


REOPEN = {"02_dataframe": (_check_dataframe, ".nbgen-progress"),
          "03_dashboard": (_check_dashboard, ".nbgen-dashboard"),
          "04_streaming_async": (_check_stream, ".nbgen-stream"),
          "05_playground": (_check_playground, ".nbgen-sample")}


@pytest.mark.parametrize("name", sorted(REOPEN))
def test_notebook_reopened(name, open_notebook, lab_server, run_all_results) -> None:
    status = run_all_results.get(name)
    if status is None:  # run alone (-k): run it here first
        run_all(open_notebook(f"{name}.ipynb"), name, run_all_results)
    elif status.startswith("Run All failed"):
        pytest.fail(f"nothing to reopen: test_notebook_run_all[{name}] failed ({status})", pytrace=False)
    lab_server.shutdown_kernels()  # the kernel that owned the widgets is gone
    nb = open_notebook(f"{name}.ipynb")  # a new page and workspace; a new kernel starts
    check, selector = REOPEN[name]
    try:  # outputs (widget views included) render after the kernel connects
        nb.page.wait_for_selector(f"{nb.panel} .jp-OutputArea {selector}", timeout=15_000, state="attached")
    except Exception:
        pass
    time.sleep(2)
    problems = check(nb)
    for o in nb.outputs():
        for bad in ("Error displaying widget", "model not found"):
            if bad in o["text"]:
                problems.append(f"cell {o['index']} shows {bad!r}")
        if re.search(r"\b0%\|", o["text"]):
            problems.append(f"cell {o['index']} shows a stale progress bar: "
                            f"{next(ln for ln in o['text'].splitlines() if '0%|' in ln)[:120]!r}")
    shot = nb.screenshot(_image("reopened", name, ok=not problems))
    assert not problems, f"{name} reopened with its kernel shut down:\n" + "\n".join(problems) + f"\nscreenshot: {shot}"
