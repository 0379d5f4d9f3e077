"""Tiny random models built with transformers (fp32) and saved with save_pretrained, plus a tokenizer;
and the GPU tests' shared helpers (random bf16-sized models, greedy engine runs, their comparison)."""
from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

import nbgen
from nbgen.kernels.host_staging import StagingRing

_CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Hello, my name is nbgen and I generate text in notebooks.",
    "def add(a, b):\n    return a + b\n",
    "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9, \u65e5\u672c\u8a9e, emoji \U0001F600 \U0001F680.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation !?.,;:'\"()[]{}",
]


def make_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained in memory (no hub), with a chat template and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


def make_tiny_model(family: str, path: str, vocab_size: int = 384, seed: int = 0, **overrides) -> str:
    """Save a tiny random fp32 model of ``family`` ('llama' | 'llama3' | 'qwen2' | 'qwen3') with a tokenizer
    (``seed``: the weights' random seed)."""
    import transformers as tf

    tok = make_tokenizer(vocab_size)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    common.update(overrides)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "llama3":
        common["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(tie_word_embeddings=True, **common), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = tf.Qwen3Config(head_dim=32, **common), tf.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    # random init is small; widen the logits so greedy choices are not near-ties
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# ---- GPU test helpers (tests/test_gpu.py, test_triton_decode.py, test_small_gemm.py, test_norm_fold.py)
GREEDY_SP = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}


