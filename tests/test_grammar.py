"""Structured output (xgrammar json_schema / regex / ebnf), stop_regex, hidden states, custom logit
processors — on the embedded SmolLM2 model, sampled at temperature 1.0.

Device: NBGEN_TEST_DEVICE (default cpu). NBGEN_TEST_GRAMMAR_MODEL (a config dir, dummy weights) with
NBGEN_TEST_GRAMMAR_TOKENIZER replaces the embedded model where it cannot be fetched (the GPU host):
random weights complete fewer grammars, so there only the outputs that do complete are checked."""
from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
import torch

import nbgen
from nbgen.core.logit_processor import CustomLogitProcessor
from nbgen.runtime.stop_regex import StopRegexMatcher
from tests.tiny_models import grammar_engine

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"type": "string", "enum": ["red", "green", "blue"]}}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "big"],
        "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                       "big": {"type": "boolean"}}}
REGEXES = [r"\d{3}-\d{3}-\d{4}", r"(Mon|Tues|Wednes|Thurs|Fri)day", r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)",
           r"#[0-9a-f]{6}"]
# not regular: parentheses nest
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-" | "*") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""


def parse_expr(s: str) -> bool:
    """Recogniser of EBNF above (recursive descent); True when s is one complete expr."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        m = re.compile(r"[1-9][0-9]{0,2}").match(s, pos)
        if not m:
            return False
        pos = m.end()
        return True

    def term() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        return num()

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        for _ in range(3):
            if pos < len(s) and s[pos] in "+-*":
                pos += 1
                if not term():
                    return False
            else:
                break
        return True

    return expr() and pos == len(s)


DEVICE = os.environ.get("NBGEN_TEST_DEVICE", "cpu")
DUMMY_MODEL = os.environ.get("NBGEN_TEST_GRAMMAR_MODEL")


@pytest.fixture(scope="module")
def eng():
    kw = {"device": DEVICE, "enable_custom_logit_processor": True, "enable_return_hidden_states": True}
    mp = pytest.MonkeyPatch()
    if DEVICE != "cpu":
        kw["mem_fraction_static"] = 0.4   # leave room for conftest's tiny_engine beside it
        # neither the streaming matmul (<= 16 rows, else cuBLAS) nor nbgen's decode attention (its split
        # count follows the batch size): a row's last bits then depend on the batch size, and
        # overlap scheduling keeps finished requests one step longer (and a mixed batch is larger than
        # its free requests alone), so greedy near-ties of the random model flipped between the runs
        # compared below
        from nbgen.kernels import triton_decode
        from nbgen.kernels import small_gemm
        mp.setattr(small_gemm, "MAX_ROWS", 0)
        mp.setattr(triton_decode, "supported", lambda head_dim: False)
    e = grammar_engine(**kw)
    yield e
    e.shutdown()
    mp.undo()


def _prompts(eng, what: str, n: int = 24) -> list[str]:
    return [eng.apply_chat_template([{"role": "user", "content": f"{what} (example {i})"}]) for i in range(n)]


def _complete(outs: list[dict]) -> list[dict]:
    done = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    # a trained model completes nearly all; random weights must still complete some to check them
    assert len(done) >= (1 if DUMMY_MODEL else 0.9 * len(outs)), [o["meta_info"]["finish_reason"] for o in outs]
    return done


def test_json_schema_outputs_validate(eng):
    schemas = [PERSON, CITY] * 12
    prompts = _prompts(eng, "Give me a JSON record")
    outs = eng.generate(prompts, [{"temperature": 1.0, "max_new_tokens": 80, "json_schema": json.dumps(s)}
                                  for s in schemas], use_tqdm=False)
    for o, s in zip(outs, schemas):
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(o["text"]), s)
    _complete(outs)


def test_regex_outputs_fullmatch(eng):
    prompts = _prompts(eng, "Write a phone number, weekday, email or colour")
    outs = eng.generate(prompts, [{"temperature": 1.0, "max_new_tokens": 40, "regex": REGEXES[i % 4]}
                                  for i in range(24)], use_tqdm=False)
    for i, o in enumerate(outs):
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(REGEXES[i % 4], o["text"]), (REGEXES[i % 4], o["text"])
    _complete(outs)


def test_ebnf_outputs_parse(eng):
    outs = eng.generate(_prompts(eng, "Write an arithmetic expression"),
                        {"temperature": 1.0, "max_new_tokens": 48, "ebnf": EBNF}, use_tqdm=False)
    for o in _complete(outs):
        assert parse_expr(o["text"]), o["text"]
    assert parse_expr("(1+2)*3") and not parse_expr("(1+2") and not parse_expr("1+")


def test_mixed_batch_free_requests_unchanged(eng):
    free = ["The capital of France is", "List three fruits:", "def fibonacci(n):"]
    sp_free = {"temperature": 0.0, "max_new_tokens": 16}
    alone = [o["text"] for o in eng.generate(free, sp_free, use_tqdm=False)]
    constrained = _prompts(eng, "Give me a JSON record", 4)
    mixed = eng.generate(constrained[:2] + free + constrained[2:],
                         [{"temperature": 1.0, "max_new_tokens": 40, "json_schema": json.dumps(CITY)}] * 2
                         + [sp_free] * 3 + [{"temperature": 1.0, "max_new_tokens": 30, "regex": REGEXES[0]}] * 2,
                         use_tqdm=False)
    assert [o["text"] for o in mixed[2:5]] == alone


@pytest.mark.parametrize("sp", [{"json_schema": "{not json"}, {"json_schema": '{"type": "nonsense"}'},
                                {"regex": "(ab"}, {"ebnf": 'root ::= "a" | '}, {"ebnf": "root ::= undefined_rule"},
                                {"regex": "a", "ebnf": 'root ::= "a"'}, {"stop_regex": "(x"}, {"stop_regex": "a*"}])
def test_invalid_grammar_raises_before_running(eng, sp):
    before = eng.stats()["total_finished"]
    with pytest.raises(ValueError):
        eng.generate(["ok", "also ok"], [{"max_new_tokens": 4}, sp], use_tqdm=False)
    assert eng.stats()["total_finished"] == before   # nothing ran, not even the valid prompt


def test_stop_regex_trims_and_streams(eng):
    if DUMMY_MODEL:
        pytest.skip("needs a trained model (it counts to 7); stop_regex runs on the host on any device")
    sp = {"temperature": 0.0, "max_new_tokens": 40, "stop_regex": r"\b7\b"}
    out = eng.generate("Count: 1, 2, 3,", sp)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\b7\b"}
    assert out["text"].rstrip().endswith("6,") and "7" not in out["text"]
    kept = eng.generate("Count: 1, 2, 3,", {**sp, "no_stop_trim": True})
    assert kept["text"] == out["text"] + "7"
    chunks = list(eng.generate("Count: 1, 2, 3,", sp, stream=True))
    assert "".join(c["text"] for c in chunks) == out["text"]


def test_stop_regex_matcher_holds_back_partial_matches():
    m = StopRegexMatcher([r"\d{3}"], ["END"])
    assert m.feed("ab 1") == ("ab ", None)          # "1" may start a match: held
    assert m.feed("2x E") == ("12x ", None)         # "12x" cannot; "E" may start "END"
    assert m.feed("N") == ("", None)
    assert m.feed("D tail") == ("", "END")
    m = StopRegexMatcher([r"foo\w+bar"])
    assert m.feed("a fo") == ("a ", None) and m.feed("oxx") == ("", None) and m.flush() == "fooxx"


def test_hidden_states_give_each_greedy_token(eng):
    out = eng.generate("The capital of France is", {"temperature": 0.0, "max_new_tokens": 6},
                       return_hidden_states=True)
    hs = out["meta_info"]["hidden_states"]          # SGLang's: [0] the prompt's states, then one per token
    assert len(hs) == out["meta_info"]["completion_tokens"] == 6
    assert len(hs[0]) == out["meta_info"]["prompt_tokens"]
    assert all(len(h) == eng.hf_config.hidden_size for h in hs[0] + hs[1:])
    producing = [hs[0][-1]] + hs[1:]                 # the state of the position that produced each token
    model = eng.loop.runner.model   # read-only use: the state through lm_head gives the greedy token
    with torch.inference_mode():
        logits = model.compute_logits(torch.tensor(producing, dtype=eng.dtype,
                                                   device=eng.loop.runner.device)).float()
    picked = logits.gather(1, torch.tensor(out["output_ids"], device=logits.device).view(-1, 1)).view(-1)
    # the same kernels on CPU: exact; on a GPU another batch size may round the top logits differently
    tol = 0.0 if DEVICE == "cpu" else 0.05
    assert (logits.max(-1).values - picked <= tol).all(), (logits.argmax(-1).tolist(), out["output_ids"])
    assert "hidden_states" not in eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]


class ForceToken(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        p = custom_param_list[0]
        if p.get("boom"):
            raise RuntimeError("boom")
        out = torch.full_like(logits, float("-inf"))
        out[:, p["token_id"]] = 0.0
        return out


def test_custom_logit_processor_refused_without_flag(tiny_engine):
    with pytest.raises(ValueError, match="enable_custom_logit_processor"):
        tiny_engine.generate("hi", {"max_new_tokens": 2, "custom_params": {"token_id": 5}},
                             custom_logit_processor=ForceToken.to_str())


def test_custom_logit_processor_applied_and_failure_isolated(eng):
    tok = eng.tokenizer.encode(" banana")[-1]
    proc = ForceToken.to_str()
    outs = eng.generate(["a", "b", "c"], [{"temperature": 1.0, "max_new_tokens": 5, "custom_params": {"token_id": tok}},
                                          {"temperature": 1.0, "max_new_tokens": 5, "custom_params": {"boom": True}},
                                          {"temperature": 0.0, "max_new_tokens": 5}],
                        custom_logit_processor=[proc, proc, None], use_tqdm=False)
    assert outs[0]["output_ids"] == [tok] * 5
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "boom" in outs[1]["meta_info"]["finish_reason"]["message"]
    assert outs[2]["meta_info"]["finish_reason"]["type"] == "length"
    assert outs[2]["text"] == eng.generate("c", {"temperature": 0.0, "max_new_tokens": 5})["text"]


def test_grammar_compilation_does_not_block_other_requests(eng, monkeypatch):
    """A grammar whose compilation is held (until the free request is done) must not stall the loop."""
    from nbgen.runtime.grammar import GrammarService

    release, started, waited = threading.Event(), threading.Event(), {}
    original = GrammarService._compile

    def slow_compile(self, key):
        started.set()
        waited["released"] = release.wait(timeout=30)   # False: the free request never finished
        return original(self, key)

    monkeypatch.setattr(GrammarService, "_compile", slow_compile)
    schema = json.dumps({**CITY, "title": f"unique-{time.time()}"})  # not compiled before
    it = eng.generate_iter(["Give me a city as JSON", "Tell me a story"],
                           [{"temperature": 1.0, "max_new_tokens": 40, "json_schema": schema},
                            {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}])
    first, out = next(it)
    assert first == 1 and out["meta_info"]["completion_tokens"] == 8
    assert started.is_set() and "released" not in waited     # compiling while the free one ran
    assert eng.stats()["waiting"] == 1                        # held until its grammar is ready
    release.set()
    second, out = next(it)
    assert second == 0 and waited["released"]
    jsonschema.validate(json.loads(out["text"]), CITY)


def test_grammar_with_overlap_scheduling_same_outputs(eng):
    """The overlap stepper (forced on for CPU; GPU default) resolves each step before the next
    bitmask: seeded constrained outputs equal the plain loop's, beside free requests."""
    from nbgen.runtime.overlap import OverlapStepper

    prompts = _prompts(eng, "Give me a JSON record", 6) + ["The capital of France is", "List three fruits:"]
    sps = [{"temperature": 1.0, "max_new_tokens": 48, "sampling_seed": i, "json_schema": json.dumps(PERSON)}
           for i in range(3)] + [{"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": i,
                                  "regex": REGEXES[i % 4]} for i in range(3)] + [{"temperature": 0.0, "max_new_tokens": 16}] * 2
    loop = eng.loop
    default = loop._overlap                 # None on CPU, a stepper on CUDA
    loop.call(lambda: setattr(loop, "_overlap", None))
    try:
        plain = eng.generate(prompts, sps, use_tqdm=False)
        loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
        over = eng.generate(prompts, sps, use_tqdm=False)
    finally:
        loop.call(lambda: setattr(loop, "_overlap", default))
    assert [o["text"] for o in over] == [o["text"] for o in plain]
    assert [o["meta_info"]["finish_reason"] for o in over] == [o["meta_info"]["finish_reason"] for o in plain]
    for o in over[:3]:
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(o["text"]), PERSON)


