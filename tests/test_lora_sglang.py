"""SGLang's offline-Engine LoRA tests (sgl-project/sglang ``test/srt/lora/``), ported to nbgen.

Ported with the model paths changed: the base model is the tiny random Llama of the test fixtures, and
each Hugging Face adapter id of SGLang's tests names a random peft adapter built here on it, with the
targets the SGLang test notes for it and its rank scaled down (r 4 / 32 / 256 -> 4 / 8 / 16, and
each ``max_lora_rank`` of the tests likewise: 32 -> 8, 64 and 256 -> 16). ``SRTRunner`` is a thin
stand-in over ``nbgen.Engine`` (greedy ``batch_forward``, ``load_lora_adapter``, ``unload_lora_adapter``).

- ``test_lora_update.py``: the operation sequences (load / unload / forward with the expected errors)
  of BASIC_TESTS, TARGET_MODULE_TESTS, MAX_LORA_RANK_TESTS and EVICTION_TESTS, each run dynamically
  and then statically (every adapter loaded at start), outputs equal. Not ported: MAX_LOADED_LORAS_TESTS
  (SGLang evicts loaded adapters implicitly past ``max_loaded_loras`` and reloads them on use; nbgen
  refuses a load past the limit) and the server mode (no HTTP server).
- ``test_lora_eviction.py``: ``max_loras_per_batch=1``, two adapters alternating in both orders and
  under a reused name: the same (adapter, prompt) always gives the same text.
- ``test_multi_lora_backend.py`` / ``test_lora.py``: a batch mixing adapters and the base model equals
  HF + peft per prompt (greedy; SGLang compares with its HFRunner the same way).
Not portable: kernels' unit tests of SGLang's own backends (csgmv / triton ops), MoE / Llama-4 / VL /
TP / speculative / embedding-layer / OpenAI-API / prefetch tests (features nbgen does not have).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

import pytest

import nbgen
from tests.test_lora import hf_greedy, make_adapter

peft = pytest.importorskip("peft")

PROMPTS = ["SGL is a", "AI is a field of computer science focused on", "Computer science is the study of",
           "Write a short story.", "What are the main components of a computer?"]
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SQL = "philschmid/code-llama-3-1-8b-text-to-sql-lora"          # r 256 -> 16, all seven
NUTANIX = "Nutanix/Meta-Llama-3.1-8B-Instruct_lora_4_alpha_16"  # r 4, alpha 16, all seven
OCR = "pbevan11/llama-3.1-8b-ocr-correction"                    # r 32 -> 8, all seven
FACT = "algoprog/fact-generation-llama-3.1-8b-instruct-lora"    # q, k, v, o, gate
CHINESE = "faridlazuarda/valadapt-llama-3.1-8B-it-chinese"      # q, v
SQL6 = "philschmid/code-llama-3-1-8b-text-to-sql-lora#6"        # the eviction test's six targets
SPECS = {SQL: (16, 32, ALL7), NUTANIX: (4, 16, ALL7), OCR: (8, 16, ALL7), FACT: (4, 8, ALL7[:5]),
         CHINESE: (8, 16, ["q_proj", "v_proj"]), SQL6: (16, 32, ALL7[:6])}


@pytest.fixture(scope="module")
def paths(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sglang_lora")
    return {name: make_adapter(tiny_llama_dir, str(root / f"a{i}"), seed=10 + i, r=r, alpha=alpha, targets=t)
            for i, (name, (r, alpha, t)) in enumerate(SPECS.items())}


class SRTRunner:
    """The part of SGLang's ``sglang.test.runners.SRTRunner`` these tests use, over nbgen.Engine."""

    def __init__(self, model_path: str, paths: dict[str, str], lora_paths: Optional[list] = None,
                 **kw: Any) -> None:
        kw = {k: v for k, v in kw.items() if v is not None}
        self.paths = paths
        self.engine = nbgen.Engine(model_path, device="cpu", dtype="float32", disable_radix_cache=True,
                                   lora_paths=[self._local(p) for p in lora_paths] if lora_paths else None, **kw)

    def _local(self, spec: Any) -> Any:
        """An adapter spec with its HF id path replaced by the local adapter's directory."""
        if isinstance(spec, dict):
            return {**spec, "lora_path": self.paths[spec["lora_path"]]}
        name, _, path = spec.partition("=")
        return f"{name}={self.paths[path or name]}"

    def __enter__(self) -> "SRTRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.shutdown()

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> Any:
        return self.engine.load_lora_adapter(lora_name, self.paths[lora_path], pinned)

    def unload_lora_adapter(self, lora_name: str) -> Any:
        return self.engine.unload_lora_adapter(lora_name)

    def batch_forward(self, prompts: list[str], lora_paths: list, max_new_tokens: int) -> list[str]:
        outs = self.engine.generate(prompts, {"temperature": 0, "top_k": 1, "max_new_tokens": max_new_tokens},
                                    lora_path=list(lora_paths), use_tqdm=False)
        return [o["text"] for o in outs]


