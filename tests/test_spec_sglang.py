"""SGLang's offline EAGLE engine test (``test/srt/test_eagle_infer_a.py``: ``TestEAGLEEngine``,
``TestEAGLE3Engine``) with the import and model paths changed: a tiny random Llama target and a
random EAGLE / EAGLE3 head saved in the published format instead of downloaded checkpoints.

SGLang's tree settings are kept (``speculative_num_steps=5, speculative_eagle_topk=4,
speculative_num_draft_tokens=8``). Changed beyond paths, because they need trained heads: the
acceptance-length thresholds (1.9 / 2.5 / 3.6) become "at least one token per verify step", and every
batch output must equal the reference engine's (SGLang only prints them)."""
from __future__ import annotations

import unittest

import pytest

import nbgen as sgl
from nbgen.models.eagle import save_random_head
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="class")
def eagle_paths(request, tmp_path_factory):
    target = make_tiny_model("llama", str(tmp_path_factory.mktemp("eagle_target")), num_hidden_layers=6)
    request.cls.target = target
    request.cls.heads = {eagle3: save_random_head(target, str(tmp_path_factory.mktemp("eagle_head")), eagle3)
                         for eagle3 in (False, True)}


@pytest.mark.usefixtures("eagle_paths")
class TestEAGLEEngine(unittest.TestCase):
    ALGORITHM = "EAGLE"
    NUM_CONFIGS = 2

    def base_config(self) -> dict:
        return {"model_path": self.target, "speculative_draft_model_path": self.heads[self.ALGORITHM == "EAGLE3"],
                "speculative_algorithm": self.ALGORITHM, "speculative_num_steps": 5,
                "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8, "mem_fraction_static": 0.7,
                "cuda_graph_max_bs": 4, "device": "cpu", "dtype": "float32"}

    def setUp(self):
        self.prompt = "Today is a sunny day and I like"
        self.sampling_params = {"temperature": 0, "max_new_tokens": 8}
        self.batch_prompts = ["Hello, my name is", "The president of the United States is",
                              "The capital of France is", "The future of AI is"]
        ref_engine = sgl.Engine(model_path=self.target, cuda_graph_max_bs=1, device="cpu", dtype="float32")
        self.ref_output = ref_engine.generate(self.prompt, self.sampling_params)["text"]
        self.ref_batch = [o["text"] for o in ref_engine.generate(self.batch_prompts,
                                                                  {"temperature": 0, "max_new_tokens": 50})]
        ref_engine.shutdown()

    def test_correctness(self):
        configs = [self.base_config(), {**self.base_config(), "chunked_prefill_size": 4}]
        for i, config in enumerate(configs[: self.NUM_CONFIGS]):
            with self.subTest(i=i):
                engine = sgl.Engine(**config, log_level="info", decode_log_interval=10)
                try:
                    self._test_single_generation(engine)
                    self._test_batch_generation(engine)
                    self._test_eos_token(engine)
                    self._test_acc_length(engine)
                finally:
                    engine.shutdown()

    def _test_single_generation(self, engine):
        output = engine.generate(self.prompt, self.sampling_params)["text"]
        self.assertEqual(output, self.ref_output)

    def _test_batch_generation(self, engine):
        outputs = engine.generate(self.batch_prompts, {"temperature": 0, "max_new_tokens": 50})
        self.assertEqual([o["text"] for o in outputs], self.ref_batch)
        avg_spec_accept_length = engine.get_server_info()["avg_spec_accept_length"]
        self.assertGreaterEqual(avg_spec_accept_length, 1.0)

    def _test_eos_token(self, engine):
        prompt = "[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\nToday is a sunny day and I like [/INST]"
        params = {"temperature": 0.1, "max_new_tokens": 64, "skip_special_tokens": False}
        tokenizer = engine.tokenizer
        output = engine.generate(prompt, params)["text"]
        tokens = tokenizer.encode(output, add_special_tokens=False)
        self.assertNotIn(tokenizer.eos_token_id, tokens)

    def _test_acc_length(self, engine):
        prompt = ["Human: Give me a fully functional FastAPI server. Show the python code.\n\nAssistant:"] * 5
        output = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 64})[0]
        acc_length = output["meta_info"]["completion_tokens"] / output["meta_info"]["spec_verify_ct"]
        self.assertGreaterEqual(acc_length, 1.0)


class TestEAGLE3Engine(TestEAGLEEngine):
    ALGORITHM = "EAGLE3"
    NUM_CONFIGS = 1
