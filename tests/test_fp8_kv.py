"""The fp8 KV cache on the fast path (``kv_cache_dtype="fp8_e4m3"``): the K/V write kernels store
``attention/kv_quant.store``'s bytes, nbgen's Triton decode kernel reads e4m3 pages, flashinfer's
prefill reads them, CUDA graphs run with them, and a checkpoint's per-layer scales are read.

CPU: the kernels under TRITON_INTERPRET=1 against the torch reference (fp16 queries: the interpreter's
bf16 dot products are not usable), the scale names and files, the engine's capacity. GPU (``gpu``):
each kernel against the reference, the engine on the flashinfer backend against the torch backend
with the same fp8 arithmetic, graphs against eager.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import nbgen
from nbgen.attention import kv_quant
from nbgen.models.kv_scales import read_kv_scales, scale_kind
from tests.tiny_models import run_under_triton_interpreter

FP8 = torch.float8_e4m3fn


def _paged(lens: list[int], hkv: int, D: int, P: int, dtype: torch.dtype, device: str, seed: int):
    """Random HND K/V caches (values up to ~4x past e4m3's step sizes; some saturating at scale 1/64)
    with each sequence's pages scattered over the pool (page 0 unused) and the page tables."""
    g = torch.Generator().manual_seed(seed)
    npg = [(n + P - 1) // P for n in lens]
    total = sum(npg)
    shape = (total + 3, hkv, P, D)
    kc = (torch.randn(shape, generator=g) * 2).to(dtype).to(device)
    vc = (torch.randn(shape, generator=g) * 2).to(dtype).to(device)
    perm = (torch.randperm(total, generator=g) + 1).to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(npg), 0)
    last = torch.tensor([n - (m - 1) * P for n, m in zip(lens, npg)], dtype=torch.int32)
    return kc, vc, indptr, perm, last


def reference_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, indptr: torch.Tensor,
                     indices: torch.Tensor, lens: list[int], k_scale: float = 1.0, v_scale: float = 1.0
                     ) -> torch.Tensor:
    """fp32 softmax(q (K * k_scale)^T / sqrt(D)) (V * v_scale) per sequence over HND pages (fp8 or
    not), GQA by repetition: the torch backend's dequantized arithmetic without its roundings."""
    B, hq, D = q.shape
    hkv = kc.shape[1]
    out = []
    for b, n in enumerate(lens):
        pg = indices[indptr[b]: indptr[b + 1]].long().to(kc.device)
        k = kc[pg].transpose(1, 2).reshape(-1, hkv, D)[:n].float() * k_scale
        v = vc[pg].transpose(1, 2).reshape(-1, hkv, D)[:n].float() * v_scale
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)      # [n, Hq, D]
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * D ** -0.5
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


def assert_stored(got: torch.Tensor, x: torch.Tensor, scale: float, device: str) -> None:
    """``got`` (e4m3) holds kv_quant.store(x, scale) byte for byte. The Triton interpreter's (CPU)
    fp32 -> e4m3 cast is not exact (ties away from zero, subnormals, a rounding carry into the exponent
    dropped: 7.97 -> 4.0): there a few elements may hold the neighbouring e4m3 value or half the value."""
    want = kv_quant.store(x, scale, FP8)
    diff = got.view(torch.uint8) != want.view(torch.uint8)
    if device != "cpu":
        assert not bool(diff.any()), int(diff.sum())
        return
    g, w = got.float()[diff], want.float()[diff]
    gb, wb = got.view(torch.uint8)[diff].int(), want.view(torch.uint8)[diff].int()
    neighbour = ((gb - wb).abs() == 1) & ((gb ^ wb) < 0x80)          # same sign, adjacent magnitude
    ok = neighbour | (g * 2 == w)
    assert bool(ok.all()), torch.stack([(x.float() / scale)[diff], g, w])[:, ~ok][:, :8]
    assert diff.float().mean().item() < 0.1