def _forced_overlap(eng, fn):
    """fn() once with the plain loop and once under the overlap stepper (forced on for CPU), each from an
    empty prefix cache: a prompt prefilled from cached pages may round differently from one computed
    whole, which can move a sampled token."""
    from nbgen.runtime.overlap import OverlapStepper

    loop = eng.loop
    default = loop._overlap
    loop.call(lambda: setattr(loop, "_overlap", None))
    try:
        assert eng.flush_cache()
        plain = fn()
        loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
        assert eng.flush_cache()
        over = fn()
    finally:
        loop.call(lambda: setattr(loop, "_overlap", default))
    return plain, over


def test_grammar_pipeline_with_fill_worker_same_outputs(eng):
    """>= BATCH_FILL_MIN constrained rows: under overlap the bitmask is filled in the worker
    thread while the loop delivers and schedules, the next step's fill queued behind the step's
    accepts in the worker (rows completing their grammar left out); outputs equal the plain loop's."""
    from nbgen.runtime.constraints import BATCH_FILL_MIN

    n = BATCH_FILL_MIN + 8
    prompts = _prompts(eng, "Give me a JSON record", n) + ["The capital of France is"]
    sps = [{"temperature": 1.0, "max_new_tokens": 20 + i % 7, "sampling_seed": i,
            **({"json_schema": json.dumps(PERSON)} if i % 2 else {"regex": REGEXES[i % 4]})} for i in range(n)]
    sps.append({"temperature": 0.0, "max_new_tokens": 16})
    jobs = []
    constraints = eng.loop.runner.sampler.constraints
    original = constraints.fill_async

    queued = []

    def spy(seqs, *a, **k):
        job = original(seqs, *a, **k)
        jobs.append(job is not None and job.future is not None)
        if k.get("queued") and job is not None:
            queued.append(len(job.rows) < len(seqs))     # a completing row left out
        return job

    constraints.fill_async = spy
    try:
        plain, over = _forced_overlap(eng, lambda: eng.generate(prompts, sps, use_tqdm=False))
    finally:
        del constraints.fill_async
    assert any(jobs), "the worker-thread fill never ran"
    assert queued and any(queued), "no fill was queued behind the accepts with a completing row left out"
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in plain]
    assert [o["meta_info"]["finish_reason"] for o in over] == [o["meta_info"]["finish_reason"] for o in plain]