# ---- test_lora_update.py ------------------------------------------------------------------------
class OperationType(Enum):
    LOAD = "load"
    UNLOAD = "unload"
    FORWARD = "forward"


@dataclass
class Operation:
    type: OperationType
    data: Optional[Any]
    expected_error: Optional[str] = None


@dataclass
class Case:
    description: str
    max_loras_per_batch: int
    all_adapters: list
    op_sequence: list
    initial_adapters: Optional[list] = None
    enable_lora: Optional[bool] = None
    max_lora_rank: Optional[int] = None
    lora_target_modules: Optional[list] = None
    max_new_tokens: int = 8


def batch(adapters: Any) -> list[tuple[str, Any]]:
    """SGLang's create_batch_data: every prompt with every adapter."""
    adapters = adapters if isinstance(adapters, list) else [adapters]
    return [(p, a) for p in PROMPTS for a in adapters]


L, U, F = OperationType.LOAD, OperationType.UNLOAD, OperationType.FORWARD
CASES = [
    Case("dynamic lora update with initial lora_paths", 3, [SQL, NUTANIX, OCR],
         initial_adapters=[SQL, f"{NUTANIX}={NUTANIX}", {"lora_name": OCR, "lora_path": OCR, "pinned": False}],
         op_sequence=[Operation(L, SQL, "already loaded"), Operation(U, SQL), Operation(L, SQL),
                      Operation(F, batch([SQL, NUTANIX, OCR])), Operation(U, NUTANIX), Operation(U, OCR),
                      Operation(F, batch(SQL)), Operation(F, batch(NUTANIX)), Operation(F, batch(OCR)),
                      Operation(L, NUTANIX, "already loaded"), Operation(L, OCR, "already loaded"),
                      Operation(F, batch([SQL, NUTANIX, OCR])), Operation(U, SQL), Operation(F, batch(SQL)),
                      Operation(F, batch([NUTANIX, OCR])), Operation(U, NUTANIX), Operation(U, OCR),
                      Operation(F, batch(NUTANIX)), Operation(F, batch(OCR)), Operation(F, batch(None))]),
    Case("dynamic lora update without initial lora_paths", 4, [SQL, NUTANIX, OCR], enable_lora=True,
         max_lora_rank=16, lora_target_modules=["all"],
         op_sequence=[Operation(L, SQL), Operation(L, NUTANIX), Operation(L, OCR), Operation(L, SQL, "already loaded"),
                      Operation(U, SQL), Operation(L, SQL), Operation(F, batch([SQL, NUTANIX, OCR, None])),
                      Operation(U, SQL), Operation(F, batch(SQL)), Operation(F, batch([None, NUTANIX, OCR, None])),
                      Operation(U, NUTANIX), Operation(U, OCR), Operation(F, batch(NUTANIX)), Operation(F, batch(OCR)),
                      Operation(F, batch(None)), Operation(L, SQL, "already loaded"),
                      Operation(L, NUTANIX, "already loaded"), Operation(L, OCR, "already loaded"),
                      Operation(F, batch([SQL, NUTANIX, OCR, None]))]),
    Case("Test explicitly specified lora-target-modules.", 3, [NUTANIX, FACT], lora_target_modules=ALL7,
         max_lora_rank=16, initial_adapters=[FACT],
         op_sequence=[Operation(F, batch(FACT)), Operation(F, batch(NUTANIX), "never been loaded"),
                      Operation(L, NUTANIX), Operation(F, batch([FACT, NUTANIX, None]))]),
    Case("Test inferred lora-target-modules - start with larger adapter", 3, [NUTANIX, FACT], max_lora_rank=16,
         initial_adapters=[NUTANIX],
         op_sequence=[Operation(F, batch(NUTANIX)), Operation(F, batch(FACT), "never been loaded"),
                      Operation(L, FACT), Operation(F, batch([FACT, NUTANIX, None]))]),
    Case("Test inferred lora-target-modules - start with smaller adapter", 3, [NUTANIX, FACT], max_lora_rank=16,
         initial_adapters=[FACT],
         op_sequence=[Operation(F, batch(FACT)), Operation(F, batch(NUTANIX), "never been loaded"),
                      Operation(L, NUTANIX, "incompatible"), Operation(F, batch([FACT, None]))]),
    Case("Test explicitly specified max-lora-rank.", 3, [NUTANIX, OCR, SQL], max_lora_rank=8,
         initial_adapters=[NUTANIX],
         op_sequence=[Operation(F, batch(NUTANIX)), Operation(F, batch(SQL), "never been loaded"),
                      Operation(F, batch(OCR), "never been loaded"), Operation(L, OCR),
                      Operation(F, batch([OCR, NUTANIX, None])), Operation(L, SQL, "incompatible"),
                      Operation(F, batch(SQL), "never been loaded"), Operation(F, batch([OCR, NUTANIX, None]))]),
    Case("test implicitly inferred max-lora-rank", 3, [NUTANIX, OCR, SQL], initial_adapters=[OCR],
         op_sequence=[Operation(F, batch(OCR)), Operation(L, SQL, "incompatible"),
                      Operation(F, batch(SQL), "never been loaded"), Operation(L, NUTANIX),
                      Operation(F, batch(NUTANIX)), Operation(F, batch([NUTANIX, OCR, None]))]),
    Case("dynamic lora update with evictions", 2, [f"lora1={SQL}", f"lora2={NUTANIX}", f"lora3={OCR}"],
         enable_lora=True, max_lora_rank=16, lora_target_modules=["all"],
         op_sequence=[Operation(L, {"lora_name": "lora1", "lora_path": SQL, "pinned": True}),
                      Operation(L, {"lora_name": "lora2", "lora_path": NUTANIX, "pinned": True}, "starvation"),
                      Operation(L, {"lora_name": "lora2", "lora_path": NUTANIX, "pinned": False}),
                      Operation(L, {"lora_name": "lora3", "lora_path": OCR, "pinned": False}),
                      Operation(U, "lora1"), Operation(U, "lora3"),
                      Operation(L, {"lora_name": "lora3", "lora_path": OCR, "pinned": True}),
                      Operation(L, {"lora_name": "lora1", "lora_path": SQL, "pinned": True}, "starvation"),
                      Operation(L, {"lora_name": "lora1", "lora_path": SQL, "pinned": False}),
                      Operation(F, batch(["lora1", "lora2"])), Operation(F, batch(["lora1", "lora3"])),
                      Operation(F, batch(["lora1", "lora2"])), Operation(F, batch(["lora1", "lora2", None]))]),
]


