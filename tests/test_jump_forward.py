"""Jump-forward decoding (runtime/jump_forward.py) on the embedded SmolLM2 model, CPU, greedy.

Where the forced text has one tokenization only (runs of '-' and digits: this tokenizer has no
multi-digit or '-digit' tokens), outputs must equal token-by-token constrained decoding, with the
plain loop and under the overlap stepper (whose staged step the jump makes stale). JSON outputs
must validate; jumps must be cut at max_new_tokens. The engine tests are ``slow`` (as
tests/test_grammar.py); the scheduler and schema-check tests are not."""
from __future__ import annotations

import json
import os

import pytest

from nbgen.bench.schema_check import schema_errors
from nbgen.core.batch import ScheduledBatch, SeqWork, StepOutput
from nbgen.core.scheduler_config import SchedulerConfig
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.runtime.scheduler import Scheduler
from tests.tiny_models import grammar_engine

pytest.importorskip("xgrammar")

# forced runs ("-12345-", ...) between free single-digit choices
DIGITS = r"[1-3]-12345-[4-6]-67890-[7-9]-13579-[1-9]{2,4}"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"type": "string", "enum": ["red", "green", "blue"]}}}}


DEVICE = os.environ.get("NBGEN_TEST_DEVICE", "cpu")
DUMMY_MODEL = os.environ.get("NBGEN_TEST_GRAMMAR_MODEL")   # the GPU host: dummy weights, SmolLM2's tokenizer
# each GPU engine's KV pool (Qwen3-0.6B in fp32: ~15 GB); a fraction of the card would leave the module's second
# engine nothing where the first holds that fraction already
KV_TOKENS = 65536


@pytest.fixture(scope="module")
def eng():
    kw = {"device": DEVICE, "enable_jump_forward": True}
    if DEVICE != "cpu":
        # fp32: a chunk and a decode of the same tokens agree to the last bits only roughly in bf16;
        # a fixed pool (not a fraction of the card), so eng32 beside it gets one too
        kw.update(max_total_tokens=KV_TOKENS, dtype="float32")
    e = grammar_engine(**kw)
    yield e
    e.shutdown()


def _prompts(eng, what: str, n: int) -> list[str]:
    return [eng.apply_chat_template([{"role": "user", "content": f"{what} (example {i})"}]) for i in range(n)]


def _service(eng):
    eng.generate("x", {"max_new_tokens": 1, "regex": "[ab]"})   # makes the grammar service
    return eng.loop.delivery.grammar


def _run_modes(eng, prompts, sps):
    """(token by token, jump-forward with the plain loop, jump-forward under the overlap stepper)
    outputs, and the jumps made by the last two."""
    from nbgen.runtime.overlap import OverlapStepper

    loop, service = eng.loop, _service(eng)
    jumper, default = service.jumper, loop._overlap
    try:
        loop.call(lambda: setattr(service, "jumper", None))
        plain = eng.generate(prompts, sps, use_tqdm=False)
        loop.call(lambda: setattr(service, "jumper", jumper))
        n0 = jumper.num_jumps
        jumped = eng.generate(prompts, sps, use_tqdm=False)
        n1 = jumper.num_jumps
        loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
        over = eng.generate(prompts, sps, use_tqdm=False)
        n2 = jumper.num_jumps
    finally:
        loop.call(lambda: setattr(loop, "_overlap", default))
        loop.call(lambda: setattr(service, "jumper", jumper))
    return plain, jumped, over, (n1 - n0, n2 - n1)


@pytest.mark.slow
def test_jump_forward_equals_token_by_token_where_tokenization_is_unique(eng):
    prompts = _prompts(eng, "Write a code like 2-12345-5", 6) + ["The capital of France is"]
    sps = [{"temperature": 0.0, "max_new_tokens": 40, "regex": DIGITS}] * 6 + [{"temperature": 0.0,
                                                                                "max_new_tokens": 12}]
    plain, jumped, over, (j1, j2) = _run_modes(eng, prompts, sps)
    assert j1 >= 6 * 3 and j2 >= 6 * 3, (j1, j2)     # each request jumps its three forced runs
    ids = [o["output_ids"] for o in plain]
    assert [o["output_ids"] for o in jumped] == ids
    assert [o["output_ids"] for o in over] == ids
    for o in plain[:6]:
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
        assert o["text"][1:8] == "-12345-"