def test_greedy_constrained_batch_takes_the_masked_argmax(eng):
    """Every row constrained and greedy (>= BATCH_FILL_MIN rows): under overlap the tokens come from the
    argmax reading the bitmask (``Constraints.masked_argmax``, or on CUDA graph steps the masked greedy
    head's graph, runtime/greedy_heads.py), with no per-row processing; outputs equal the plain loop's
    (masked float32 logits, then the argmax)."""
    from nbgen.runtime.constraints import BATCH_FILL_MIN
    from nbgen.runtime.greedy_heads import GreedyHeads

    n = BATCH_FILL_MIN + 8
    prompts = _prompts(eng, "Give me a JSON record", n)
    sps = [{"temperature": 0.0, "max_new_tokens": 18 + i % 5,
            **({"json_schema": json.dumps(PERSON)} if i % 2 else {"regex": REGEXES[i % 4]})} for i in range(n)]
    calls, heads = [], []
    constraints = eng.loop.runner.sampler.constraints
    original, run_masked = constraints.masked_argmax, GreedyHeads.run_masked

    def spy(*a, **k):
        calls.append(1)
        return original(*a, **k)

    def spy_head(self, bs, cascade):
        heads.append(bs)
        run_masked(self, bs, cascade)

    constraints.masked_argmax = spy
    GreedyHeads.run_masked = spy_head
    try:
        plain, over = _forced_overlap(eng, lambda: eng.generate(prompts, sps, use_tqdm=False))
    finally:
        del constraints.masked_argmax
        GreedyHeads.run_masked = run_masked
    graphs = eng.loop.runner.graphs
    assert calls or heads, "the masked argmax never ran"
    if graphs is not None and graphs.heads is not None:
        assert heads, "graph steps with every row constrained and greedy never took the masked head"
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in plain]
    assert [o["meta_info"]["finish_reason"] for o in over] == [o["meta_info"]["finish_reason"] for o in plain]