def _run_sequence(base: str, paths: dict[str, str], case: Case, ops: list, initial: Optional[list],
                  dynamic: bool) -> list[list[str]]:
    """SGLang's _run_operation_sequence with its engine-mode session checks."""
    outputs = []
    kw = dict(max_loras_per_batch=case.max_loras_per_batch, enable_lora=case.enable_lora)
    if dynamic:
        kw.update(max_lora_rank=case.max_lora_rank, lora_target_modules=case.lora_target_modules)
    with SRTRunner(base, paths, lora_paths=initial, **kw) as runner:
        expected = set()
        for spec in initial or []:
            expected.add(spec["lora_name"] if isinstance(spec, dict) else spec.partition("=")[0])
        for op in ops:
            if op.type is OperationType.LOAD:
                info = op.data if isinstance(op.data, dict) else {"lora_name": op.data, "lora_path": op.data}
                res = runner.load_lora_adapter(info["lora_name"], info["lora_path"], info.get("pinned", False))
                if op.expected_error:
                    assert not res.success and op.expected_error in res.error_message, res
                else:
                    expected.add(info["lora_name"])
                    assert res.success, res.error_message
                    assert set(res.loaded_adapters) == expected
            elif op.type is OperationType.UNLOAD:
                expected.remove(op.data)
                res = runner.unload_lora_adapter(op.data)
                assert res.success, res.error_message
                assert set(res.loaded_adapters) == expected
            else:
                prompts, adapters = zip(*op.data)
                try:
                    out = runner.batch_forward(list(prompts), list(adapters), case.max_new_tokens)
                except ValueError as e:
                    assert op.expected_error and op.expected_error in str(e), str(e)
                    continue
                assert op.expected_error is None, f"expected {op.expected_error!r}"
                assert len(out) == len(prompts)
                expected.update(a for a in adapters if a is not None)     # loaded again if they were not
                outputs.append(out)
    return outputs