@pytest.fixture(scope="module")
def eng32():
    """The engine in fp32: forced rows run the decode attention kernel and a chunk the prefill one, which
    agree to the last bits only roughly in bf16 (a near-tie can then flip a greedy token)."""
    kw = {"device": DEVICE, "enable_jump_forward": True, "dtype": "float32"}
    if DEVICE != "cpu":
        kw["max_total_tokens"] = KV_TOKENS
    e = grammar_engine(**kw)
    yield e
    e.shutdown()


@pytest.mark.slow
def test_forced_rows_and_chunks_give_the_same_outputs(eng32):
    """Forced tokens as one-token rows of a decode step (runtime/forced_rows.py) compute what one
    chunk does: outputs equal with the rows on and off, and the rows were used."""
    eng = eng32
    prompts = _prompts(eng, "Write a code like 2-12345-5", 4)
    sp = {"temperature": 0.0, "max_new_tokens": 40, "regex": DIGITS}
    loop, sched = eng.loop, eng.loop.scheduler
    rows, seen = sched.cfg.forced_token_rows, []
    assert rows > 0
    schedule = sched.schedule

    def counting():
        b = schedule()
        if b is not None:
            seen.append(sum(not s.sample and s.start_pos >= len(s.req.prompt_ids) for s in b.seqs))
        return b
    _service(eng)
    try:
        loop.call(lambda: setattr(sched, "schedule", counting))
        with_rows = eng.generate(prompts, sp, use_tqdm=False)
        used = sum(seen)
        loop.call(lambda: setattr(sched.cfg, "forced_token_rows", 0))
        seen.clear()
        chunks = eng.generate(prompts, sp, use_tqdm=False)
    finally:
        loop.call(lambda: setattr(sched.cfg, "forced_token_rows", rows))
        loop.call(lambda: setattr(sched, "schedule", schedule))
    assert used >= 4 * 3 * 5 and sum(seen) == 0, (used, seen)   # 3 forced runs of >= 5 tokens each
    assert [o["output_ids"] for o in with_rows] == [o["output_ids"] for o in chunks]


@pytest.mark.slow
def test_jump_forward_json_outputs_validate(eng):
    prompts = _prompts(eng, "Give me a JSON record of a person", 8)
    sp = {"temperature": 0.0, "max_new_tokens": 96, "json_schema": json.dumps(PERSON)}
    plain, jumped, over, (j1, j2) = _run_modes(eng, prompts, sp)
    assert j1 > 0 and j2 > 0
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in jumped]
    done = [o for o in jumped if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert len(done) >= (1 if DUMMY_MODEL else 6), [o["meta_info"]["finish_reason"] for o in jumped]
    for o in done:
        assert not schema_errors(json.loads(o["text"]), PERSON), o["text"]
    # jumped outputs are still what the grammar accepts token by token
    import xgrammar as xgr

    tok = eng.tokenizer
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))) \
        .compile_json_schema(json.dumps(PERSON), any_whitespace=False)
    for o in jumped:
        m = xgr.GrammarMatcher(compiled)
        assert all(m.accept_token(t) for t in o["output_ids"])


@pytest.mark.slow
def test_jump_forward_stops_at_max_new_tokens(eng):
    _service(eng)
    sp = {"temperature": 0.0, "max_new_tokens": 6, "regex": r"[1-3]-1234567890123-[4-6]"}
    out = eng.generate(_prompts(eng, "A code", 1)[0], sp)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["output_ids"]) == 6
    assert out["text"][1:] == "-1234"


def test_update_ignores_a_step_scheduled_before_a_jump():
    """A decode scheduled for a request that then jumped forward no longer reaches the end of its
    tokens: the scheduler's update skips it (its sampled id must not be appended)."""
    sched = Scheduler(SchedulerConfig(num_pages=16, page_size=4))
    req = Request("r", [1, 2, 3], SamplingParams(max_new_tokens=20))
    sched.add(req)
    batch = sched.schedule()
    sched.update(batch, StepOutput([7], [None], [None]))           # prefill: samples 7
    nxt = sched.schedule()                                           # decode of 7, scheduled
    assert nxt is not None and nxt.seqs[0].token_ids == [7]
    req.output_ids.extend([8, 9])                                    # a jump appends forced tokens
    assert sched.update(nxt, StepOutput([5], [None], [None])) == []
    assert req.output_ids == [7, 8, 9] and req.num_computed == 3
    chunk = sched.schedule()                                         # the forced tokens as one chunk
    assert [(s.token_ids, s.start_pos, s.sample) for s in chunk.seqs] == [([7, 8, 9], 3, True)]
    assert isinstance(chunk, ScheduledBatch) and isinstance(chunk.seqs[0], SeqWork)


