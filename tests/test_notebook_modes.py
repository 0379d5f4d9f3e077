"""SGLang's four notebook modes, run in a real Jupyter kernel through nbclient (asyncio.run in cells)."""
from __future__ import annotations

import os
import queue
import sys
import time

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


class _RunAll:
    """A kernel fed every cell at once, as JupyterLab's Run All does (nbclient waits per cell)."""

    def __init__(self) -> None:
        manager = pytest.importorskip("jupyter_client.manager")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
        self.km, self.kc = manager.start_new_kernel(kernel_name="python3", env=env)
        self.ids: list[str] = []
        self.outputs: dict[str, list[dict]] = {}
        self.replies: dict[str, str] = {}

    def submit(self, cells: list[str]) -> None:
        self.ids += [self.kc.execute(c, stop_on_error=False) for c in cells]

    def _pump(self, timeout: float) -> bool:
        """Read one iopub and any shell message; False when nothing came within ``timeout``."""
        got = False
        try:
            m = self.kc.get_iopub_msg(timeout=timeout)
            got = True
            if m["msg_type"] in ("stream", "error", "execute_result"):
                self.outputs.setdefault(m["parent_header"].get("msg_id", ""), []).append(m["content"])
        except queue.Empty:
            pass
        while True:
            try:
                m = self.kc.get_shell_msg(timeout=0.01)
            except queue.Empty:
                break
            self.replies[m["parent_header"]["msg_id"]] = m["content"]["status"]
            got = True
        return got

    def wait_for_text(self, cell: int, text: str, timeout: float) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if text in self.text(cell):
                return
            self._pump(0.2)
        raise AssertionError(f"cell {cell} never printed {text!r}: {self.outputs.get(self.ids[cell])}")

    def wait_all(self, timeout: float) -> list[str]:
        t_end = time.monotonic() + timeout
        # only our cells' replies count (start_new_kernel's kernel_info reply may come in late)
        while any(i not in self.replies for i in self.ids) and time.monotonic() < t_end:
            self._pump(0.2)
        while self._pump(0.2):  # the last outputs
            pass
        return [self.replies.get(i, "no reply (hung)") for i in self.ids]

    def text(self, cell: int) -> str:
        return "".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
                       for o in self.outputs.get(self.ids[cell], []))

    def errors(self, cell: int) -> list[dict]:
        return [o for o in self.outputs.get(self.ids[cell], []) if "ename" in o]

    def close(self) -> None:
        self.km.shutdown_kernel(now=True)


RUN_ALL_CELLS = [
    "import asyncio, nbgen\n"
    "llm = nbgen.Engine(model_path=MODEL, dtype='float32', device='cpu')\n"
    "sp = {'temperature': 0, 'max_new_tokens': 8, 'ignore_eos': True}",
    "async def main():\n    outs = await llm.async_generate(['a b', 'c d'], sp)\n    print('RUN1', len(outs))\n"
    "asyncio.run(main())",
    "async def main():\n    it = await llm.async_generate('a b', sp, stream=True)\n"
    "    return ''.join([c['text'] async for c in it])\n"
    "print('RUN2', len(asyncio.run(main())) > 0)",
    "out = await llm.async_generate('a b', sp)\nprint('AWAIT', out['meta_info']['completion_tokens'])",
    "async def bad():\n    raise ZeroDivisionError('from the coroutine')\nasyncio.run(bad())",
    "print('LAST', llm.generate('a b', sp)['meta_info']['completion_tokens'])",
]


@pytest.mark.parametrize("user_nest_asyncio", [False, True], ids=["plain", "user-applied-nest_asyncio"])
def test_run_all_with_asyncio_run_never_hangs(tiny_llama_dir, user_nest_asyncio):
    """asyncio.run and top-level await in cells queued all at once (Run All): every cell answers.
    SGLang's notebooks apply nest_asyncio themselves before creating the engine; that must hold too."""
    pytest.importorskip("nest_asyncio")
    first = f"MODEL = {tiny_llama_dir!r}" + ("\nimport nest_asyncio\nnest_asyncio.apply()" if user_nest_asyncio else "")
    ra = _RunAll()
    try:
        ra.submit([first] + RUN_ALL_CELLS)
        replies = ra.wait_all(timeout=240)
        assert replies == ["ok"] * 5 + ["error", "ok"], (replies, ra.outputs)
        assert "RUN1 2" in ra.text(2) and "RUN2 True" in ra.text(3) and "AWAIT 8" in ra.text(4)
        # the coroutine's exception keeps its type; the cells after it still run
        assert [e["ename"] for e in ra.errors(5)] == ["ZeroDivisionError"]
        assert "LAST 8" in ra.text(6)
    finally:
        ra.close()


def test_interrupt_inside_asyncio_run_cancels_and_the_engine_keeps_serving(tiny_llama_dir):
    ra = _RunAll()
    try:
        ra.submit([f"MODEL = {tiny_llama_dir!r}", RUN_ALL_CELLS[0],
                   "async def main():\n    try:\n        it = await llm.async_generate('a b', "
                   "{'max_new_tokens': 1000, 'ignore_eos': True}, stream=True)\n"
                   "        async for c in it:\n            print('STARTED', flush=True)\n            break_me = c\n"
                   "    finally:\n        print('CLEANUP', flush=True)\nasyncio.run(main())",
                   "print('AFTER', llm.generate('a b', sp)['meta_info']['completion_tokens'], "
                   "llm.stats()['running'])"])
        ra.wait_for_text(2, "STARTED", timeout=240)
        ra.km.interrupt_kernel()
        replies = ra.wait_all(timeout=120)
        assert replies == ["ok", "ok", "error", "ok"], (replies, ra.outputs)
        # one line, not the frames of the helper thread (GenerationInterrupted is a KeyboardInterrupt)
        assert [e["ename"] for e in ra.errors(2)] == ["GenerationInterrupted"], ra.errors(2)
        assert len(ra.errors(2)[0]["traceback"]) == 1 and "interrupted" in ra.errors(2)[0]["traceback"][0]
        assert "CLEANUP" in ra.text(2)  # the coroutine was cancelled, its finally ran
        assert "AFTER 8 0" in ra.text(3)  # the aborted stream left nothing running
    finally:
        ra.close()
