"""SGLang's awaitable LoRA calls: async_load_lora_adapter / async_unload_lora_adapter."""
from __future__ import annotations

import asyncio

import pytest

import nbgen
from tests.test_lora import PROMPTS, make_adapter


@pytest.fixture(scope="module")
def lora_setup(tiny_llama_dir, tmp_path_factory):
    path = make_adapter(tiny_llama_dir, str(tmp_path_factory.mktemp("lora_async") / "c"), 3, r=2, alpha=4)
    eng = nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", enable_lora=True)
    yield eng, path
    eng.shutdown()


def test_async_load_and_unload_lora_adapter(lora_setup):
    """The unload waits for a request of the same event loop that still uses the adapter, which
    keeps running meanwhile."""
    eng, path = lora_setup
    params = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}

    async def main():
        res = await eng.async_load_lora_adapter("c", path)
        assert res.success and "c" in res.loaded_adapters
        assert not (await eng.async_load_lora_adapter("c", path)).success            # name taken
        running = asyncio.ensure_future(eng.async_generate(PROMPTS[1], params, lora_path="c"))
        while not eng.stats()["running"] and not running.done():   # admitted before the unload
            await asyncio.sleep(0)
        gone = await eng.async_unload_lora_adapter("c")
        assert running.done()                # the unload returned after the request finished
        assert gone.success and "c" not in gone.loaded_adapters
        assert not (await eng.async_unload_lora_adapter("c")).success                # unknown now
        with pytest.raises(ValueError, match="lora_name"):
            await eng.async_load_lora_adapter("", path)
        return (await running)["output_ids"]

    out = asyncio.run(main())
    assert len(out) == 40
    assert eng.generate(PROMPTS[1], params)["meta_info"]["completion_tokens"] == 40   # still serving