@pytest.mark.parametrize("case", CASES, ids=[c.description for c in CASES])
def test_dynamic_lora_update_engine(case: Case, tiny_llama_dir, paths) -> None:
    dynamic = _run_sequence(tiny_llama_dir, paths, case, case.op_sequence, case.initial_adapters, True)
    forward_ops = [op for op in case.op_sequence if op.type is OperationType.FORWARD and op.expected_error is None]
    static = _run_sequence(tiny_llama_dir, paths, case, forward_ops, case.all_adapters, False)
    assert len(dynamic) == len(static)
    for d, s in zip(dynamic, static):
        assert [x.strip() for x in d] == [x.strip() for x in s]


# ---- test_lora_eviction.py ----------------------------------------------------------------------
@contextlib.contextmanager
def dynamically_loaded_adapter(runner: SRTRunner, lora_path: str, lora_name: str):
    try:
        runner.load_lora_adapter(lora_name=lora_name, lora_path=lora_path)
        yield
    finally:
        runner.unload_lora_adapter(lora_name=lora_name)


def _eviction_run(base: str, paths: dict, lora_paths: list, history: dict, reverse: bool = False,
                  repeat: int = 2, reuse_lora_name: bool = False) -> None:
    with SRTRunner(base, paths, lora_paths=None if reuse_lora_name else lora_paths, max_loras_per_batch=1,
                   enable_lora=True, max_lora_rank=16,
                   lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]) as runner:
        sequence = lora_paths[::-1] if reverse else lora_paths
        for _ in range(repeat):
            for lora_path in sequence:
                name = "lora" if reuse_lora_name else lora_path
                ctx = dynamically_loaded_adapter(runner, lora_path, name) if reuse_lora_name else contextlib.nullcontext()
                with ctx:
                    for prompt in PROMPTS[:2]:
                        out = runner.batch_forward([prompt], [name], 16)[0].strip()
                        prev = history.setdefault((lora_path, prompt), out)
                        assert prev == out, (lora_path, prompt, reverse, reuse_lora_name)


def test_lora_eviction_with_different_target_modules(tiny_llama_dir, paths) -> None:
    history: dict = {}
    _eviction_run(tiny_llama_dir, paths, [CHINESE, SQL6], history, reverse=False)
    _eviction_run(tiny_llama_dir, paths, [CHINESE, SQL6], history, reverse=True)


def test_lora_eviction_with_reused_lora_name(tiny_llama_dir, paths) -> None:
    history: dict = {}
    _eviction_run(tiny_llama_dir, paths, [CHINESE, SQL6], history, reuse_lora_name=True, repeat=1)
    _eviction_run(tiny_llama_dir, paths, [CHINESE, SQL6], history, reuse_lora_name=False, repeat=1)


# ---- test_multi_lora_backend.py / test_lora.py: a mixed batch against HF + peft --------------------
def test_multi_lora_batch_matches_hf(tiny_llama_dir, paths) -> None:
    adapters = [NUTANIX, None, FACT, OCR, NUTANIX]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]
    with SRTRunner(tiny_llama_dir, paths, lora_paths=[NUTANIX, FACT, OCR], max_loras_per_batch=4) as runner:
        tok = runner.engine.get_tokenizer()
        outs = runner.engine.generate(prompts, {"temperature": 0, "max_new_tokens": 8}, lora_path=adapters,
                                      use_tqdm=False)
        for prompt, name, out in zip(prompts, adapters, outs):
            ids = tok.encode(prompt)
            want = hf_greedy(tiny_llama_dir, paths[name] if name else None, ids, 8)
            assert out["output_ids"] == want, (prompt, name)