def check_kv_write(device: str, dtype: torch.dtype) -> None:
    """write_kv into fp8 caches equals kv_quant.store of the rows (scales 1, 1/64 with saturation, 3);
    into model-dtype caches it is a copy (the scales unused)."""
    from nbgen.kernels.kv_write import write_kv

    H, P, D, T = 2, 4, 32, 11
    for ks, vs in ((1.0, 1.0), (1 / 64, 3.0)):
        k = (torch.randn(T, 3 * H * D) * 8).to(dtype).to(device)[:, : H * D]     # strided rows
        v = (torch.randn(T, H * D) * 8).to(dtype).to(device)
        slots = (torch.randperm(8 * P)[:T] + P).to(device)
        kc = torch.zeros(10, H, P, D, dtype=FP8, device=device)
        vc = torch.zeros_like(kc)
        write_kv(k, v, kc, vc, slots, ks, vs)
        page, off = slots.cpu() // P, slots.cpu() % P
        assert_stored(kc.cpu()[page, :, off], k.cpu().reshape(T, H, D), ks, device)
        assert_stored(vc.cpu()[page, :, off], v.cpu().reshape(T, H, D), vs, device)
        mc = torch.zeros(10, H, P, D, dtype=dtype, device=device)
        mv = torch.zeros_like(mc)
        write_kv(k, v, mc, mv, slots, ks, vs)
        assert torch.equal(mc.cpu()[page, :, off], k.cpu().reshape(T, H, D))


def check_decode(device: str, dtype: torch.dtype) -> None:
    """The Triton decode kernel over e4m3 pages against the fp32 reference of the dequantized pages:
    one split and several, group sizes 1 / 4 / 3 (padded), unit and non-unit scales."""
    from nbgen.kernels.triton_decode import TritonDecodeWrapper

    cases = [(4, 1, 32, 4, [5, 9, 40]), (8, 2, 16, 4, [1, 17, 64]), (6, 2, 32, 8, [3, 100])]
    if device == "cuda":
        cases += [(32, 8, 128, 16, [1, 300, 4099]), (14, 2, 64, 16, [(37 * i) % 1500 + 1 for i in range(50)])]
    for i, (hq, hkv, D, P, lens) in enumerate(cases):
        kc, vc, indptr, indices, last = _paged(lens, hkv, D, P, dtype, device, seed=i)
        for ks, vs in ((1.0, 1.0), (0.5, 2.0)):
            k8, v8 = kv_quant.store(kc, ks, FP8), kv_quant.store(vc, vs, FP8)
            q = torch.randn(len(lens), hq, D).to(dtype).to(device)
            w = TritonDecodeWrapper(hq, hkv, D, P, torch.device(device))
            for _ in range(2):                # the second launch reuses the re-armed split counters
                pin = device == "cuda"
                w.plan(*(t.pin_memory() if pin else t for t in (indptr, indices, last)))
                o = w.run(q, (k8, v8), k_scale=ks, v_scale=vs)
                ref = reference_decode(q.cpu(), k8.cpu(), v8.cpu(), indptr, indices, lens, ks, vs)
                err = (o.float().cpu() - ref).abs()
                assert bool((err <= 2 ** -7 * ref.abs() + 2e-2 * vs).all()), (i, ks, err.max().item())


