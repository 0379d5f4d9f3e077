"""SGLang's four notebook modes, run in a real Jupyter kernel through nbclient (asyncio.run in cells)."""
from __future__ import annotations

import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELLS = [
    "import asyncio, nbgen as sgl\nfrom nbgen.utils import stream_and_merge, async_stream_and_merge\n"
    "llm = sgl.Engine(model_path=MODEL, dtype='float32', device='cpu')\n"
    "sp = {'temperature': 0, 'max_new_tokens': 16, 'ignore_eos': True}\n"
    "prompts = ['Hello, my name is', 'The capital of France is']",
    # 1. sync (the kernel's own loop is running while this blocks)
    "outs = llm.generate(prompts, sp)\nref = [o['text'] for o in outs]\n"
    "for p, o in zip(prompts, outs):\n    print(p, '->', repr(o['text']))",
    # 2. sync streaming
    "streamed = [stream_and_merge(llm, p, sp) for p in prompts]\nassert streamed == ref, (streamed, ref)",
    # 3. async, with asyncio.run inside a cell as SGLang's notebooks do
    "async def main():\n    return await asyncio.gather(*[llm.async_generate(p, sp) for p in prompts])\n"
    "got = [o['text'] for o in asyncio.run(main())]\nassert got == ref, (got, ref)",
    # 3b. top-level await works too
    "got = await llm.async_generate(prompts, sp)\nassert [o['text'] for o in got] == ref",
    # 4. async streaming
    "async def main():\n    outs = []\n    for p in prompts:\n        pieces = []\n"
    "        async for t in async_stream_and_merge(llm, p, sp):\n            pieces.append(t)\n"
    "        outs.append(''.join(pieces))\n    return outs\n"
    "got = asyncio.run(main())\nassert got == ref, (got, ref)\nprint('FOUR MODES OK')",
    "llm.shutdown()",
]


def test_four_sglang_modes_in_a_kernel(tiny_llama_dir, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"MODEL = {tiny_llama_dir!r}")] + [nbformat.v4.new_code_cell(c) for c in CELLS]
    env_path = os.pathsep.join([os.getcwd()] + sys.path)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    os.environ["PYTHONPATH"] = env_path
    client.execute()
    out = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "FOUR MODES OK" in out
