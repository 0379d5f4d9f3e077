"""The benchmark's bounds (nbgen.bench.floor): decode floor bytes and prefill FLOPs by hand on a tiny model;
the embedding bench end to end on a tiny model (CPU)."""
from __future__ import annotations

import pytest
import torch

from nbgen.bench.floor import floor_seconds, linear_rate, matmul_rate, prefill_flops, roofline_seconds


def _tiny_llama():
    import transformers as tf

    from nbgen.models.llama import LlamaForCausalLM

    cfg = tf.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg), cfg


def test_prefill_flops_count_linears_head_and_causal_attention() -> None:
    model, cfg = _tiny_llama()
    # per layer: qkv 64 x (4 + 2 + 2) * 16, o 64 x 64, gate|up 64 x 256, down 128 x 64 = 36 864 weights
    linear = 2 * 36864
    # prompts of 3 and 5 tokens: every token through the linears, each prompt's last token through the
    # 100 x 64 LM head, causal q.K^T and P.V: 2 x 4 heads x 16 dims x n (n + 1) per layer
    want = 2 * linear * 8 + 2 * 6400 * 2 + 2 * 2 * 4 * 16 * (3 * 4 + 5 * 6)
    assert prefill_flops(model, cfg, [3, 5]) == want
    # embeddings pool the hidden states: no LM head
    assert prefill_flops(model, cfg, [3, 5], lm_head=False) == want - 2 * 6400 * 2


def test_embed_bench_runs_on_cpu_with_a_tiny_model(tiny_llama_dir) -> None:
    from nbgen.bench.embed import main, make_texts

    texts = make_texts(20, 8, 40, vocab_size=300)
    assert len(texts) == 20 and all(8 <= len(t) <= 40 and max(t) < 300 for t in texts)
    assert make_texts(20, 8, 40, vocab_size=300) == texts                     # seeded
    rows = main(["--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--num-texts", "20",
                 "--min-tokens", "8", "--max-tokens", "40", "--no-peer"])
    import json
    import os

    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    r = rows[0]
    assert r["engine"] == "nbgen" and r["in_tokens"] == sum(map(len, make_texts(20, 8, 40, vocab)))
    assert r["tok_s"] > 0 and r["bound_s"] > 0 and r["pct_bound"] > 0 and r["dim"] == 64
    assert r["shape_bound_s"] > 0 and r["pct_shape_bound"] == pytest.approx(100 * r["shape_bound_s"] / r["seconds"])


def test_floor_counts_each_decode_step_once() -> None:
    # one seq: 4 prompt tokens, 3 outputs -> 2 decode steps reading 5 and 6 KV tokens
    assert floor_seconds([4], [3], weight_bytes=100, kv_bytes=10, bw=1000.0) == (2 * 100 + 11 * 10) / 1000.0
    # a second seq with 1 output adds no step and no KV
    assert floor_seconds([4, 9], [3, 1], 100, 10, 1000.0) == floor_seconds([4], [3], 100, 10, 1000.0)


def test_matmul_rate_is_a_plausible_cpu_rate() -> None:
    rate = matmul_rate(torch.device("cpu"))
    assert 1e8 < rate < 1e14


def test_linear_rate_times_one_layers_weight_shapes(tiny_llama_dir) -> None:
    from nbgen.bench.embed import meta_model

    model, _ = meta_model(tiny_llama_dir)
    assert 1e7 < linear_rate(model, 64, torch.device("cpu")) < 1e14


def test_text_workload_decodes_each_prompts_ids() -> None:
    from transformers import AutoTokenizer

    from nbgen.bench.workloads import make_workload, text_prompts
    from nbgen.models.embedded import default_model_path

    ids, _ = make_workload("bs1")
    texts = text_prompts(ids, None)
    tok = AutoTokenizer.from_pretrained(default_model_path())
    assert len(texts) == 1 and isinstance(texts[0], str)
    assert texts[0] == tok.decode([t % len(tok) for t in ids[0]], skip_special_tokens=True)
    assert 0.5 * len(ids[0]) < len(tok(texts[0])["input_ids"]) < 2 * len(ids[0])   # re-tokenized: about as long