def make_gpu_model(family: str, path: str, layers: int = 3, norm_noise: float = 0.0) -> str:
    """A random Llama / Qwen2 / Qwen3 (head_dim 128, weights widened) saved at ``path`` for the GPU tests;
    ``norm_noise``: that much of randn added to the norm weights (so folding them is not a no-op)."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  eos_token_id=1, bos_token_id=0, pad_token_id=0)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                                  **common), tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(tie_word_embeddings=True, **common), tf.Qwen2ForCausalLM
    else:
        cfg, cls = tf.Qwen3Config(head_dim=128, **common), tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():   # widen the logits so greedy choices are rarely near-ties in bf16
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
        for name, p in model.named_parameters():
            if norm_noise and "norm" in name:
                p.add_(norm_noise * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def gpu_prompts(n: int = 12) -> list[list[int]]:
    """n random token-id prompts of mixed lengths (1 to 700 tokens)."""
    rng = random.Random(0)
    return [[rng.randrange(2, 512) for _ in range(rng.choice([1, 5, 17, 64, 200, 700]))] for _ in range(n)]


def gpu_generate(path: str, prompts: list[list[int]], logprobs: bool = False, **cfg) -> list[dict]:
    """Greedy outputs of a bf16 CUDA engine on ``path`` (decode graphs up to 16 rows unless disabled)."""
    with nbgen.Engine(path, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, **cfg) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=logprobs, use_tqdm=False)
        info = eng.get_server_info()
    if cfg.get("attention_backend") != "torch":
        assert info["attention_backend"] == "FlashInferBackend"
        assert (info["cuda_graph_batch_sizes"] == []) == bool(cfg.get("disable_cuda_graph"))
    return out


QWEN25_VL_7B_CONFIG = os.path.join(os.path.dirname(__file__), "..", "nbgen", "bench", "configs", "qwen2.5-vl-7b")


def random_image(h: int, w: int, seed: int = 0):
    """An h x w RGB PIL image of uniform random bytes."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def random_images(n: int) -> list:
    """n random RGB PIL images of four sizes (the VLM GPU tests' inputs)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(56, 56), (60, 90), (120, 40), (112, 112)]
    return [Image.fromarray((rng.random((*sizes[i % 4], 3)) * 255).astype("uint8")) for i in range(n)]


def vlm_image_run(path: str, device: str, dtype: str, **cfg) -> list[dict]:
    """12 greedy chat requests with one image each, the fourth text-only, on a VLM engine at ``path``
    (24 new tokens, ``ignore_eos``, logprobs: for ``assert_close_runs``)."""
    n = 12
    with nbgen.Engine(path, device=device, dtype=dtype, **cfg) as eng:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Image {i}?"}]}
                for i in range(n)]
        prompts = [eng.apply_chat_template([m]) for m in msgs]
        prompts[3] = "Text only, no image."
        images = random_images(n)
        images[3] = None
        return eng.generate(prompts, {**GREEDY_SP, "max_new_tokens": 24}, image_data=images, return_logprob=True,
                            use_tqdm=False)


def output_ids(outs: list[dict]) -> list[list[int]]:
    """The output ids of each output dict."""
    return [o["output_ids"] for o in outs]


def assert_close_runs(a: list[dict], b: list[dict], median: float = 0.05, largest: Optional[float] = 0.5,
                      first_share: float = 0.9, steps: int = 4) -> None:
    """Two bf16 greedy runs through differently tiled kernels. On random models the top-2 logits are
    often within bf16 noise, so free-running sequences may fork at a near-tie; up to the fork the
    chosen tokens are the same and their logprobs (decode path) must agree closely (median |Δ| at most
    ``median``, each at most ``largest``). A broken kernel forks at once on most sequences and shows
    large logprob errors. ``first_share``: the share of sequences whose first (prefill) token must
    match; ``steps``: decode steps compared per sequence on average, at least."""
    diffs, forks = [], []
    for x, y in zip(a, b):
        lx = [lp for lp, _t, _s in x["meta_info"]["output_token_logprobs"]]
        ly = [lp for lp, _t, _s in y["meta_info"]["output_token_logprobs"]]
        n = next((i for i, (p, q) in enumerate(zip(x["output_ids"], y["output_ids"])) if p != q), len(lx))
        forks.append(n)
        diffs += [abs(p - q) for p, q in zip(lx[:n], ly[:n])]
    assert sum(f >= 1 for f in forks) >= first_share * len(forks), forks   # the prefill token matches
    assert len(diffs) >= steps * len(forks), forks                         # decode steps were compared
    assert statistics.median(diffs) <= median, (statistics.median(diffs), max(diffs))
    assert largest is None or max(diffs) <= largest, (statistics.median(diffs), max(diffs))


def assert_close_prompt_logprobs(a: list[dict], b: list[dict], prompts: list[list[int]], what: str,
                                  median: float = 0.01, largest: float = 0.25) -> None:
    """Two runs' teacher-forced prompt logprobs (``logprob_start_len=0``) over the same prompts: one per
    prompt token after the first, median |Δ| at most ``median``, each at most ``largest`` (printed)."""
    d = [abs(x[0] - y[0]) for ra, rb in zip(a, b) for x, y in
         zip(ra["meta_info"]["input_token_logprobs"][1:], rb["meta_info"]["input_token_logprobs"][1:])]
    assert len(d) == sum(len(p) - 1 for p in prompts)
    print(f"prompt logprobs, {what}: median |d| {statistics.median(d):.5f}, max {max(d):.4f}")
    assert statistics.median(d) <= median and max(d) <= largest, (statistics.median(d), max(d))


def teacher_forced_vs_hf(model_dir: str, chunk: Optional[int] = None) -> dict[str, float]:
    """Prompt logprobs of nbgen (bf16, CUDA) against HF bf16 on the same weights, teacher-forced ->
    {agree: top-1 agreement, agree_clear: the same where HF's top-2 gap > 0.1, clear: the share of such
    positions, dlp: median |dlogprob|}."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(1)
    seqs = [[rng.randrange(2, 512) for _ in range(n)] for n in (64, 200, 333, 512)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ref_top, ref_lp, margin = [], [], []
    with torch.no_grad():
        for s in seqs:
            lp = hf(torch.tensor([s], device="cuda")).logits[0].float().log_softmax(-1)   # [L, V]
            ref_top += lp[:-1].argmax(-1).tolist()
            top2 = lp[:-1].topk(2, dim=-1).values
            margin += (top2[:, 0] - top2[:, 1]).tolist()
            ref_lp += [lp[i - 1, s[i]].item() for i in range(1, len(s))]
    del hf
    torch.cuda.empty_cache()
    with nbgen.Engine(model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16,
                      chunked_prefill_size=chunk) as eng:
        outs = eng.generate(input_ids=seqs, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                            return_logprob=True, logprob_start_len=0, top_logprobs_num=1, use_tqdm=False)
    got_top, got_lp = [], []
    for o in outs:
        got_lp += [lp for lp, _t, _x in o["meta_info"]["input_token_logprobs"][1:]]
        got_top += [top[0][1] for top in o["meta_info"]["input_top_logprobs"][1:]]
    assert len(got_lp) == len(ref_lp) and len(got_top) == len(ref_top)
    agree = sum(a == b for a, b in zip(got_top, ref_top)) / len(ref_top)
    dlp = statistics.median(abs(a - b) for a, b in zip(got_lp, ref_lp))
    clear = [a == b for a, b, m in zip(got_top, ref_top, margin) if m > 0.1]
    print(f"top-1 agreement {agree:.4f} (margin > 0.1: {sum(clear) / len(clear):.4f} of {len(clear)}), "
          f"median |dlogprob| {dlp:.4f}")
    return {"agree": agree, "agree_clear": sum(clear) / len(clear), "clear": len(clear) / len(ref_top), "dlp": dlp}


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """Reference K/V write in plain torch: k, v [T, Hkv*D] into HND caches [pages, Hkv, P, D] at flat slots."""
    T = k.shape[0]
    _, H, P, D = k_cache.shape
    page, off = slots // P, slots % P
    k_cache[page, :, off] = k.reshape(T, H, D)
    v_cache[page, :, off] = v.reshape(T, H, D)


def grammar_engine(**kw) -> "nbgen.Engine":
    """The structured-output tests' engine: the embedded model, or where NBGEN_TEST_GRAMMAR_MODEL names a
    config (the GPU host) dummy weights of it with NBGEN_TEST_GRAMMAR_TOKENIZER's tokenizer."""
    model = os.environ.get("NBGEN_TEST_GRAMMAR_MODEL")
    if model:
        tok = os.environ.get("NBGEN_TEST_GRAMMAR_TOKENIZER", model)
        return nbgen.Engine(model, load_format="dummy", tokenizer_path=tok, **kw)
    return nbgen.Engine(**kw)


def make_copy_head(target_dir: str, path: str) -> str:
    """An EAGLE head whose output is the target's feature (fc passes it through, the layer adds
    nothing): every node's children are the target's top-k after the root."""
    from safetensors.torch import load_file, save_file

    from nbgen.models.eagle import save_random_head

    save_random_head(target_dir, path, False)
    st = load_file(os.path.join(path, "model.safetensors"))
    H = st["fc.bias"].shape[0]
    st["fc.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)
    st["fc.bias"] = torch.zeros(H)
    st["layers.0.self_attn.o_proj.weight"].zero_()
    st["layers.0.mlp.down_proj.weight"].zero_()
    save_file(st, os.path.join(path, "model.safetensors"))
    return path


def gguf_round_trip(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w through GGUF's quantizer of ``qtype`` ("Q4_1", "Q8_0") and back, fp32 (a weight on that grid)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(quants.quantize(w.float().numpy(), kind), kind)))


# Run first under the interpreter: Triton 3.6's interpreter turns a scalar kernel argument (a one-element
# 1-d array) into an int with int(array), which numpy 2 refuses, so a kernel's range(.., K, ..) over a
# runtime K fails there; later versions squeeze the array first. That conversion, for either version.
_INTERPRETER_INDEX = ("import triton.runtime.interpreter as _ti\n"
                      "_patch_tensor = _ti._patch_lang_tensor\n"
                      "def _squeezed_index(tensor, scope):\n"
                      "    _patch_tensor(tensor, scope)\n"
                      "    scope.set_attr(tensor, '__index__', lambda self: int(self.handle.data.squeeze()))\n"
                      "_ti._patch_lang_tensor = _squeezed_index\n")


def run_under_triton_interpreter(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c code`` in a subprocess with TRITON_INTERPRET=1 (Triton picks the interpreter when it
    loads, so it cannot be switched on in this process), this checkout first on the path; scalar kernel
    arguments usable as ``range`` bounds on Triton 3.6's interpreter too (``_INTERPRETER_INDEX``)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", _INTERPRETER_INDEX + code], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)


def quantized_cpu_run_follows_fp32(path: str, counter: str, count: int) -> None:
    """A tiny model whose weights lie on a GGUF grid, on the CPU: in bf16 ``get_server_info()[counter]``
    (``int4_linears`` / ``int8_linears``) is ``count`` and a batch of 6 (the bf16 path) completes; the
    batch-1 greedy run (the quantized path) gives fp32's tokens up to a near-tie and logprobs within
    bf16 noise; in fp32 the counter is 0."""
    prompt = "hello there, how are"
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with nbgen.Engine(path, device="cpu", dtype="bfloat16") as eng:
        assert eng.get_server_info()[counter] == count
        one = eng.generate(prompt, sp, return_logprob=True)
        batch = eng.generate([prompt] * 6, sp)                     # 6 rows a step: the bf16 path
    with nbgen.Engine(path, device="cpu", dtype="float32") as eng:
        assert eng.get_server_info()[counter] == 0
        ref = eng.generate(prompt, sp, return_logprob=True)
    assert all(o["meta_info"]["completion_tokens"] == 12 for o in batch)
    n = next((i for i, (a, b) in enumerate(zip(one["output_ids"], ref["output_ids"])) if a != b), 12)
    assert n >= 4, (one["output_ids"], ref["output_ids"])
    diffs = [abs(a[0] - b[0]) for a, b in zip(one["meta_info"]["output_token_logprobs"][:n],
                                              ref["meta_info"]["output_token_logprobs"][:n])]
    assert statistics.median(diffs) <= 0.05 and max(diffs) <= 0.3, diffs


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broadcast_weights(port: int, path: str, group: str, device: str = "cpu") -> None:
    """A trainer at rank 0 of a 2-rank weight-update group (gloo on the CPU, NCCL on a CUDA ``device``):
    broadcast every fp32 parameter of the model at ``path``, in named_parameters order. Runs in a
    spawned process beside an engine that called ``init_weights_update_group``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from nbgen.runtime.weight_sync import init_custom_process_group

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    pg = init_custom_process_group("nccl" if cuda else "gloo", f"tcp://127.0.0.1:{port}", 2, 0, group)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    for _, p in hf.named_parameters():
        dist.broadcast(p.data, src=0, group=pg)
    if cuda:
        torch.cuda.synchronize()
    dist.destroy_process_group(pg)


class CountingRing(StagingRing):
    """``StagingRing`` in plain memory (no pinning, no events: CPU tests of the graph runners' staging) that
    counts the sets it hands out; ``made``: every ring built, in order."""

    made: list["CountingRing"] = []

    def __init__(self, make) -> None:
        super().__init__(make, cuda=False)
        self.handed = 0
        CountingRing.made.append(self)

    def next(self):
        self.handed += 1
        return super().next()