def check_fused_rope_write(device: str, dtype: torch.dtype) -> None:
    """The fused RoPE kernel's K/V write into fp8 caches stores kv_quant.store of the rotated k and of v,
    and leaves q/k/v exactly as the same kernel without a K/V target."""
    from nbgen.kernels import qk_norm_rope as fq
    from nbgen.kernels.kv_write import KVTarget
    from nbgen.models.layers import get_rope

    torch.manual_seed(0)
    hq, hkv, D, P, T = 4, 2, 32, 4, 7
    qkv = (torch.randn(T, (hq + 2 * hkv) * D) * 3).to(dtype).to(device)
    pos = torch.randint(0, 200, (T,)).to(device)
    rope = get_rope(D, 256, 1e4, None).to(device)
    kc = torch.zeros(12, hkv, P, D, dtype=FP8, device=device)
    vc = torch.zeros_like(kc)
    slots = (torch.randperm(10 * P)[:T] + P).to(device)
    plain = qkv.clone()
    fq.qk_norm_rope_(plain, pos, None, None, 0.0, rope.cos_sin_cache, hq, hkv, D)
    fq.qk_norm_rope_(qkv, pos, None, None, 0.0, rope.cos_sin_cache, hq, hkv, D,
                     kv=KVTarget(kc, vc, slots, 0.25, 2.0))
    assert torch.equal(qkv, plain)
    page, off = slots.cpu() // P, slots.cpu() % P
    k = qkv.cpu()[:, hq * D: (hq + hkv) * D].reshape(T, hkv, D)
    v = qkv.cpu()[:, (hq + hkv) * D:].reshape(T, hkv, D)
    assert_stored(kc.cpu()[page, :, off], k, 0.25, device)
    assert_stored(vc.cpu()[page, :, off], v, 2.0, device)


def _interpreted() -> None:
    check_kv_write("cpu", torch.float16)
    check_decode("cpu", torch.float16)
    check_fused_rope_write("cpu", torch.float16)


def test_fp8_kv_kernels_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    res = run_under_triton_interpreter("import tests.test_fp8_kv as t; t._interpreted()")
    assert res.returncode == 0, res.stderr[-3000:]


def test_kv_scale_names() -> None:
    """The checkpoint formats SGLang / vLLM read: per-layer k_scale / v_scale (also under attn. or the
    projections), compressed-tensors output scales, the older kv_scale; nothing else matches."""
    p = "model.layers.3.self_attn."
    assert scale_kind(p + "k_scale") == (3, "k") and scale_kind(p + "v_scale") == (3, "v")
    assert scale_kind(p + "attn.k_scale") == (3, "k")
    assert scale_kind(p + "k_proj.k_scale") == (3, "k") and scale_kind(p + "v_proj.v_scale") == (3, "v")
    assert scale_kind(p + "k_proj.output_scale") == (3, "k") and scale_kind(p + "v_proj.output_scale") == (3, "v")
    assert scale_kind(p + "kv_scale") == (3, "kv")
    for other in (p + "k_proj.weight_scale", p + "k_proj.input_scale", p + "o_proj.output_scale",
                  p + "q_proj.output_scale", "model.layers.3.mlp.down_proj.output_scale", p + "k_proj.weight"):
        assert scale_kind(other) is None, other


def test_read_kv_scales_from_safetensors(tmp_path) -> None:
    """Per layer (k, v); a per-head scale reduced to its maximum; missing layers 1.0; no scale
    tensors at all: (); a non-positive scale is refused by name."""
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.2.self_attn.kv_scale": torch.tensor([1.5, 3.0]),
               "model.layers.1.self_attn.k_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "a.safetensors"))
    assert read_kv_scales(str(tmp_path), 3) == ((0.5, 0.25), (1.0, 1.0), (3.0, 3.0))
    assert read_kv_scales(str(tmp_path / "missing"), 3) == ()
    empty = tmp_path / "e"
    empty.mkdir()
    save_file({"model.norm.weight": torch.ones(2)}, str(empty / "m.safetensors"))
    assert read_kv_scales(str(empty), 3) == ()
    save_file({"model.layers.1.self_attn.v_scale": torch.tensor(0.0)}, str(empty / "n.safetensors"))
    with pytest.raises(ValueError, match="v_scale"):
        read_kv_scales(str(empty), 3)


