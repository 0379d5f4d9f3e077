"""LLaVA-1.5 and LLaVA-NeXT: images in, text out. Tiny random models (CLIP tower, Llama or Qwen2 decoder;
NeXT: anyres tiles and image_newline) built with transformers; fp32 greedy outputs token-identical to HF
``generate`` (one image, two images, a batch mixing text-only and image prompts, image spans split by
chunked prefill); tower + projector (+ NeXT's packing) within 1e-4 of HF's ``get_image_features``; the
prefix cache shares image KV by content hash only."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import nbgen
from nbgen.bench.tiny_vlm import make_tiny_llava

SP = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PER_IMAGE = 16          # LLaVA-1.5: (28 px / 7 px)^2 patches, CLS dropped
CHUNK = 16


def _image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module", params=["llama", "qwen2", "next_llama"])
def llava(request, tmp_path_factory):
    """(model dir, engine whose 16-token prefill chunks and 4-token pages cut through image spans);
    ``next_*``: LLaVA-NeXT."""
    family = request.param.replace("next_", "")
    d = make_tiny_llava(str(tmp_path_factory.mktemp(f"llava_{request.param}")), family,
                        anyres=request.param.startswith("next_"))
    eng = nbgen.Engine(d, dtype="float32", device="cpu", page_size=4, chunked_prefill_size=CHUNK, random_seed=0)
    yield d, eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(llava):
    import transformers as tf

    d, _ = llava
    model = tf.AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    return model, tf.AutoProcessor.from_pretrained(d)       # HF's LlavaProcessor: <image> expansion, CLIP pixels


def _prompt(eng, n_images: int, text: str = "Describe the image.") -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return eng.apply_chat_template([{"role": "user", "content": content}])


def _hf_inputs(proc, prompt: str, images: list) -> dict:
    """HF processor's input_ids (each <image> expanded to its slots), pixel_values (NeXT: image_sizes)."""
    x = proc(text=[prompt], images=images or None, return_tensors="pt")
    keys = ["input_ids"] + (["pixel_values", "image_sizes"] if images else [])
    return {k: x[k] for k in keys if k in x}


def _slots(hf_model, prompt: str, images: list) -> int:
    """Image slots HF's processor gives the prompt (NeXT: they depend on each image's size)."""
    return int((_hf_inputs(hf_model[1], prompt, images)["input_ids"] == hf_model[0].config.image_token_id).sum())


def _hf_generate(hf_model, tok, prompt: str, images: list, n: int = SP["max_new_tokens"]) -> list[int]:
    model, proc = hf_model
    kw = _hf_inputs(proc, prompt, images)
    ids = kw.pop("input_ids")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


def _ours(d: str):
    from nbgen.models.loader import iter_safetensors
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config

    cfg = prepare_config(read_model_config(d))
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(iter_safetensors(d))
    return cfg, ours


