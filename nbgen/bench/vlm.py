"""Images in: ``python -m nbgen.bench.vlm`` (GPU: the real Qwen2.5-VL-7B config, dummy weights).

Workload (``random.seed(0)``, numpy seed 0): ``--num-requests`` prompts of 20 random text ids, one
``--image-size`` square random-noise image (distinct per request) and 20 more ids; greedy,
``ignore_eos``, exactly ``--output-len`` tokens each; sent as ``input_ids`` + ``image_data`` in one
``generate`` call (image preprocessing on the caller's thread included in nbgen's time).
Reported: nbgen's output tok/s; HF transformers ``generate`` on the first ``--hf-requests`` prompts
in batches of ``--hf-batch-size`` (the prompts have equal lengths: no padding), random weights of the same
config, its output tok/s and the ratio; the vision tower's share: the tower alone over the same
images (batches of ``--tower-batch`` images, as prefill steps group them) ÷ nbgen's time; the
preprocessing time alone; generate()'s image layout alone, and when the first ``--tower-batch`` and all
images' background pixels are ready. ``--profile``: the workload once more under the profiler
(``bench/vlm_profile.py``). ``--tiny`` builds a tiny random Qwen2.5-VL instead (CPU smoke run).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any, Optional

import numpy as np
import torch

from nbgen.bench.tiny_vlm import make_tiny_vlm
from nbgen.bench.vlm_profile import profile_generate
from nbgen.engine import Engine
from nbgen.engine_images_llava import vision_prep_for
from nbgen.kernels import gpu_ops
from nbgen.models.model_config import read_model_config
from nbgen.models.qwen2_vl_vision import VisionTower
from nbgen.models.registry import prepare_config

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs", "qwen2.5-vl-7b")
_TEXT_IDS = 20


def workload(cfg: Any, n: int, size: int) -> tuple[list[list[int]], list[Any]]:
    """(prompt ids with one image placeholder each, PIL images) — seeded."""
    from PIL import Image

    random.seed(0)
    rng = np.random.default_rng(0)
    top = min(10000, int(cfg.vocab_size))
    lo = 10                                   # keep clear of the tiny tokenizer's special ids
    ph = [int(cfg.vision_start_token_id), int(cfg.image_token_id), int(cfg.vision_end_token_id)]
    ids = [[random.randrange(lo, top) for _ in range(_TEXT_IDS)] + ph +
           [random.randrange(lo, top) for _ in range(_TEXT_IDS)] for _ in range(n)]
    images = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]
    return ids, images


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_nbgen(args: argparse.Namespace, model_dir: str, ids: list[list[int]], images: list[Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {"device": args.device, "load_format": args.load_format, "random_seed": 0}
    if args.dtype:
        kw["dtype"] = args.dtype
    eng = Engine(model_dir, **kw)
    sp = {"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True}
    eng.generate(input_ids=ids[:2], sampling_params={**sp, "max_new_tokens": 2}, image_data=images[:2],
                 use_tqdm=False)                                              # warm-up
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=ids, sampling_params=sp, image_data=images, use_tqdm=False)
    secs = time.perf_counter() - t0
    prof = profile_generate(eng, ids, images, sp, args.profile_dir or tempfile.gettempdir()) if args.profile else None
    eng.shutdown()
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    res = {"engine": "nbgen", "seconds": secs, "out_tokens": n_out, "out_tok_s": n_out / secs,
           "prompt_tokens": outs[0]["meta_info"]["prompt_tokens"],
           "image_tokens": outs[0]["meta_info"]["image_tokens"]}
    if prof is not None:
        res["profile"] = prof
    return res


def run_hf(args: argparse.Namespace, model_dir: str, ids: list[list[int]], images: list[Any]) -> dict[str, Any]:
    """HF generate on the first --hf-requests prompts, batches of --hf-batch-size, same images."""
    import transformers as tf

    hf_cfg = tf.AutoConfig.from_pretrained(model_dir)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with torch.device(args.device):
        model = tf.AutoModelForImageTextToText.from_config(hf_cfg, dtype=dtype).eval()
    proc = tf.AutoImageProcessor.from_pretrained(model_dir)
    n, bs, L = min(args.hf_requests, len(ids)), args.hf_batch_size, args.output_len
    img_id, merge = int(hf_cfg.image_token_id), int(hf_cfg.vision_config.spatial_merge_size) ** 2
    secs, n_out = 0.0, 0
    for b in range(0, n, bs):
        x = proc(images=images[b:b + bs], return_tensors="pt")
        k = int(x["image_grid_thw"][0].prod()) // merge
        rows = [sum(([t] * k if t == img_id else [t] for t in p), []) for p in ids[b:b + bs]]
        inp = torch.tensor(rows, device=args.device)
        _sync(args.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            g = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp),
                               pixel_values=x["pixel_values"].to(args.device, dtype),
                               image_grid_thw=x["image_grid_thw"].to(args.device),
                               mm_token_type_ids=(inp == img_id).int(), max_new_tokens=L, min_new_tokens=L,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        _sync(args.device)
        secs += time.perf_counter() - t0
        n_out += int((g.shape[1] - inp.shape[1]) * g.shape[0])
    return {"engine": "hf generate", "requests": n, "batch_size": bs, "seconds": secs, "out_tokens": n_out,
            "out_tok_s": n_out / secs}


def run_tower(args: argparse.Namespace, model_dir: str, images: list[Any]) -> dict[str, Any]:
    """The vision tower alone over the images (dummy weights), and the preprocessing alone."""
    import transformers as tf

    cfg = prepare_config(read_model_config(model_dir))
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.device == "cuda":
        gpu_ops.enable_fused(True)            # flashinfer's norms, as an engine's tower runs them
    with torch.device(args.device):
        tower = VisionTower(cfg.vision_config, cfg.hidden_size, True).to(dtype).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0.0, 0.02)
    proc = tf.AutoImageProcessor.from_pretrained(model_dir)
    t0 = time.perf_counter()
    batches = [proc(images=images[b:b + args.tower_batch], return_tensors="pt")
               for b in range(0, len(images), args.tower_batch)]
    prep = time.perf_counter() - t0
    inputs = [(x["pixel_values"].to(args.device, dtype), [tuple(g) for g in x["image_grid_thw"].tolist()])
              for x in batches]
    with torch.inference_mode():
        tower(*inputs[0])                                                    # warm-up
        _sync(args.device)
        t0 = time.perf_counter()
        for pv, grids in inputs:
            tower(pv, grids)
        _sync(args.device)
        return {"tower_seconds": time.perf_counter() - t0, "preprocess_seconds": prep}


def run_layout(model_dir: str, ids: list[list[int]], images: list[Any], first: int) -> dict[str, Any]:
    """generate()'s image layout alone on the caller's thread (``ImagePrep.expand``: placeholders, hashes,
    positions; the pixel work then starts in the background) and when the first ``first`` and all
    prompts' pixels are ready, from the call."""
    prep = vision_prep_for(prepare_config(read_model_config(model_dir)), model_dir)
    _ = prep.processor
    t0 = time.perf_counter()
    _, inputs = prep.expand([list(p) for p in ids], [[im] for im in images])
    laid = time.perf_counter() - t0
    for inp in inputs[:first]:
        inp.pixels()
    head = time.perf_counter() - t0
    for inp in inputs:
        inp.pixels()
    return {"layout_seconds": laid, f"first_{first}_pixels_after_s": head, "all_pixels_after_s": time.perf_counter() - t0}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m nbgen.bench.vlm", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=CONFIG_DIR, help="HF dir (config.json + preprocessor_config.json)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen2.5-VL built here (CPU smoke run)")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=64, help="prompts HF generate runs (0: skip HF)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--tower-batch", type=int, default=32)
    ap.add_argument("--profile", action="store_true",
                    help="run nbgen's workload again under the profiler: GPU busy time, tower share, top kernels")
    ap.add_argument("--profile-dir", default=None, help="where --profile writes its trace (default: temp dir)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_vlm(tmp, "qwen2_5_vl", max_pixels=args.image_size ** 2) if args.tiny else args.model
        if args.tiny:
            args.load_format = "auto"
        cfg = prepare_config(read_model_config(model_dir))
        ids, images = workload(cfg, args.num_requests, args.image_size)
        res: dict[str, Any] = {"workload": {"requests": args.num_requests, "image": args.image_size,
                                            "output_len": args.output_len, "device": args.device,
                                            "model": "tiny" if args.tiny else os.path.basename(model_dir)}}
        res["nbgen"] = run_nbgen(args, model_dir, ids, images)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        res["vision"] = run_tower(args, model_dir, images)
        res["vision"].update(run_layout(model_dir, ids, images, args.tower_batch))
        res["vision"]["share_of_nbgen_time"] = res["vision"]["tower_seconds"] / res["nbgen"]["seconds"]
        if args.hf_requests > 0:
            if args.device == "cuda":
                torch.cuda.empty_cache()
            res["hf"] = run_hf(args, model_dir, ids, images)
            res["speedup_vs_hf"] = res["nbgen"]["out_tok_s"] / res["hf"]["out_tok_s"]
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