def test_shared_floor_counts_each_prefix_once_per_step():
    """W-prefix: 8 groups of 32 prompts sharing 2,000 tokens; the shared floor reads a group's prefix
    once per step while any of its seqs decodes, and equals the naive floor without sharing."""
    from nbgen.bench.floor import floor_seconds, shared_floor_seconds
    from nbgen.bench.workloads import PREFIX_LEN, prefix_workload

    prompts, outs, groups = prefix_workload()
    ins = [len(p) for p in prompts]
    assert len(prompts) == 256 and sorted(set(groups)) == list(range(8))
    assert all(p[:PREFIX_LEN] == prompts[groups.index(g)][:PREFIX_LEN] for p, g in zip(prompts, groups))
    assert shared_floor_seconds(0, groups, ins, outs, 10, 3, 1.0) == floor_seconds(ins, outs, 10, 3, 1.0)
    assert shared_floor_seconds(5, [0, 1], [7, 9], [5, 5], 0, 1, 1.0) == floor_seconds([7, 9], [5, 5], 0, 1, 1.0)
    assert shared_floor_seconds(5, [0, 0], [7, 9], [5, 5], 0, 1, 1.0) == floor_seconds([7, 9], [5, 5], 0, 1, 1.0) - 5 * 4


def test_roofline_takes_the_longer_of_weight_read_and_gemm_work_per_step() -> None:
    ins, outs = [10, 20, 30], [3, 5, 2]            # decode steps 1..4; live rows 3, 2, 1, 1
    wb, kvb, bw = 1000, 10, 100.0
    # compute free: exactly the floor
    assert roofline_seconds(ins, outs, wb, kvb, bw, row_flops=1.0, rate=1e30) == \
        pytest.approx(floor_seconds(ins, outs, wb, kvb, bw))
    # a row's GEMMs take 4 s, the weight read 10 s: steps of 3 rows (12 s) are compute-bound
    kv_only = floor_seconds(ins, outs, 0, kvb, bw)
    assert roofline_seconds(ins, outs, wb, kvb, bw, row_flops=4.0, rate=1.0) == \
        pytest.approx(12 + 10 + 10 + 10 + kv_only)
    # two replicas split the rows (and the KV): every step's 1.5 rows or fewer take at most 6 s
    assert roofline_seconds(ins, outs, wb, kvb, bw, row_flops=4.0, rate=1.0, replicas=2) == \
        pytest.approx(4 * 10 + floor_seconds(ins, outs, 0, kvb, 2 * bw))


def test_cpu_quality_bench_compares_the_quantized_modes_with_fp32() -> None:
    """The quantized CPU arithmetic (4-bit GEMV, int8 head at steps of <= 4 rows) follows the fp32
    dequantized model closely; fp32 against itself agrees exactly."""
    from nbgen.bench.cpu_quality import run

    rows = {r["mode"]: r for r in run(answer_tokens=8, text_tokens=96, num_prompts=3)}
    assert rows["fp32"]["top1_agreement"] == 1.0 and rows["fp32"]["ppl_change"] == 0.0
    for mode in ("bf16", "quantized"):
        assert rows[mode]["positions"] == 3 * 8
        assert rows[mode]["top1_agreement"] >= 0.75, rows[mode]
        assert abs(rows[mode]["ppl_change"]) < 0.05, rows[mode]


def test_bench_stream_mode_returns_what_generate_returns(tiny_engine) -> None:
    """``--stream``: every prompt its own stream=True request, all at once; the joined chunks' text and
    the last chunk's output equal a plain batch generate's (greedy)."""
    from nbgen.bench.run import _stream_all

    prompts = [[1, 5, 9, 2], [3, 3], [7, 8, 9, 10, 11, 12]]
    sps = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in (5, 9, 3)]
    got = _stream_all(tiny_engine, prompts, sps)
    ref = tiny_engine.generate(input_ids=prompts, sampling_params=sps)
    assert [g["text"] for g in got] == [r["text"] for r in ref]
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
    assert [g["meta_info"]["completion_tokens"] for g in got] == [5, 9, 3]


def test_bench_phases_report_each_runs_loop_steps(capsys) -> None:
    """``--phases``: each timed run prints its loop steps (at least one a new token of the 64) with the
    device wait and host time a step adding up to the step's time, and the host time by phase."""
    import re

    from nbgen.bench.run import main

    main(["--device", "cpu", "--phases", "--repeat", "2"])
    out = capsys.readouterr().out
    steps = re.findall(r"^run (\d): [\d.]+ s, (\d+) steps: ([\d.]+) ms/step, device wait ([\d.]+), host ([\d.]+)$",
                       out, re.M)
    assert [s[0] for s in steps] == ["1", "2"]
    for _, n, step, wait, host in steps:
        assert int(n) >= 64
        assert abs(float(step) - float(wait) - float(host)) < 0.02
        assert float(wait) > 0          # a CPU step's forward is its device work
    phases = re.findall(r"^run \d: phases ms/step: (.*)$", out, re.M)
    assert len(phases) == 2 and all("forward" in p and "schedule" in p for p in phases)
