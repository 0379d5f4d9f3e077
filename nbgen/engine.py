"""Engine: the SGLang-compatible offline facade (sync, streaming and async generation).

The caller's thread validates, tokenizes and shapes outputs; a LoopThread owns everything else.
"""
from __future__ import annotations

import gc
import logging
import random
import threading
import weakref
from typing import Any, Iterator, Optional

import torch

from nbgen.core.config import EngineConfig
from nbgen.core.errors import ArgumentTypeError
from nbgen.core.request import Request
from nbgen.engine_cell_asyncio import install_cell_asyncio_run
from nbgen.engine_async import AsyncGenerateMixin, ensure_event_loop
from nbgen.engine_embed import EmbedMixin
from nbgen.engine_info import InfoMixin
from nbgen.engine_lora import LoRAMixin
from nbgen.engine_control import ControlMixin
from nbgen.engine_score import ScoreMixin
from nbgen.engine_weights import WeightsMixin
from nbgen.engine_session import SessionMixin
from nbgen.engine_sync import SyncBridgeMixin
from nbgen.engine_io import (ModelFacts, build_params, check_ids, check_priority, make_logprob_requests,
                             make_requests, normalize_inputs, per_item, request_ids)
from nbgen.engine_images import attach_images, prepare_images
from nbgen.engine_images_llava import vision_prep_for
from nbgen.engine_loading import StageCallback, StartupFeedback, model_name, starting_default, warn_others_running
from nbgen.request_options import attach_options, check_structured
from nbgen.models.embedded import default_model_path
from nbgen.runtime.dp_loop import make_loop

logger = logging.getLogger("nbgen")