def test_tower_and_projector_match_hf(llava, hf_model):
    d, _ = llava
    model, proc = hf_model
    ims = [_image(40, 60, 1), _image(28, 28, 2), _image(90, 30, 3), _image(30, 120, 4), _image(130, 35, 5)]
    x = proc.image_processor(images=ims, return_tensors="pt")
    cfg, ours = _ours(d)
    assert len(ours.vision_tower.encoder.layers) == 2          # layer -2 of 3: the last one is never built
    if "image_sizes" not in x:                                 # LLaVA-1.5: 16 slots per image
        pv, grids, kw = x["pixel_values"], [(1, 1, PER_IMAGE)] * len(ims), {}
    else:                                                      # NeXT: the processor pads to the most tiles
        from nbgen.models.llava_next import next_layout

        lays = [next_layout(cfg, h, w) for h, w in x["image_sizes"].tolist()]
        assert any(lay.rows != (0, lay.tiles_h * lay.side) or lay.cols != (0, lay.tiles_w * lay.side)
                   for lay in lays)                            # some images lose letterbox rows or columns
        pv = torch.cat([p[:lay.num_tiles] for p, lay in zip(x["pixel_values"], lays)])
        grids = [(lay.num_tiles, h, w) for lay, (h, w) in zip(lays, x["image_sizes"].tolist())]
        kw = {"image_sizes": x["image_sizes"]}
    with torch.no_grad():
        ref = torch.cat(model.model.get_image_features(x["pixel_values"], **kw).pooler_output)
        got = ours.encode_images(pv, grids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_matches_hf(llava, hf_model, n_images):
    _, eng = llava
    ims = [_image(40 + 30 * i, 60, seed=10 + i) for i in range(n_images)]
    prompt = _prompt(eng, n_images)
    out = eng.generate(prompt, SP, image_data=ims if n_images > 1 else ims[0])
    assert out["output_ids"] == _hf_generate(hf_model, eng.tokenizer, prompt, ims)
    assert out["meta_info"]["image_tokens"] == _slots(hf_model, prompt, ims)
    assert out["meta_info"]["prompt_tokens"] == _hf_inputs(hf_model[1], prompt, ims)["input_ids"].shape[1]


def test_chunked_prefill_splits_image_spans(llava, hf_model):
    """Text before the image moves its 16 slots off the 16-token chunk grid: each image is split
    across two prefill chunks (and its 4-token pages), and the output still matches HF."""
    _, eng = llava
    ims = [_image(50, 50, seed=31), _image(30, 70, seed=32)]
    prompt = _prompt(eng, 2, "Now compare both pictures carefully.")
    ids = _hf_inputs(hf_model[1], prompt, ims)["input_ids"][0].tolist()
    first = ids.index(eng.hf_config.image_token_id)
    end = first
    while ids[end] == eng.hf_config.image_token_id:       # the first image's run (a newline follows it)
        end += 1
    assert first % CHUNK != 0 and (end - 1) // CHUNK > first // CHUNK
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


def test_prefix_cache_shares_by_image_hash(llava, hf_model):
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
    assert same["meta_info"]["cached_tokens"] >= start + _slots(hf_model, prompt, [a])   # the image's KV is reused
    assert other["meta_info"]["cached_tokens"] <= start                      # a different image shares none of it


def test_expanded_input_ids_and_refusals(llava, hf_model):
    """input_ids already expanded by the HF processor run as the one-token form; bad counts are refused
    with a ValueError and the engine keeps serving."""
    _, eng = llava
    img = _image(44, 66, seed=41)
    prompt = _prompt(eng, 1)
    short = eng.generate(prompt, SP, image_data=img)
    full = eng.generate(input_ids=_hf_inputs(hf_model[1], prompt, [img])["input_ids"][0].tolist(), sampling_params=SP,
                        image_data=img)
    assert full["output_ids"] == short["output_ids"]
    bare = eng.generate("Describe.", SP, image_data=img)                   # no placeholder: one prepended
    assert bare["meta_info"]["image_tokens"] == short["meta_info"]["image_tokens"]
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


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_sglang_offline_vlm_example_shape(llava, tmp_path):
    """SGLang's examples/runtime/engine/offline_batch_inference_vlm.py with the model path changed (a
    local file for its URL): LLaVA's image token inside a raw prompt."""
    import nbgen as sgl

    d, _ = llava
    path = tmp_path / "example_image.png"
    _image(64, 80, seed=9).save(path)
    image_token = "<image>"
    with sgl.Engine(model_path=d, device="cpu") as vlm:
        prompt = f"What's in this image?\n{image_token}"
        output = vlm.generate(prompt=prompt, image_data=str(path),
                              sampling_params={"temperature": 0.001, "max_new_tokens": 30})
    assert isinstance(output["text"], str) and output["meta_info"]["completion_tokens"] > 0
    assert output["meta_info"]["image_tokens"] > 0


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_sglang_token_in_token_out_vlm_example_shape(llava, hf_model, tmp_path):
    """SGLang's token_in_token_out_vlm.py: ids from the HF processor (image slots expanded), the image
    again as image_data, skip_tokenizer_init; the output ids equal HF's greedy ones."""
    from transformers import AutoProcessor

    from nbgen import Engine

    d, _ = llava
    path = tmp_path / "example_image.png"
    img = _image(50, 70, seed=8)
    img.save(path)
    processor = AutoProcessor.from_pretrained(d)
    inputs = processor(text=["<image>What is in this picture?"], images=[img], return_tensors="pt")
    input_ids = inputs.input_ids[0].tolist()
    with Engine(model_path=d, device="cpu", dtype="float32", skip_tokenizer_init=True) as backend:
        output = backend.generate(input_ids=input_ids, image_data=[str(path)], sampling_params=SP)
    assert output["output_ids"] == _hf_generate(hf_model, None, "<image>What is in this picture?", [img])


def test_older_checkpoint_layout_loads(llava):
    """Checkpoints saved before transformers 5: ``language_model.model.*``, ``language_model.lm_head.*``,
    ``vision_tower.*``, ``multi_modal_projector.*``; a checkpoint without the projector is refused."""
    from nbgen.models.loader import iter_safetensors
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config

    d, _ = llava
    cfg = prepare_config(read_model_config(d))
    new, old = get_model_class(cfg)(cfg), get_model_class(cfg)(cfg)
    new.load_weights(iter_safetensors(d))
    moves = [("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
             ("model.image_newline", "image_newline"),
             ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector.")]

    def renamed(name: str) -> str:
        for a, b in moves:
            if name.startswith(a):
                return b + name[len(a):]
        return name

    old.load_weights((renamed(n), t) for n, t in iter_safetensors(d))
    a, b = new.state_dict(), old.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="vision tensor"):
        get_model_class(cfg)(cfg).load_weights((n, t) for n, t in iter_safetensors(d) if "projector" not in n)