def test_grammar_pipeline_beside_logprob_requests(eng):
    """Requests that need host-side values (logprobs) arriving among pipelined grammar steps: the
    stepper drops its staged forward and runs those steps synchronously; outputs stay the same."""
    from nbgen.runtime.constraints import BATCH_FILL_MIN

    n = BATCH_FILL_MIN + 4
    prompts = _prompts(eng, "Give me a JSON record", n) + ["The capital of France is"] * 2
    sps = [{"temperature": 1.0, "max_new_tokens": 18, "sampling_seed": i, "json_schema": json.dumps(PERSON)}
           for i in range(n)] + [{"temperature": 0.0, "max_new_tokens": 12}] * 2
    kw = {"return_logprob": [False] * (n + 1) + [True], "use_tqdm": False}
    plain, over = _forced_overlap(eng, lambda: eng.generate(prompts, sps, **kw))
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in plain]
    assert len(over[-1]["meta_info"]["output_token_logprobs"]) == 12


def test_abort_during_grammar_pipeline(eng):
    """An abort while a grammar step's forward is staged drops that forward; every other
    request still gets exactly the plain loop's tokens, the aborted one a clean prefix."""
    from nbgen.runtime.overlap import OverlapStepper

    class Recording(OverlapStepper):
        def flush(self) -> None:
            flushed_staged.append(self.staged is not None)
            super().flush()

    n, flushed_staged = 36, []
    prompts = _prompts(eng, "Give me a JSON record", n)
    sps = [{"temperature": 1.0, "max_new_tokens": 40, "sampling_seed": i, "json_schema": json.dumps(PERSON)}
           for i in range(n)]
    plain = eng.generate(prompts, sps, use_tqdm=False)
    rids = [f"pipe-{time.time()}-{i}" for i in range(n)]
    loop = eng.loop
    default = loop._overlap
    loop.call(lambda: setattr(loop, "_overlap", Recording.from_loop(loop)))
    try:
        t0 = eng.stats()["total_output_tokens"]

        def abort_soon() -> None:
            while eng.stats()["total_output_tokens"] - t0 < 3 * n:
                time.sleep(0.002)
            eng.abort(rids[5])

        aborter = threading.Thread(target=abort_soon)
        aborter.start()
        over = eng.generate(prompts, sps, rid=rids, use_tqdm=False)
        aborter.join(10)
    finally:
        loop.call(lambda: setattr(loop, "_overlap", default))
    assert any(flushed_staged), "no flush dropped a staged forward"
    a = over[5]
    assert a["meta_info"]["finish_reason"]["type"] == "abort"
    assert a["output_ids"] == plain[5]["output_ids"][: len(a["output_ids"])]
    keep = [i for i in range(n) if i != 5]
    assert [over[i]["output_ids"] for i in keep] == [plain[i]["output_ids"] for i in keep]