class Engine(SyncBridgeMixin, AsyncGenerateMixin, ScoreMixin, EmbedMixin, ControlMixin, SessionMixin, WeightsMixin, LoRAMixin,
             InfoMixin):
    """An LLM engine for offline batch inference. ``Engine()`` loads the embedded default model;
    ``Engine(..., is_embedding=True)`` embeds (``encode``) instead of generating."""

    def __init__(self, model_path: Optional[str] = None, *, on_stage: Optional[StageCallback] = None,
                 **kwargs: Any) -> None:
        """Load the model and start the loop thread. ``on_stage(stage)`` hears the start-up stages
        (on the thread doing the work); without it a notebook shows a loading line, a script logs them."""
        self._shut = True
        self.final_stats: Optional[dict[str, Any]] = None  # stats() as of shutdown()
        self.shutting_down = False  # shutdown() is stopping the loop; final_stats is not set yet
        cfg = EngineConfig.from_kwargs(model_path, kwargs)
        logging.getLogger("nbgen").setLevel(cfg.log_level.upper())
        if cfg.model_path is None and cfg.load_format == "dummy":
            raise ValueError("model_path is required with load_format='dummy' (a dir with config.json)")
        warn_others_running([e.model_name for e in running_engines()])
        with StartupFeedback(on_stage) as feedback:
            if cfg.model_path is None:
                cfg.model_path = default_model_path(feedback)
            self.config = cfg
            self._loop = make_loop(cfg, on_stage=feedback)   # a LoopThread, or dp_size of them
            info = self._loop.start()
        self._shut = False
        self._finalizer = weakref.finalize(self, type(self._loop).shutdown, self._loop)
        loaded = info.pop("loaded")     # the start-up future keeps the rest: not the model
        self.device = info["device"]
        self.scheduler_config = info["scheduler"]
        self.resolved_config = info["config"]   # every device-dependent default chosen
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.dtype = loaded.dtype
        self.pooling = loaded.pooling    # PoolingConfig of an embedding engine, else None
        self._images = vision_prep_for(loaded.hf_config, loaded.model_dir)   # vision-language models: image_data
        self._facts = ModelFacts(vocab_size=int(loaded.hf_config.vocab_size),
                                 context_length=int(loaded.context_length),
                                 eos_ids=frozenset(loaded.eos_token_ids),
                                 generation_defaults=dict(loaded.generation_defaults or {}),
                                 allow_context_overflow=cfg.allow_context_overflow,
                                 allow_auto_truncate=cfg.allow_auto_truncate)
        self._rng = random.Random(cfg.random_seed)
        _live_engines.add(self)
        feedback.done(self.model_name, self.device)
        install_cell_asyncio_run()
        ensure_event_loop()

    @property
    def loop(self) -> Any:
        """The engine's loop (a ``LoopThread``, or a ``DPLoop`` of replicas): for instrumentation, as
        vLLM's ``llm_engine``; ``loop.call(fn)`` runs ``fn`` on the loop thread and returns its result."""
        return self._loop

    @property
    def is_shutdown(self) -> bool:
        """True once shutdown() ran (or the loop thread died)."""
        return self._shut or not self._loop.alive

    @property
    def model_name(self) -> str:
        """``served_model_name`` when given, else the model's short name (``SmolLM2-135M-Instruct``
        for the embedded model)."""
        return self.config.served_model_name or model_name(self.config.model_path)

    # ---- request preparation --------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.is_shutdown:
            raise RuntimeError("engine is shut down")

    def get_tokenizer(self) -> Any:
        """The HF tokenizer (None with skip_tokenizer_init); ``.encode(text)`` gives the token ids
        generate() and encode() use."""
        return self.tokenizer

    def _tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special prefix tokens)."""
        if self.tokenizer is None:
            raise ValueError("this Engine has no tokenizer (skip_tokenizer_init=True): pass input_ids")
        return list(self.tokenizer.encode(text))

    def _tokenize_all(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text: a fast tokenizer encodes the batch in one call (Rust, on all
        cores), the same ids as ``_tokenize`` one by one."""
        if len(texts) > 1 and self.tokenizer is not None and getattr(self.tokenizer, "is_fast", False):
            return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]
        return [self._tokenize(t) for t in texts]

    def _prepare(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: Any,
                 top_logprobs_num: Any, logprob_start_len: Any, token_ids_logprob: Any,
                 rid: Any, return_hidden_states: Any = False,
                 custom_logit_processor: Any = None,
                 return_text_in_logprobs: Any = False, priority: Any = None, session_params: Any = None,
                 session_id: Any = None, lora_path: Any = None, image_data: Any = None) -> tuple[list[Request], bool]:
        self._check_alive()
        if self.config.is_embedding:
            raise ValueError("this Engine was created with is_embedding=True: it embeds and does not generate; "
                             "use encode() (or create another Engine without is_embedding)")
        items, single, kind = normalize_inputs(prompt, input_ids)
        n = len(items)
        if isinstance(sampling_params, list) and single:
            raise ValueError("sampling_params is a list but a single prompt was given")
        sps = [build_params(d, self._facts) for d in per_item("sampling_params", sampling_params, n)]
        for sp in sps:
            check_structured(sp, self.tokenizer is not None)   # invalid grammar / stop_regex -> ValueError
            if sp.constrained and self.config.grammar_backend == "none":
                raise ValueError("this Engine has grammar_backend='none': json_schema, regex, ebnf and "
                                 "structural_tag are not available (create it with grammar_backend='xgrammar')")
        lps = make_logprob_requests(n, return_logprob, top_logprobs_num, logprob_start_len,
                                    token_ids_logprob, self._facts.vocab_size, return_text_in_logprobs)
        rids = request_ids(rid, n, single)
        prio = check_priority(priority)
        ids_list = self._tokenize_all(items) if kind == "prompt" else items
        ids_list, image_inputs = prepare_images(self._images, self.model_name, ids_list, image_data, single, lps,
                                                 session_params is not None or session_id is not None or lora_path is not None)
        sps = [check_ids(ids, i, sp, self._facts) for i, (ids, sp) in enumerate(zip(ids_list, sps))]
        reqs = make_requests(ids_list, sps, lps, rids, self._facts, self._rng)
        if image_inputs is not None:
            attach_images(reqs, [sp.n for sp in sps], image_inputs)
        for r in reqs:
            r.priority = prio
        self._attach_lora(reqs, [sp.n for sp in sps], lora_path)
        attach_options(reqs, sps, per_item("return_hidden_states", return_hidden_states, n),
                       per_item("custom_logit_processor", custom_logit_processor, n),
                       self.config.enable_custom_logit_processor, self.config.enable_return_hidden_states)
        self._bind_session(reqs, session_params, session_id)
        return reqs, single

    # ---- sync -----------------------------------------------------------------------------------
    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 stream: bool = False, return_logprob: Any = False, top_logprobs_num: Any = 0,
                 logprob_start_len: Any = -1, token_ids_logprob: Any = None, rid: Any = None,
                 use_tqdm: Optional[bool] = None, return_hidden_states: Any = False,
                 custom_logit_processor: Any = None, return_text_in_logprobs: bool = False,
                 priority: Optional[int] = None, session_params: Any = None, session_id: Any = None,
                 lora_path: Any = None, image_data: Any = None) -> Any:
        """Generate for one prompt (-> dict) or a list (-> list of dicts, prompt-major for n > 1).

        ``stream=True`` returns an iterator of chunks whose ``text`` is new since the last chunk (a
        list of prompts or n > 1: chunks of all requests, each with ``index`` into the output list).
        ``return_hidden_states=True`` adds ``meta_info["hidden_states"]`` (one last-layer state per
        generated token); ``custom_logit_processor`` takes ``CustomLogitProcessor.to_str()`` strings
        (Engine(enable_custom_logit_processor=True) only). ``return_text_in_logprobs=True`` fills
        the text of each ``(logprob, token_id, text)`` triple. ``priority`` (an int, for every prompt
        of the call) orders the requests under ``Engine(enable_priority_scheduling=True)``.
        ``session_params`` continues a request of an open session (``open_session``).
        ``lora_path``: a loaded LoRA adapter's name, or a list with one per prompt (None = the base model).
        ``image_data`` (vision-language models): an image (path, URL, base64, bytes, PIL) or a list per
        prompt; for a batch a list with one entry per prompt (``engine_images.py``).
        """
        reqs, single = self._prepare(prompt, sampling_params, input_ids, return_logprob,
                                     top_logprobs_num, logprob_start_len, token_ids_logprob, rid,
                                     return_hidden_states, custom_logit_processor, return_text_in_logprobs,
                                     priority, session_params, session_id, lora_path, image_data)
        if stream:
            return self._stream(reqs)
        results = dict(self._run_sync(reqs, use_tqdm if use_tqdm is not None else len(reqs) > 1))
        outs = [results[r.rid] for r in reqs]
        return outs[0] if single and len(outs) == 1 else outs

    def generate_iter(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                      **kw: Any) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(index, output)`` as each request finishes; closing early aborts the rest."""
        reqs, _ = self._prepare(prompt, sampling_params, input_ids, kw.pop("return_logprob", False),
                                kw.pop("top_logprobs_num", 0), kw.pop("logprob_start_len", -1),
                                kw.pop("token_ids_logprob", None), kw.pop("rid", None),
                                kw.pop("return_hidden_states", False), kw.pop("custom_logit_processor", None),
                                kw.pop("return_text_in_logprobs", False), kw.pop("priority", None),
                                kw.pop("session_params", None), kw.pop("session_id", None),
                                kw.pop("lora_path", None), kw.pop("image_data", None))
        if kw:
            raise TypeError(f"generate_iter() got unexpected arguments {sorted(kw)}")
        index = {r.rid: i for i, r in enumerate(reqs)}
        for rid, out in self._run_sync(reqs, progress=False):
            yield index[rid], out

    # ---- chat -----------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        """True when the tokenizer has a chat template (apply_chat_template() and chat() work)."""
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render one conversation with the tokenizer's chat template."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ArgumentTypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def chat(self, messages: Any, sampling_params: Any = None, **kw: Any) -> Any:
        """generate() over one conversation (-> dict) or a list of conversations (-> list)."""
        single = bool(messages) and isinstance(messages, list) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        prompts = [self.apply_chat_template(c) for c in convs]
        return self.generate(prompts[0] if single else prompts, sampling_params, **kw)

    # ---- info and lifetime ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Live numbers for widgets: running/waiting, KV pages, recent tok/s, totals (``lora_adapters``:
        the loaded adapters' names, with enable_lora)."""
        self._check_alive()
        mgr = self._lora()
        return self._loop.stats() if mgr is None else {**self._loop.stats(), "lora_adapters": mgr.stats()}

    def shutdown(self) -> None:
        """Stop the loop thread and free the model; idempotent. Later calls raise RuntimeError."""
        if self._shut:
            return
        self._shut = True
        _live_engines.discard(self)
        self.shutting_down = True
        try:
            self._finalizer()
        finally:
            self.final_stats = self._loop.stats()  # last numbers, for widgets that outlive the engine
            self.shutting_down = False
        # the model, KV pool and graphs are only reachable through cycles once the loop let go of them:
        # collect them now, so their GPU memory is back before the next Engine sizes its KV cache
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


_live_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # started and not shut down


def running_engines() -> list[Engine]:
    """The Engines of this process that started and are not shut down (collected ones are gone)."""
    return [e for e in list(_live_engines) if not e.is_shutdown]


_default_engines: dict[bool, Engine] = {}   # is_embedding -> the process-wide engine of that kind
_default_lock = threading.Lock()


def default_engine(is_embedding: bool = False) -> Engine:
    """The process-wide Engine (embedded model) that helpers use when given ``engine=None``
    (``is_embedding=True``: the one embed_df uses); created on first use, and again after the user
    shut it down."""
    with _default_lock:
        e = _default_engines.get(is_embedding)
        if e is None or e.is_shutdown:
            yours = [x.model_name for x in running_engines()
                     if x not in _default_engines.values() and x.config.is_embedding == is_embedding]
            with starting_default(yours):
                e = _default_engines[is_embedding] = Engine(is_embedding=True) if is_embedding else Engine()
        return e
