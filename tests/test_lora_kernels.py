"""LoRA's GPU path and folded norms, checked on the CPU where possible.

- Folded norms: an adapter loaded into a model whose RMSNorm weights are folded into qkv / gate|up
  (A' = A diag(g)) gives the logits of the unfolded model with the adapter, which equal HF + peft.
- The slot pool + segmented Triton kernels (``kernels/lora_sgmv.py``) run under TRITON_INTERPRET=1 in
  a subprocess (the interpreter is chosen when Triton loads): a mixed batch's logits equal the torch
  path's, eager and through the static buffers a decode graph reads.
- GPU (``gpu`` mark): the kernels against the torch reference in bf16, and an engine whose LoRA decode
  steps replay CUDA graphs against the same engine without graphs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.torch_backend import TorchAttentionBackend
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.models import norm_fold
from nbgen.models.loader import load_model
from nbgen.runtime import lora as lora_mod
from nbgen.runtime.lora_setup import make_lora_manager
from tests.tiny_models import run_under_triton_interpreter


peft = pytest.importorskip("peft")
PAGE = 4
PROMPTS = [[5, 9, 2, 77, 31, 8, 100], [3, 4], [60, 61, 62, 63, 64], [11, 12, 13]]


def _base(tmp: Path) -> str:
    from tests.test_models import _hf_model

    d = tmp / "base"
    if not d.exists():
        _hf_model("LlamaForCausalLM").save_pretrained(d)       # random norm weights
    return str(d)


def _adapters(tmp: Path, base: str) -> dict[str, str]:
    from tests.test_lora import make_adapter

    return {"a": make_adapter(base, str(tmp / "ad_a"), seed=1, r=4, alpha=8),
            "b": make_adapter(base, str(tmp / "ad_b"), seed=2, r=8, alpha=8, use_rslora=True,
                              targets=["q_proj", "v_proj", "up_proj", "down_proj"])}


def _setup(tmp: Path, slots: bool):
    base = _base(tmp)
    cfg = EngineConfig(model_path=base, dtype="float32", device="cpu", enable_lora=True,
                       max_loras_per_batch=2, max_loaded_loras=4, max_lora_rank=8).resolved("cpu", None)
    loaded = load_model(cfg, torch.device("cpu"))
    mgr = make_lora_manager(cfg, loaded.model, loaded.dtype, torch.device("cpu"), slots=slots, graph_rows=32)
    return loaded, mgr


def _forward(loaded, mgr, prompts: list[list[int]], lora_ids: list, graph: bool = False) -> torch.Tensor:
    """One flat prefill of ``prompts`` through the torch backend, row groups under ``lora_ids`` ->
    fp32 logits [T, V]. ``graph``: the hooks read the slot pool's static buffers (the graphs' path)."""
    cfg = loaded.hf_config
    spec = KVCacheSpec(num_layers=cfg.num_hidden_layers, num_pages=64, page_size=PAGE,
                       num_q_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=loaded.dtype,
                       device=torch.device("cpu"))
    backend = TorchAttentionBackend(spec)
    seqs, next_page, starts, row = [], 1, [], 0
    for i, (ids, lid) in enumerate(zip(prompts, lora_ids)):
        n_pages = -(-len(ids) // PAGE)
        req = Request(str(i), ids, SamplingParams())
        req.lora_id = lid
        seqs.append(SeqWork(req=req, token_ids=ids, start_pos=0, pages=list(range(next_page, next_page + n_pages)),
                            sample=True))
        next_page += n_pages
        starts.append(row)
        row += len(ids)
    batch = ScheduledBatch(seqs=seqs, page_size=PAGE)
    meta = backend.prepare(batch)
    input_ids = torch.tensor([t for ids in prompts for t in ids])
    positions = torch.tensor([p for ids in prompts for p in range(len(ids))])
    with torch.no_grad():
        if graph:
            with mgr.capturing():
                mgr.stage(batch)
                return loaded.model.compute_logits(loaded.model(input_ids, positions, meta))
        step = mgr.step_info(batch, starts)
        if step is not None:
            mgr.begin(step)
        try:
            return loaded.model.compute_logits(loaded.model(input_ids, positions, meta))
        finally:
            mgr.end()


def test_folded_norms_adapter_equals_unfolded_and_peft(tmp_path: Path, monkeypatch) -> None:
    import transformers as tf

    loaded, mgr = _setup(tmp_path, slots=False)
    ads = _adapters(tmp_path, _base(tmp_path))
    ids = mgr.load("a", ads["a"]).lora_id
    plain = _forward(loaded, mgr, PROMPTS[:1], [None])
    unfolded = _forward(loaded, mgr, PROMPTS[:1], [ids])
    hf = peft.PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(_base(tmp_path), dtype=torch.float32),
                                        ads["a"]).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[0]])).logits[0].float()
    torch.testing.assert_close(unfolded, want, atol=2e-4, rtol=1e-4)
    assert (unfolded - plain).abs().max() > 1e-2                       # the adapter matters
    mgr.unregister("a")
    assert mgr.release_if_unused(ids)
    assert norm_fold.fold_norms(loaded.model)
    folded_id = mgr.load("a", ads["a"]).lora_id                         # folded at load: A' = A diag(g)
    folded = _forward(loaded, mgr, PROMPTS[:1], [folded_id])
    torch.testing.assert_close(folded, unfolded, atol=2e-4, rtol=1e-4)
    # without the fold of A the folded model would be wrong: the check can fail
    monkeypatch.setattr(lora_mod, "fold_norms_into", lambda weights, model: None)
    raw_id = mgr.load("raw", ads["a"]).lora_id
    assert (_forward(loaded, mgr, PROMPTS[:1], [raw_id]) - unfolded).abs().max() > 1e-3


def test_weight_update_refolds_adapters(tmp_path: Path) -> None:
    """A weight update changing folded norm weights (as ``runtime/weights.py`` writes it: the fused
    columns rescaled by new / old, then the norm) and ``refold``: the folded model with the adapter
    gives the logits of the unfolded model with the new norms and the adapter; without the refold it
    would not."""
    ads = _adapters(tmp_path, _base(tmp_path))
    unf, ref = _setup(tmp_path, slots=False)
    fol, mgr = _setup(tmp_path, slots=False)
    assert norm_fold.fold_norms(fol.model)
    iu, i_f = ref.load("a", ads["a"]).lora_id, mgr.load("a", ads["a"]).lora_id
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for lu, lf in zip(unf.model.model.layers, fol.model.model.layers):
            for name, fused in (("input_layernorm", lf.self_attn.qkv_proj), ("post_attention_layernorm", lf.mlp.gate_up_proj)):
                norm = getattr(lf, name).weight
                new = norm.data * (0.5 + torch.rand(norm.shape, generator=g))
                norm_fold.refold(fused.weight.data, norm.data, new)
                norm.data.copy_(new)
                getattr(lu, name).weight.data.copy_(new)
    want = _forward(unf, ref, PROMPTS[:2], [iu, None])
    stale = _forward(fol, mgr, PROMPTS[:2], [i_f, None])
    mgr.refold()
    torch.testing.assert_close(_forward(fol, mgr, PROMPTS[:2], [i_f, None]), want, atol=2e-4, rtol=1e-4)
    assert (stale - want).abs().max() > 1e-3
    mgr.refold()                                   # idempotent: folds from the adapter's own A
    torch.testing.assert_close(_forward(fol, mgr, PROMPTS[:2], [i_f, None]), want, atol=2e-4, rtol=1e-4)


def _segments(slot: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """perm / seg_start / seg_len of rows assigned to slots (-1: a base row)."""
    order = torch.argsort(slot, stable=True)
    perm = order[slot[order] >= 0].int()
    counts = torch.bincount(slot[slot >= 0], minlength=S).int()
    return (perm if perm.numel() else torch.zeros(1, dtype=torch.int32)), (torch.cumsum(counts, 0) - counts).int(), counts


def _kernel_cases() -> None:
    """The kernels against ``lora_reference`` in fp32: K over several split-K blocks, segments longer
    than a row block, one slot holding almost every row (max_rows given), empty slots, one row."""
    from nbgen.kernels.lora_sgmv import lora_reference, lora_sgmv

    g = torch.Generator().manual_seed(0)
    for T, K, sizes, R, S, max_rows in ((7, 96, [64, 16, 16], 4, 3, None), (40, 300, [48, 48], 8, 4, None),
                                        (37, 520, [32], 16, 2, 34), (1, 64, [32, 16, 16], 8, 2, None),
                                        (20, 64, [16], 4, 5, None)):
        nshard, N = len(sizes), sum(sizes)
        bounds = (sizes[0] if nshard > 1 else N, sizes[0] + sizes[1] if nshard > 2 else N)
        x = torch.randn(T, K, generator=g)
        a, b = torch.randn(S, nshard * R, K, generator=g) * 0.1, torch.randn(S, N, R, generator=g) * 0.1
        sc = torch.rand(S, generator=g) * 2
        slot = torch.randint(-1, S, (T,), generator=g)
        if max_rows is not None:
            slot[:] = 1
            slot[:T - max_rows] = -1
        perm, start, counts = _segments(slot, S)
        y = torch.randn(T, N, generator=g)
        y1, y2 = y.clone(), y.clone()
        lora_sgmv(x, y1, a, b, sc, perm, start, counts, bounds, nshard, max_rows)
        lora_reference(x, y2, a, b, sc, perm, start, counts, bounds, nshard)
        torch.testing.assert_close(y1, y2, atol=1e-4, rtol=1e-4)
        assert torch.equal(y1[slot < 0], y[slot < 0])                    # base rows untouched
        assert (y1 - y).abs().max() > 1e-2 or not (slot >= 0).any()     # the adapters add something


def _slot_check(tmp: str) -> None:
    """Run under TRITON_INTERPRET=1: the kernels against the reference, the slot pool's kernels
    against the torch path (fp32)."""
    _kernel_cases()
    tmp_p = Path(tmp)
    ads = _adapters(tmp_p, _base(tmp_p))
    ref_model, ref = _setup(tmp_p, slots=False)
    model, mgr = _setup(tmp_p, slots=True)
    ids = {}
    for name in ("a", "b"):
        ids[name] = (ref.load(name, ads[name]).lora_id, mgr.load(name, ads[name]).lora_id)
    names = ["a", None, "b", "a"]
    want = _forward(ref_model, ref, PROMPTS, [ids[n][0] if n else None for n in names])
    got = _forward(model, mgr, PROMPTS, [ids[n][1] if n else None for n in names])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # the graphs' layout (static buffers, a piecewise prefill bucket's rows): prompts of several tokens
    got = _forward(model, mgr, PROMPTS, [ids[n][1] if n else None for n in names], graph=True)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # decode-graph layout: one token per seq, rows read from the static buffers
    singles = [[p[0]] for p in PROMPTS]
    want = _forward(ref_model, ref, singles, [ids[n][0] if n else None for n in names])
    got = _forward(model, mgr, singles, [ids[n][1] if n else None for n in names], graph=True)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    base_only = _forward(model, mgr, singles, [None] * 4, graph=True)   # empty segments: the base model
    torch.testing.assert_close(base_only, _forward(ref_model, ref, singles, [None] * 4), atol=1e-5, rtol=1e-5)
    # a third adapter evicts the least recently used slot (two slots): still the right weights
    ids["c"] = (ref.load("c", ads["a"]).lora_id, mgr.load("c", ads["a"]).lora_id)
    for pair in (["c", "b"], ["a", "c"], ["b", "a"]):
        want = _forward(ref_model, ref, PROMPTS[:2], [ids[n][0] for n in pair])
        got = _forward(model, mgr, PROMPTS[:2], [ids[n][1] for n in pair])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    print("SLOT_CHECK_OK")


def test_slot_kernels_under_triton_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    _adapters(tmp_path, _base(tmp_path))            # built here, read by the subprocess
    res = run_under_triton_interpreter(f"import tests.test_lora_kernels as t; t._slot_check({str(tmp_path)!r})")
    assert "SLOT_CHECK_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_kernels_vs_reference_bf16() -> None:
    from nbgen.kernels.lora_sgmv import lora_reference, lora_sgmv

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    # the last two: the benchmark's decode step (256 rows round-robin over 8 rank-16 slots, Llama-8B's
    # qkv and down_proj: split-K over 16 and 56 blocks)
    for T, K, sizes, R, S in ((7, 4096, [4096, 1024, 1024], 16, 8), (300, 4096, [14336, 14336], 16, 4),
                              (33, 14336, [4096], 64, 3), (1, 896, [896, 128, 128], 8, 2),
                              (256, 4096, [4096, 1024, 1024], 16, 8), (256, 14336, [4096], 16, 8)):
        nshard, N = len(sizes), sum(sizes)
        bounds = (sizes[0] if nshard > 1 else N, sizes[0] + sizes[1] if nshard > 2 else N)
        x = torch.randn(T, K, device=dev, generator=g).to(dt)
        a = (torch.randn(S, nshard * R, K, device=dev, generator=g) * 0.02).to(dt)
        b = (torch.randn(S, N, R, device=dev, generator=g) * 0.02).to(dt)
        sc = torch.rand(S, device=dev, generator=g) * 2
        slot = torch.randint(-1, S, (T,), device=dev, generator=g)        # -1: base rows
        if T == 256:
            slot = torch.arange(T, device=dev) % S
        perm, start, counts = _segments(slot, S)
        y = torch.randn(T, N, device=dev, generator=g).to(dt)
        y1, y2 = y.clone(), y.clone()
        lora_sgmv(x, y1, a, b, sc, perm, start, counts, bounds, nshard)
        lora_reference(x, y2, a, b, sc, perm, start, counts, bounds, nshard)
        assert (y1.float() - y2.float()).abs().max().item() < 0.05, (T, K, sizes, R)
        assert torch.equal(y1[slot < 0], y[slot < 0])                    # base rows untouched


@pytest.mark.gpu
def test_gpu_lora_decode_graphs_equal_eager(gpu_model_dir, tmp_path: Path) -> None:
    """Decode steps with adapters replay CUDA graphs (the slot kernels captured); outputs match the
    same engine with graphs off, for a batch mixing two adapters and the base model."""
    import nbgen
    from tests.test_lora import make_adapter
    from tests.tiny_models import GREEDY_SP, assert_close_runs, gpu_prompts

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ads = [make_adapter(gpu_model_dir, str(tmp_path / f"g{i}"), seed=i, r=16, alpha=16) for i in range(2)]
    prompts = gpu_prompts(12)
    names = [["g0", "g1", None][i % 3] for i in range(len(prompts))]
    outs = []
    for extra in ({}, {"disable_cuda_graph": True}):
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, max_loras_per_batch=2,
                          lora_paths=[f"g0={ads[0]}", f"g1={ads[1]}"], **extra) as eng:
            info = eng.get_server_info()
            assert bool(info["cuda_graph_batch_sizes"]) == (not extra)
            outs.append(eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True,
                                     lora_path=names, use_tqdm=False))
    assert_close_runs(outs[0], outs[1])


@pytest.mark.gpu
def test_gpu_lora_engine_base_steps_replay_plain_graphs(gpu_model_dir, tmp_path: Path) -> None:
    """Decode steps without an adapter row replay the plain graphs (no LoRA kernels, fused epilogues
    on): base-model requests on an ``enable_lora`` engine give the outputs of an engine without LoRA,
    token for token and logprob for logprob; an adapter request in between still applies it."""
    import nbgen
    from tests.test_lora import make_adapter
    from tests.tiny_models import GREEDY_SP, gpu_prompts

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ad = make_adapter(gpu_model_dir, str(tmp_path / "g0"), seed=0, r=16, alpha=16)
    prompts = gpu_prompts(8)
    kw = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=16)
    with nbgen.Engine(gpu_model_dir, **kw) as eng:
        plain = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
    with nbgen.Engine(gpu_model_dir, lora_paths=[f"g0={ad}"], max_loras_per_batch=2, **kw) as eng:
        base = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, use_tqdm=False)
        with_ad = eng.generate(input_ids=prompts[:2], sampling_params=GREEDY_SP, lora_path=["g0", "g0"],
                               use_tqdm=False)
    for p, b in zip(plain, base):
        assert p["output_ids"] == b["output_ids"]
        assert p["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert [o["output_ids"] for o in with_ad] != [o["output_ids"] for o in plain[:2]]


def test_lora_tensors_listed_for_memory_release(tmp_path: Path) -> None:
    """Memory release offloads ``LoRAManager.tensors()`` with the weights: every loaded adapter's
    tensors and every slot pool tensor are in it."""
    ads = _adapters(tmp_path, _base(tmp_path))
    _loaded, mgr = _setup(tmp_path, slots=True)
    lid = mgr.load("a", ads["a"]).lora_id
    listed = {t.data_ptr() for t in mgr.tensors()}
    assert {sl.a.data_ptr() for sl in mgr.slots.linears.values()} <= listed
    assert {sl.b.data_ptr() for sl in mgr.slots.linears.values()} <= listed
    assert mgr.slots.scaling.data_ptr() in listed
    n_pool = 2 + 2 * len(mgr.slots.linears)
    assert len(mgr.tensors()) > n_pool                                  # the adapter's own tensors too
    mgr.unregister("a")
    assert mgr.release_if_unused(lid)
    assert len(mgr.tensors()) == n_pool


@pytest.mark.gpu
def test_gpu_lora_weight_update_refolds_and_memory_release(gpu_model_dir, tmp_path: Path) -> None:
    """bf16 CUDA (norms folded): ``update_weights_from_disk`` with new norm weights refolds the loaded
    adapters (outputs match an engine started on the new checkpoint); ``release_memory_occupation``
    offloads the adapters and the slot pool with the weights and ``resume`` restores them."""
    import shutil

    import nbgen
    import transformers as tf
    from tests.test_lora import make_adapter
    from tests.tiny_models import GREEDY_SP, assert_close_runs, gpu_prompts

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ad = make_adapter(gpu_model_dir, str(tmp_path / "g0"), seed=3, r=16, alpha=32)
    new_dir = tmp_path / "new"
    shutil.copytree(gpu_model_dir, new_dir)
    hf = tf.AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in hf.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.mul_(0.5 + torch.rand(norm.weight.shape, generator=g))
    hf.save_pretrained(new_dir)
    prompts, names = gpu_prompts(6), ["g0", None] * 3
    kw = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, lora_paths=[f"g0={ad}"], max_loras_per_batch=2)

    def run(eng) -> list:
        return eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, return_logprob=True, lora_path=names,
                            use_tqdm=False)
    with nbgen.Engine(gpu_model_dir, **kw) as eng:
        before = run(eng)
        ok, msg, _ = eng.update_weights_from_disk(str(new_dir))
        assert ok, msg
        updated = run(eng)
        eng.release_memory_occupation()
        eng.resume_memory_occupation()
        resumed = run(eng)
    with nbgen.Engine(str(new_dir), **kw) as eng:
        fresh = run(eng)
    assert [o["output_ids"] for o in updated] != [o["output_ids"] for o in before]
    assert_close_runs(updated, fresh)
    assert_close_runs(resumed, updated)


def test_host_cache_reload_reads_no_file(tmp_path: Path, monkeypatch) -> None:
    """An adapter released from the device goes to the host cache: loading it again (another name,
    same path) reads no file and gives the same logits; a rewritten adapter is read again; the cache
    keeps at most ``max_bytes``, least recently used out first."""
    ads = _adapters(tmp_path, _base(tmp_path))
    loaded, mgr = _setup(tmp_path, slots=False)
    first = mgr.load("a", ads["a"]).lora_id
    want = _forward(loaded, mgr, PROMPTS[:2], [first, None])
    mgr.unregister("a")
    assert mgr.release_if_unused(first) and len(mgr.host_cache) == 1

    def no_disk(*args, **kwargs):
        raise AssertionError("read from disk")
    real = lora_mod.load_adapter
    monkeypatch.setattr(lora_mod, "load_adapter", no_disk)
    again = mgr.load("a2", ads["a"]).lora_id
    torch.testing.assert_close(_forward(loaded, mgr, PROMPTS[:2], [again, None]), want, atol=0, rtol=0)
    assert mgr.host_cache.hits == 1
    with pytest.raises(AssertionError, match="read from disk"):
        mgr.load("b", ads["b"])                                         # never cached: from disk
    # rewritten on disk: a miss
    mgr.unregister("a2")
    assert mgr.release_if_unused(again)
    cfg_file = Path(ads["a"]) / "adapter_config.json"
    cfg_file.write_text(cfg_file.read_text() + " ")
    with pytest.raises(AssertionError, match="read from disk"):
        mgr.load("a3", ads["a"])
    # the bound: room for one adapter of "a"'s size only
    monkeypatch.setattr(lora_mod, "load_adapter", real)
    ids = [mgr.load(n, ads[n]).lora_id for n in ("a", "b")]
    for n, i in zip(("a", "b"), ids):
        mgr.unregister(n)
        assert mgr.release_if_unused(i)
    assert len(mgr.host_cache) == 2
    mgr.host_cache.max_bytes = mgr.host_cache.bytes - 1
    mgr.host_cache.put(mgr.host_cache.get(ads["b"], torch.device("cpu")))   # b used last: a goes
    assert len(mgr.host_cache) == 1 and mgr.host_cache.get(ads["a"], torch.device("cpu")) is None
