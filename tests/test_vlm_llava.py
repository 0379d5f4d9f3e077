"""LLaVA-1.5: images in, text out. Tiny random LLaVA (CLIP tower, Llama or Qwen2 decoder) built with
transformers; fp32 greedy outputs token-identical to HF ``generate`` (one image, two images, a batch
mixing text-only and image prompts, image spans split by chunked prefill); tower + projector within
1e-4 of HF's ``get_image_features``; the prefix cache shares image KV by content hash only."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import nbgen
from nbgen.bench.tiny_vlm import make_tiny_llava

SP = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PER_IMAGE = 16          # (28 px / 7 px)^2 patches, CLS dropped
CHUNK = 16


def _image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def llava(request, tmp_path_factory):
    """(model dir, engine whose 16-token prefill chunks and 4-token pages cut through image spans)."""
    d = make_tiny_llava(str(tmp_path_factory.mktemp(f"llava_{request.param}")), request.param)
    eng = nbgen.Engine(d, dtype="float32", device="cpu", page_size=4, chunked_prefill_size=CHUNK, random_seed=0)
    yield d, eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(llava):
    import transformers as tf

    d, _ = llava
    model = tf.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    return model, tf.AutoImageProcessor.from_pretrained(d)


def _prompt(eng, n_images: int, text: str = "Describe the image.") -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return eng.apply_chat_template([{"role": "user", "content": content}])


def _hf_ids(tok, prompt: str) -> list[int]:
    """The prompt's ids with each <image> expanded to its slots (what HF's LlavaProcessor produces)."""
    return tok(prompt.replace("<image>", "<image>" * PER_IMAGE)).input_ids


def _hf_generate(hf_model, tok, prompt: str, images: list, n: int = SP["max_new_tokens"]) -> list[int]:
    model, proc = hf_model
    ids = torch.tensor([_hf_ids(tok, prompt)])
    kw = {"pixel_values": proc(images=images, return_tensors="pt")["pixel_values"]} if images else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


def test_tower_and_projector_match_hf(llava, hf_model):
    d, _ = llava
    model, proc = hf_model
    pv = proc(images=[_image(40, 60, 1), _image(28, 28, 2), _image(90, 30, 3)], return_tensors="pt")["pixel_values"]
    from nbgen.models.loader import iter_safetensors
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config

    cfg = prepare_config(read_model_config(d))
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(iter_safetensors(d))
    assert len(ours.vision_tower.encoder.layers) == 2          # layer -2 of 3: the last one is never built
    with torch.no_grad():
        ref = torch.cat(model.model.get_image_features(pv).pooler_output)      # [3 * 16, H]
        got = ours.encode_images(pv, [(1, 1, PER_IMAGE)] * 3)
    assert got.shape == ref.shape == (3 * PER_IMAGE, cfg.hidden_size)
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_matches_hf(llava, hf_model, n_images):
    _, eng = llava
    ims = [_image(40 + 30 * i, 60, seed=10 + i) for i in range(n_images)]
    prompt = _prompt(eng, n_images)
    out = eng.generate(prompt, SP, image_data=ims if n_images > 1 else ims[0])
    assert out["output_ids"] == _hf_generate(hf_model, eng.tokenizer, prompt, ims)
    assert out["meta_info"]["image_tokens"] == n_images * PER_IMAGE
    assert out["meta_info"]["prompt_tokens"] == len(_hf_ids(eng.tokenizer, prompt))


def test_chunked_prefill_splits_image_spans(llava, hf_model):
    """Text before the image moves its 16 slots off the 16-token chunk grid: each image is split
    across two prefill chunks (and its 4-token pages), and the output still matches HF."""
    _, eng = llava
    ims = [_image(50, 50, seed=31), _image(30, 70, seed=32)]
    prompt = _prompt(eng, 2, "Now compare both pictures carefully.")
    ids = _hf_ids(eng.tokenizer, prompt)
    first = ids.index(eng.hf_config.image_token_id)
    assert first % CHUNK != 0 and (first + PER_IMAGE - 1) // CHUNK > first // CHUNK
    out = eng.generate(prompt, SP, image_data=ims)
    assert out["output_ids"] == _hf_generate(hf_model, eng.tokenizer, prompt, ims)


def test_batch_mixing_text_and_images_matches_hf(llava, hf_model):
    _, eng = llava
    prompts = [_prompt(eng, 1, "What is this?"), _prompt(eng, 0, "Just text here."),
               _prompt(eng, 2, "Compare them."), _prompt(eng, 1, "Colours?")]
    images = [_image(40, 40, seed=1), None, [_image(60, 30, seed=2), _image(30, 60, seed=3)], _image(80, 80, seed=4)]
    outs = eng.generate(prompts, SP, image_data=images)
    for p, ims, o in zip(prompts, images, outs):
        want = _hf_generate(hf_model, eng.tokenizer, p, [] if ims is None else ims if isinstance(ims, list) else [ims])
        assert o["output_ids"] == want
        assert ("image_tokens" in o["meta_info"]) == (ims is not None)


def test_prefix_cache_shares_by_image_hash(llava):
    _, eng = llava
    prompt = _prompt(eng, 1, "Tell me about this picture in a few words.")
    a, b = _image(56, 56, seed=21), _image(56, 56, seed=22)
    eng.flush_cache()
    first = eng.generate(prompt, SP, image_data=a)
    same = eng.generate(prompt, SP, image_data=a)
    other = eng.generate(prompt, SP, image_data=b)
    assert same["output_ids"] == first["output_ids"]
    start = eng.tokenizer(prompt).input_ids.index(eng.hf_config.image_token_id)
    assert first["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["cached_tokens"] >= start + PER_IMAGE          # the image's KV is reused
    assert other["meta_info"]["cached_tokens"] <= start                      # a different image shares none of it


def test_expanded_input_ids_and_refusals(llava, hf_model):
    """input_ids already expanded by the HF processor run as the one-token form; bad counts are refused
    with a ValueError and the engine keeps serving."""
    _, eng = llava
    img = _image(44, 66, seed=41)
    prompt = _prompt(eng, 1)
    short = eng.generate(prompt, SP, image_data=img)
    full = eng.generate(input_ids=_hf_ids(eng.tokenizer, prompt), sampling_params=SP, image_data=img)
    assert full["output_ids"] == short["output_ids"]
    bare = eng.generate("Describe.", SP, image_data=img)                   # no placeholder: one prepended
    assert bare["meta_info"]["image_tokens"] == PER_IMAGE
    with pytest.raises(ValueError, match="image placeholder"):
        eng.generate(prompt, SP, image_data=[img, img])
    bad = eng.tokenizer(prompt).input_ids
    i = bad.index(eng.hf_config.image_token_id)
    with pytest.raises(ValueError, match="run of 3 image tokens"):
        eng.generate(input_ids=bad[:i] + bad[i:i + 1] * 3 + bad[i + 1:], sampling_params=SP, image_data=img)
    with pytest.raises(ValueError, match="processor_output"):
        eng.generate(prompt, SP, image_data={"format": "processor_output", "pixel_values": torch.zeros(1, 3, 28, 28)})
    assert eng.generate(prompt, SP, image_data=img)["output_ids"] == short["output_ids"]


def test_generate_df_image_column(llava, tmp_path):
    import pandas as pd

    _, eng = llava
    img = _image(60, 90, seed=7)
    path = tmp_path / "a.png"
    img.save(path)
    df = pd.DataFrame({"prompt": ["Caption this.", "Caption this.", "No image."], "image": [str(path), img, None]})
    out = nbgen.generate_df(df, "prompt", engine=eng, sampling_params=SP, image_column="image", progress=False)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Caption this."}]}]
    want = eng.generate(eng.apply_chat_template(msgs), SP, image_data=img)["text"]
    assert out["text"].tolist()[:2] == [want] * 2 and out["error"].tolist() == [None] * 3