def test_schema_check_finds_violations():
    from nbgen.bench.grammar_extract import SCHEMA

    good = {"name": "A", "age": 3, "address": {"city": "x", "country": "y"},
            "job": {"employer": "e", "role": "nurse", "since": 2000}, "skills": ["a"], "status": "active",
            "rating": 4.5}
    assert schema_errors(good, SCHEMA) == []
    bad = {**good, "age": 3.5, "status": "busy", "extra": 1, "job": {"employer": "e", "role": "nurse"},
           "skills": ["a", "b", "c", "d", "e"], "rating": 7}
    errs = schema_errors(bad, SCHEMA)
    for frag in ("$.age", "$.status", "unexpected 'extra'", "missing 'since'", "5 items", "$.rating"):
        assert any(frag in e for e in errs), (frag, errs)
    with pytest.raises(ValueError):
        schema_errors({}, {"type": "object", "patternProperties": {}})


def test_jump_forward_with_speculation_is_refused():
    from nbgen.core.config import EngineConfig
    with pytest.raises(ValueError, match="enable_jump_forward"):
        EngineConfig(enable_jump_forward=True, speculative_algorithm="NGRAM")


def test_tail_tokenizes_each_boundary_once():
    """tail() caches (last token, forced text) -> tokenization: a batch's requests share JSON keys."""
    from nbgen.runtime.jump_forward import JumpForward

    class CharTok:   # one token per character; counts its calls
        calls = 0

        def encode(self, text, add_special_tokens=False):
            CharTok.calls += 1
            return [ord(c) for c in text]

        def decode(self, ids, clean_up_tokenization_spaces=False):
            CharTok.calls += 1
            return "".join(chr(i) for i in ids)

    jf = JumpForward(CharTok())
    first = jf.tail(ord('"'), ', "b": ')
    assert first == (False, [ord(c) for c in ', "b": '])
    n = CharTok.calls
    first[1].clear()                                    # a caller's list is its own
    assert jf.tail(ord('"'), ', "b": ') == (False, [ord(c) for c in ', "b": '])
    assert CharTok.calls == n
    assert jf.tail(ord("x"), ', "b": ')[1][0] == ord(",")   # another boundary: tokenized again
    assert CharTok.calls > n


def _jumped_scheduler(rows: int):
    """A scheduler (forced_token_rows=rows) whose request sampled 7, then jumped forward by 8, 9."""
    sched = Scheduler(SchedulerConfig(num_pages=16, page_size=4, forced_token_rows=rows))
    req = Request("r", [1, 2, 3], SamplingParams(max_new_tokens=20))
    sched.add(req)
    sched.update(sched.schedule(), StepOutput([7], [None], [None]))  # prefill: samples 7
    req.output_ids.extend([8, 9])                                    # the jump's forced tokens
    return sched, req


def test_forced_tokens_run_as_one_token_rows():
    """With forced_token_rows, the tokens a jump left without KV are one-token rows (a decode-only
    step, runtime/forced_rows.py); only the last samples, and update walks them in order."""
    sched, req = _jumped_scheduler(8)
    batch = sched.schedule()
    assert batch.is_decode_only
    assert [(s.token_ids, s.start_pos, s.sample) for s in batch.seqs] == [([7], 3, False), ([8], 4, False),
                                                                          ([9], 5, True)]
    assert all(s.pages is req.pages for s in batch.seqs)
    n = len(batch.seqs)
    assert sched.update(batch, StepOutput([-1, -1, 11], [None] * n, [None] * n)) == [req]
    assert req.output_ids == [7, 8, 9, 11] and req.num_computed == 6
    nxt = sched.schedule()
    assert [(s.token_ids, s.start_pos, s.sample) for s in nxt.seqs] == [([11], 6, True)]


