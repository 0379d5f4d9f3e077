"""GGUF -> cached HF directory (config, fp32 safetensors, tokenizer), through transformers' GGUF support.

Dequantising a GGUF takes tens of seconds, so the result is kept under the nbgen cache dir, keyed
by the file's path, size and mtime; later loads read the safetensors in seconds.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from nbgen.kernels.envs import cache_dir

logger = logging.getLogger(__name__)

_DONE = "nbgen-converted.json"   # written last: a directory without it is incomplete


def converted_dir(gguf_path: str) -> Path:
    """Where the conversion of this GGUF file lives (it may not exist yet)."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    key = hashlib.sha1(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{p.stem}-{key}"


def is_converted(gguf_path: str) -> bool:
    """True when a complete conversion of this GGUF file is cached."""
    return (converted_dir(gguf_path) / _DONE).exists()


def gguf_to_hf_dir(gguf_path: str) -> str:
    """Convert (once) and return the path of an HF model directory equivalent to `gguf_path`."""
    out = converted_dir(gguf_path)
    if (out / _DONE).exists():
        return str(out)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = Path(gguf_path).resolve()
    logger.warning("nbgen: converting %s to safetensors (once; cached in %s)", src.name, out)
    folder, name = str(src.parent), src.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):   # only the parameter names are needed to map GGUF tensor names
        skeleton = AutoModelForCausalLM.from_config(config)
    if not getattr(config, "architectures", None):
        config.architectures = [type(skeleton).__name__]
    parsed = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=skeleton)
    tensors = {k: v.float().contiguous() for k, v in parsed["tensors"].items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)

    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del tensors, parsed
    config.save_pretrained(str(tmp))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(str(tmp))
    gen = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                           pad_token_id=getattr(config, "pad_token_id", None))
    gen.save_pretrained(str(tmp))
    (tmp / _DONE).write_text(json.dumps({"source": str(src)}))
    try:
        os.replace(tmp, out)
    except OSError:   # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / _DONE).exists():
            raise
    return str(out)