def _with_scales(src: str, dst, scales: dict[str, float]) -> str:
    """A copy of the tiny checkpoint at ``src`` whose safetensors also hold KV-cache scale tensors."""
    import shutil

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update({k: torch.tensor(v) for k, v in scales.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(dst)


def test_engine_reads_checkpoint_kv_scales(tiny_llama_dir: str, tmp_path) -> None:
    """The checkpoint's scales reach the fp8 pool (the weights load past them; get_server_info lists
    them), a model-dtype pool has none, and a scaled fp8 cache serves."""
    path = _with_scales(tiny_llama_dir, tmp_path / "ckpt", {"model.layers.0.self_attn.k_scale": 0.5,
                                                           "model.layers.1.self_attn.v_scale": 2.0})
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with nbgen.Engine(path, device="cpu", dtype="bfloat16", kv_cache_dtype="fp8_e4m3") as eng:
        info = eng.get_server_info()
        scaled = eng.generate("hello there", sp)
    with nbgen.Engine(path, device="cpu", dtype="bfloat16") as eng:
        assert eng.get_server_info()["kv_scales"] == []
        plain = eng.generate("hello there", sp)
    assert info["kv_scales"][:2] == [[0.5, 1.0], [1.0, 2.0]]
    assert scaled["meta_info"]["completion_tokens"] == plain["meta_info"]["completion_tokens"] == 8


# ---- GPU -------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


@gpu
def test_gpu_fp8_kv_write_kernels_store_the_reference_bytes() -> None:
    """kv_write and the fused RoPE kernel's write: kv_quant.store's bytes exactly (bf16 rows)."""
    check_kv_write("cuda", torch.bfloat16)
    check_fused_rope_write("cuda", torch.bfloat16)


@gpu
def test_gpu_triton_decode_reads_fp8_pages() -> None:
    """nbgen's decode kernel over e4m3 pages within bf16 rounding of the dequantized fp32 attention."""
    check_decode("cuda", torch.bfloat16)


def _steps(P: int):
    """Three steps over a page pool: two fresh prompts (one chunked), then a mixed step (a decode row
    first, the second prompt's last chunk), then a decode-only step; page tables scattered."""
    from types import SimpleNamespace

    from nbgen.core.batch import ScheduledBatch, SeqWork

    a, b = SimpleNamespace(rid="a", prompt_ids=[0] * 33), SimpleNamespace(rid="b", prompt_ids=[0] * 111)
    pages_a = [7, 3, 12, 5, 9]                      # up to 80 tokens
    pages_b = [2, 14, 8, 11, 4, 6, 13, 10]          # up to 128 tokens
    s1 = ScheduledBatch([SeqWork(a, [0] * 33, 0, pages_a, True), SeqWork(b, [0] * 70, 0, pages_b, False)], P)
    s2 = ScheduledBatch([SeqWork(a, [0], 33, pages_a, True), SeqWork(b, [0] * 41, 70, pages_b, True)], P)
    s3 = ScheduledBatch([SeqWork(a, [0], 34, pages_a, True), SeqWork(b, [0], 111, pages_b, True)], P)
    return [s1, s2, s3]


@gpu
@pytest.mark.parametrize("extend", [True, False])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_gpu_flashinfer_backend_fp8_matches_the_torch_backend(hq: int, hkv: int, extend: bool, monkeypatch) -> None:
    """Layer by layer, the flashinfer backend on an fp8 pool (its K/V write, the steps' chunks over e4m3
    pages with the layer's scales on nbgen's Triton chunk attention, or with ``extend`` off on flashinfer's
    prefill; nbgen's decode kernel for the decode rows) against the torch backend on the same fp8 pool
    (kv_quant's arithmetic): close outputs, equal stored bytes."""
    from nbgen.attention import prefill_plans
    from nbgen.attention.base import KVCacheSpec
    from nbgen.attention.flashinfer_backend import FlashInferBackend
    from nbgen.attention.torch_backend import TorchAttentionBackend

    pytest.importorskip("flashinfer")
    if not extend:
        monkeypatch.setattr(prefill_plans, "EXTEND_MAX_TOKENS", 0)
    D, P = 128, 16
    scales = ((1.0, 1.0), (0.25, 4.0))
    spec = KVCacheSpec(2, 16, P, hq, hkv, D, torch.bfloat16, torch.device("cuda"), kv_dtype=FP8, layer_scales=scales)
    fi, ref = FlashInferBackend(spec), TorchAttentionBackend(spec)
    g = torch.Generator(device="cuda").manual_seed(0)
    for step, batch in enumerate(_steps(P)):
        T = batch.num_tokens
        mf, mr = fi.prepare(batch), ref.prepare(batch)
        assert (mf.wrapper is fi.prefill.extend) == (extend and not batch.is_decode_only)
        for layer in range(2):
            q = torch.randn(T, hq * D, device="cuda", generator=g).bfloat16()
            k = (torch.randn(T, hkv * D, device="cuda", generator=g) * 2).bfloat16()
            v = torch.randn(T, hkv * D, device="cuda", generator=g).bfloat16()
            got = fi.forward(layer, q, k, v, mf).float()
            want = ref.forward(layer, q, k, v, mr).float()
            err = (got - want).abs()
            # both read the same e4m3 values (times the scales); they differ in roundings only
            assert err.max().item() < 3e-2 and err.mean().item() < 3e-3, (step, layer, err.max().item(),
                                                                           err.mean().item())
            # the same bytes in both pools (HND pages vs head-major slots)
            kf = fi.k_cache[layer].view(torch.uint8).transpose(1, 2).reshape(-1, hkv, D).transpose(0, 1)
            assert torch.equal(kf, ref.k_cache[layer].view(torch.uint8))


@gpu
def test_gpu_engine_fp8_kv_fast_path(gpu_model_dir: str) -> None:
    """kv_cache_dtype='fp8_e4m3' on CUDA runs the flashinfer backend with decode graphs: greedy outputs
    close to the torch backend with the same fp8 arithmetic, graphs equal to eager, twice the pages of
    a bf16 pool in the same memory, and close to bf16 KV."""
    from tests.tiny_models import assert_close_runs, gpu_generate, gpu_prompts

    prompts = gpu_prompts(12)
    fast = gpu_generate(gpu_model_dir, prompts, logprobs=True, kv_cache_dtype="fp8_e4m3")
    eager = gpu_generate(gpu_model_dir, prompts, logprobs=True, kv_cache_dtype="fp8_e4m3", disable_cuda_graph=True)
    torch_ref = gpu_generate(gpu_model_dir, prompts, logprobs=True, kv_cache_dtype="fp8_e4m3",
                             attention_backend="torch")
    # the two backends round the K/V rows differently upstream (fused RoPE and folded norms against
    # torch ops); e4m3's coarse steps turn a one-ulp bf16 difference into a one-step e4m3 one now and
    # then, so their logprobs sit a little further apart than bf16 runs' (H200: median 0.053, max 0.23)
    assert_close_runs(fast, torch_ref, median=0.08)
    assert_close_runs(fast, eager)
    pages = {}
    # a budget of ~2 GiB for the pool on any card: the memory in use, the engine's 1 GiB reserve and 2 GiB
    free, total = torch.cuda.mem_get_info()
    fraction = (total - free + 3 * 2**30) / total
    for kv in ("auto", "fp8_e4m3"):
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                          mem_fraction_static=fraction, max_running_requests=4096) as eng:   # KV bound by memory
            info = eng.get_server_info()
            pages[kv] = info["num_pages"]
            assert info["attention_backend"] == "FlashInferBackend" and info["cuda_graph_batch_sizes"]
    # the pool is what the memory budget leaves after the device's used memory: leftovers of the engines
    # this process ran before (workspaces, loaded modules) have moved it by ~80 MiB between runs
    assert 1.85 < pages["fp8_e4m3"] / pages["auto"] < 2.1, pages
