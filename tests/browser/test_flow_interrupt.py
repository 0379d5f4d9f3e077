"""A person's flow in JupyterLab: generate_df over 40 rows with a checkpoint, the toolbar's stop
button (Interrupt the kernel) while it runs, then the same cell again to resume.

The cell must stop promptly with a short error ("interrupted: k/40 rows saved to ...; run the cell
again to resume"), and the re-run must finish the other rows: every row in the checkpoint exactly
once. Screenshots: docs/images/flow-interrupt.png, flow-resume.png.
"""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.browser.lab import IMAGES

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROWS = 40
STOP_S = 60       # interrupt -> the cell has ended and the kernel is idle
MAX_ERROR_LINES = 3

# rows ask for 8..86 tokens (ignore_eos), so they finish one by one over ~80 decode steps (5-60 s)
CELLS = [
    "import pandas as pd\n"
    "import nbgen\n\n"
    "llm = nbgen.Engine()\n"
    f"df = pd.DataFrame({{'prompt': [f'Tell me fact {{i}} about the sea.' for i in range({ROWS})],\n"
    f"                   'max_new_tokens': [8 + 2 * i for i in range({ROWS})]}})",
    "out = nbgen.generate_df(df, 'prompt', engine=llm, chat=False,\n"
    "                        sampling_params={'temperature': 0, 'ignore_eos': True},\n"
    "                        param_columns=['max_new_tokens'], checkpoint='flow_ckpt.jsonl')\n"
    "print('rows with text:', int(out['text'].notna().sum()), 'of', len(out))",
    "llm.shutdown()",
]


def _write_notebook(path: str) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    nbformat.write(nb, path)


def _checkpoint_rows(path: str) -> list[int]:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rows.append(int(json.loads(line)["_row"]))
    return rows


def _rows_done(nb, index: int) -> int:
    """Rows done as the cell's progress bar shows them (tqdm's "k/40" or the static line's data-n)."""
    text = nb.outputs()[index]["text"]
    m = re.findall(rf"(\d+)/{ROWS}\b", text)
    return int(m[-1]) if m else -1


def test_flow_interrupt_then_resume(lab_server, open_notebook) -> None:
    ckpt = os.path.join(lab_server.root_dir, "flow_ckpt.jsonl")
    if os.path.exists(ckpt):
        os.remove(ckpt)
    _write_notebook(os.path.join(lab_server.root_dir, "flow.ipynb"))
    nb = open_notebook("flow.ipynb")

    nb.wait_cell(0, nb.run_cell(0), timeout=180, what="(engine load) did not finish")
    assert not nb.outputs()[0]["errors"], nb.outputs()[0]["errors"]

    before = nb.run_cell(1)
    # wait until the progress bar shows some rows done (and not all): then press stop
    t_end, done = time.time() + 240, -1
    while time.time() < t_end:
        done = _rows_done(nb, 1)
        if 2 <= done < ROWS - 5:
            break
        if re.search(r"\[\d+\]", nb.prompt(1)) or done >= ROWS - 5:
            nb.fail_with_screenshot(f"generate_df finished ({done}/{ROWS} shown) before it could be interrupted")
        time.sleep(0.2)
    else:
        nb.fail_with_screenshot(f"the progress bar never showed rows done (last read {done}) within 240 s")
    shown_at_stop = done
    nb.interrupt()
    stopped_in = nb.wait_cell(1, before, timeout=STOP_S, what="did not stop after Interrupt")
    time.sleep(1)  # the error output and the bar's last update
    shot_interrupt = nb.screenshot(os.path.join(IMAGES, "flow-interrupt.png"))
    out = nb.outputs()[1]
    saved = _checkpoint_rows(ckpt)
    print(f"interrupted at {shown_at_stop}/{ROWS} shown; stopped in {stopped_in:.1f} s; "
          f"{len(saved)} rows in the checkpoint; error output: {out['errors']!r}")

    problems = []
    assert 0 < len(saved) < ROWS, f"checkpoint after the interrupt holds {len(saved)} rows (want some, not all)"
    assert len(saved) >= shown_at_stop, f"bar showed {shown_at_stop} rows done, checkpoint has {len(saved)}"
    if not out["errors"]:
        problems.append(f"no error output after the interrupt; cell output: {out['text'][-500:]!r}")
    else:
        err = "\n".join(out["errors"]).strip()
        lines = err.splitlines()
        if len(lines) > MAX_ERROR_LINES or "interrupted" not in err:
            problems.append(
                f"[interrupt message] want at most {MAX_ERROR_LINES} lines mentioning 'interrupted' "
                f"(like 'interrupted: k/{ROWS} rows saved to ...; run the cell again to resume'), "
                f"got {len(lines)} lines:\n" + "\n".join(lines[:12]) + ("\n..." if len(lines) > 12 else ""))

    # resume: run the same cell again
    before = nb.run_cell(1)
    resumed_in = nb.wait_cell(1, before, timeout=300, what="(resume) did not finish")
    time.sleep(1)
    shot_resume = nb.screenshot(os.path.join(IMAGES, "flow-resume.png"))
    out = nb.outputs()[1]
    rows = _checkpoint_rows(ckpt)
    print(f"resume took {resumed_in:.1f} s; output: {out['text'][-300:]!r}")
    assert not out["errors"], f"the resumed run failed: {out['errors']}\nscreenshot: {shot_resume}"
    assert f"rows with text: {ROWS} of {ROWS}" in out["text"], out["text"][-500:]
    assert sorted(rows) == list(range(ROWS)), (
        f"checkpoint rows after resume: {len(rows)} records, missing {sorted(set(range(ROWS)) - set(rows))}, "
        f"repeated {sorted({r for r in rows if rows.count(r) > 1})}")
    nb.wait_cell(2, nb.run_cell(2), timeout=60, what="(llm.shutdown) did not finish")
    assert not problems, "\n".join(problems) + f"\nscreenshots: {shot_interrupt}, {shot_resume}"
