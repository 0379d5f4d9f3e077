"""Every notebook in notebooks/ runs top to bottom with nbclient on the embedded model (CPU)."""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def _embedded_model_ready() -> bool:
    from nbgen.models.embedded import embedded_model_ready

    return embedded_model_ready()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs(path: str, tmp_path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if os.path.basename(path).startswith("10_ray"):
        pytest.importorskip("ray")
    if not _embedded_model_ready():
        pytest.skip("embedded model not fetched (python -m nbgen.models fetch)")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert outputs, "the notebook showed nothing"
    name = os.path.basename(path)
    shown = "".join(str(o.get("data", {}).get("text/html", "")) + str(o.get("data", {}).get("text/plain", ""))
                    + str(o.get("text", "")) for o in outputs)
    if name.startswith("03_dashboard"):
        assert "nbgen-dashboard" in shown and "engine shut down" in shown
        # the saved static snapshot was refreshed at shutdown: it shows the batch's tokens
        assert 'data-total-output-tokens="0"' not in shown.split("nbgen-dashboard")[1][:2000]
    if name.startswith("02_dataframe"):
        assert "requests run by the second call: 3" in shown
    if name.startswith("04_streaming"):
        assert "nbgen-stream" in shown
    if name.startswith("10_ray"):
        assert "same texts as generate_df: True" in shown and "empty prompt" in shown
    if name.startswith("07_embeddings"):
        assert "nearest neighbour shares the topic" in shown and "zero-shot accuracy" in shown
        assert any("image/png" in o.get("data", {}) for o in outputs)      # the PCA scatter
    if name.startswith("09_images"):
        assert shown.count("<img") >= 8                                    # two thumbnail tables
        assert re.search(r"same image +prompt_tokens=\d+ cached_tokens=[1-9]", shown)
    if name.startswith("08_sessions"):
        # the chat's later turns continue the session, their earlier turns read from the KV cache
        turns = re.findall(r"^\s*(\d) \|\s+(\d+) \|\s+(\d+) \| (True|False)$", shown, re.M)
        assert len(turns) == 3 and all(int(c) > 0 and cont == "True" for _, _, c, cont in turns[1:]), turns
        assert int(turns[2][2]) > int(turns[1][2]), turns
        assert "finish order: URGENT" in shown and "100: 1 running" in shown
        assert "nbgen-profile" in shown and "restored output equals the original: True" in shown