def _two_jumped(rows: int):
    """A scheduler (forced_token_rows=rows) with a request "a" holding 2 tokens without KV (its sampled
    7 and a forced 8) and "b" holding 3 (7, 8, 9)."""
    sched = Scheduler(SchedulerConfig(num_pages=32, page_size=4, forced_token_rows=rows))
    a = Request("a", [1, 2, 3], SamplingParams(max_new_tokens=20))
    b = Request("b", [4, 5, 6], SamplingParams(max_new_tokens=20))
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), StepOutput([7, 7], [None] * 2, [None] * 2))   # both prefills sample 7
    a.output_ids.append(8)
    b.output_ids.extend([8, 9])
    return sched, a, b


def test_forced_tokens_wait_one_step_for_rows():
    """Forced tokens that do not fit beside the step's other rows wait one step (the step stays
    decode-only, runtime/forced_rows.RowWaits), then run as rows; a request that waited at the
    previous schedule runs as a chunk rather than wait again."""
    sched, a, b = _two_jumped(4)
    batch = sched.schedule()                       # a takes 2 rows, b's 3 do not fit the other 2
    assert batch.is_decode_only and {s.req.rid for s in batch.seqs} == {"a"}
    sched.update(batch, StepOutput([-1, 11], [None] * 2, [None] * 2))
    batch = sched.schedule()                       # a decodes (1 row), b's 3 rows fit now
    assert batch.is_decode_only
    assert [(s.req.rid, s.token_ids, s.sample) for s in batch.seqs] == [
        ("a", [11], True), ("b", [7], False), ("b", [8], False), ("b", [9], True)]
    sched, a, b = _two_jumped(4)
    sched.schedule()                               # b waits (this batch is dropped, as overlap may)
    batch = sched.schedule()                       # b waited already: a chunk beside a's rows
    assert [(s.req.rid, s.token_ids) for s in batch.seqs] == [("a", [7]), ("a", [8]), ("b", [7, 8, 9])]


def test_forced_tokens_beyond_the_row_cap_run_as_a_chunk():
    sched, _req = _jumped_scheduler(2)           # 3 rows do not fit
    batch = sched.schedule()
    assert [(s.token_ids, s.start_pos, s.sample) for s in batch.seqs] == [([7, 8, 9], 3, True)]
    with pytest.raises(ValueError, match="forced_token_rows"):
        SchedulerConfig(forced_token_rows=-1)


def test_forced_token_rows_follow_the_config():
    from nbgen.core.config import EngineConfig
    from nbgen.runtime.forced_rows import forced_token_rows

    cpu = EngineConfig(enable_jump_forward=True).resolved("cpu")
    assert forced_token_rows(cpu) == 4 * cpu.max_running_requests
    assert forced_token_rows(EngineConfig().resolved("cpu")) == 0
    gpu = EngineConfig(enable_jump_forward=True).resolved("cuda", 80 << 30)
    assert gpu.cuda_graph_max_bs == 768 and forced_token_rows(gpu) == 768
    assert EngineConfig().resolved("cuda", 80 << 30).cuda_graph_max_bs == 256


@pytest.mark.slow
def test_grammar_replay_counts_its_steps(tmp_path, monkeypatch, capsys):
    """bench.grammar_replay on 8 requests: every output valid both ways, every constrained step on the
    masked argmax, forced rows only with jump-forward, and (cap 4) some forced tokens as chunks."""
    import sys

    from nbgen.bench import grammar_replay

    out = tmp_path / "replay.json"
    tok = os.environ.get("NBGEN_TEST_GRAMMAR_TOKENIZER")     # the GPU host has no embedded model to read it from
    monkeypatch.setattr(sys, "argv", ["grammar_replay", "--num", "8", "--forced-rows", "4", "--json", str(out)]
                        + (["--tokenizer", tok] if tok else []))
    grammar_replay.main()
    tbt, jf = json.loads(out.read_text())["runs"]
    assert tbt["valid"] == jf["valid"] == 8
    assert tbt["masked"] == tbt["fills"] > 0 and jf["masked"] == jf["fills"] > 0
    assert tbt["forced_rows"] == 0 and jf["forced_rows"] > 0 and jf["chunked"] > 0
    assert jf["steps"] < tbt["steps"]
    assert "jump_forward" in capsys.readouterr().out