def test_abort_while_grammar_compiles(eng, monkeypatch):
    from nbgen.runtime.grammar import GrammarService

    release, started = threading.Event(), threading.Event()
    original = GrammarService._compile

    def slow_compile(self, key):
        started.set()
        release.wait(timeout=30)
        return original(self, key)

    monkeypatch.setattr(GrammarService, "_compile", slow_compile)
    schema = json.dumps({**CITY, "title": f"abort-{time.time()}"})
    it = eng.generate_iter("Give me a city", {"max_new_tokens": 20, "json_schema": schema}, rid="held-1")
    threading.Thread(target=lambda: (started.wait(10), eng.abort("held-1"))).start()
    try:
        _, out = next(it)
    finally:
        release.set()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    assert eng.stats()["waiting"] == 0


def test_matcher_failure_aborts_the_request(eng, monkeypatch):
    """A matcher that cannot be built (xgrammar refusing it) fails its request instead of losing it."""
    import nbgen.runtime.grammar as grammar

    def broken(*args, **kwargs):
        raise RuntimeError("no matcher")

    monkeypatch.setattr(grammar, "GrammarState", broken)
    out = eng.generate("Give me a city", {"max_new_tokens": 8, "json_schema": json.dumps(CITY)})
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    assert "no matcher" in out["meta_info"]["finish_reason"]["message"]
    monkeypatch.undo()
    assert eng.generate("Hi", {"max_new_tokens": 2, "json_schema": json.dumps(CITY)})["meta_info"]["completion_tokens"] >= 1


