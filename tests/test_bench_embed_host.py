"""The embedding benches' host numbers: ``bench.embed_host`` (scheduler + prefix cache without a
model, a pool small enough to evict) and the per-step split ``bench.embed`` prints (CPU, tiny model)."""
from __future__ import annotations

from nbgen.bench.embed import main, make_texts
from nbgen.bench.embed_host import run_scheduler, time_inserts


def test_embed_host_bench_schedules_every_text_and_times_inserts() -> None:
    texts = make_texts(300, 16, 200)
    res = run_scheduler(texts, chunk=1024, num_pages=600, page_size=16, max_running=32)   # evicts
    assert res["steps"] >= sum(map(len, texts)) / 1024 and res["texts_per_step"] > 1
    assert res["schedule_ms_per_step"] > 0 and res["update_ms_per_step"] > 0
    assert time_inserts(4, 64, 16, rounds=2) > 0


def test_embed_bench_reports_host_and_wait_per_step(tiny_llama_dir) -> None:
    rows = main(["--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--num-texts", "12",
                 "--min-tokens", "8", "--max-tokens", "40", "--no-peer", "--chunked-prefill-size", "64"])
    st = rows[0]["steps"]
    assert st["steps"] >= rows[0]["in_tokens"] // 64
    assert st["wait_ms"] > 0 and st["host_ms"] > 0 and st["step_ms"] >= st["wait_ms"]