def test_grammar_request_that_can_never_fit_is_aborted(tiny_llama_dir):
    """Admitted after its grammar compiled, a request too big for the KV cache finishes at once
    with a message (it is delivered, not left waiting), and its neighbour still completes."""
    with nbgen.Engine(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=48) as e:
        big = list(range(5, 105))
        alone = e.generate(input_ids=big, sampling_params={"max_new_tokens": 4, "regex": "[ab]+"})
        assert alone["meta_info"]["finish_reason"]["type"] == "abort"   # no step runs: delivered at admission
        outs = e.generate(input_ids=[big, [5, 6, 7]],
                          sampling_params=[{"max_new_tokens": 4, "regex": "[ab]+"},
                                           {"max_new_tokens": 4, "regex": "[ab]+"}], use_tqdm=False)
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "does not fit" in outs[0]["meta_info"]["finish_reason"]["message"]
    assert outs[1]["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert len(outs[1]["output_ids"]) >= 1


def test_grammar_pipeline_with_preemption_same_outputs(tiny_llama_dir):
    """A KV pool too small for the batch: requests are preempted (and recomputed) while grammar
    steps are pipelined; seeded constrained outputs still equal the plain loop's."""
    from nbgen.runtime.constraints import BATCH_FILL_MIN
    from nbgen.runtime.overlap import OverlapStepper

    n = BATCH_FILL_MIN + 8
    prompts = [[5 + (i * 7 + j) % 300 for j in range(6 + i % 9)] for i in range(n)]
    sps = [{"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": i,
            "regex": ["[ab]{40,60}", "(cat|dog)( (cat|dog)){12,20}", "[0-9]{3,12}"][i % 3]} for i in range(n)]
    outs = []
    for overlap in (False, True):
        with nbgen.Engine(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=400) as e:
            if overlap:
                loop = e.loop
                loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
            outs.append(e.generate(input_ids=prompts, sampling_params=sps, use_tqdm=False))
            preempted = e.loop.scheduler.num_preemptions
        assert preempted > 0, "the pool was meant to be too small"
    plain, over = outs
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in plain]
    assert [o["meta_info"]["finish_reason"] for o in over] == [o["meta_info"]["finish_reason"] for o in plain]
    assert all(re.fullmatch(sps[i]["regex"], o["text"]) for i, o in enumerate(over)
               if o["meta_info"]["finish_reason"]["type"] == "stop")
