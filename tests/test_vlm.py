"""Qwen2-VL / Qwen2.5-VL: images in, text out. Tiny random models built with transformers; fp32
greedy outputs token-identical to HF ``generate`` with the same images; vision tower within 1e-4;
the prefix cache shares image KV by content hash only; image_data forms and refusals."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

import nbgen
from nbgen.bench.tiny_vlm import make_tiny_vlm

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
SP = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
SIZES = [(60, 90), (120, 40), (56, 56), (100, 100)]


def _image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory):
    """(model dir, engine with small pages and chunks: image spans cross chunk and page edges)."""
    d = make_tiny_vlm(str(tmp_path_factory.mktemp(request.param)), request.param)
    eng = nbgen.Engine(d, dtype="float32", device="cpu", page_size=4, chunked_prefill_size=16, random_seed=0)
    yield d, eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(vlm):
    import transformers as tf

    d, _ = vlm
    model = tf.AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    return model, tf.AutoImageProcessor.from_pretrained(d)


def _prompt(eng, n_images: int, text: str = "Describe the image.") -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return eng.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)


def _hf_generate(hf_model, tok, prompt: str, images: list, n: int = SP["max_new_tokens"]) -> list[int]:
    model, proc = hf_model
    kw = {}
    if images:
        x = proc(images=images, return_tensors="pt")
        merge = model.config.vision_config.spatial_merge_size ** 2
        for g in x["image_grid_thw"].tolist():    # one placeholder at a time, in order
            prompt = prompt.replace("<|image_pad|>", "<|placeholder|>" * (g[0] * g[1] * g[2] // merge), 1)
        prompt = prompt.replace("<|placeholder|>", "<|image_pad|>")
        kw = {"pixel_values": x["pixel_values"], "image_grid_thw": x["image_grid_thw"]}
    ids = tok(prompt, return_tensors="pt").input_ids
    kw["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


def test_vision_tower_matches_hf(vlm, hf_model):
    d, eng = vlm
    model, proc = hf_model
    ims = [_image(h, w, i) for i, (h, w) in enumerate(SIZES)]
    x = proc(images=ims, return_tensors="pt")
    from nbgen.models.loader import iter_safetensors
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config

    cfg = prepare_config(read_model_config(d))
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(iter_safetensors(d))
    with torch.no_grad():
        ref = torch.cat(model.model.get_image_features(x["pixel_values"], x["image_grid_thw"]).pooler_output)
        got = ours.encode_images(x["pixel_values"], [tuple(g) for g in x["image_grid_thw"].tolist()])
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_matches_hf(vlm, hf_model, n_images):
    _, eng = vlm
    ims = [_image(*SIZES[i], seed=10 + i) for i in range(n_images)]
    prompt = _prompt(eng, n_images)
    out = eng.generate(prompt, SP, image_data=ims if n_images > 1 else ims[0])
    assert out["output_ids"] == _hf_generate(hf_model, eng.tokenizer, prompt, ims)
    grids = hf_model[1](images=ims, return_tensors="pt")["image_grid_thw"].tolist()
    assert out["meta_info"]["image_tokens"] == sum(t * h * w // 4 for t, h, w in grids)


def test_batch_mixing_text_and_images_matches_hf(vlm, hf_model):
    _, eng = vlm
    prompts = [_prompt(eng, 1, "What is this?"), _prompt(eng, 0, "Just text here."),
               _prompt(eng, 2, "Compare them."), _prompt(eng, 1, "Colours?")]
    images = [_image(*SIZES[0], seed=1), None, [_image(*SIZES[1], seed=2), _image(*SIZES[2], seed=3)],
              _image(*SIZES[3], seed=4)]
    outs = eng.generate(prompts, SP, image_data=images)
    for p, ims, o in zip(prompts, images, outs):
        want = _hf_generate(hf_model, eng.tokenizer, p, [] if ims is None else ims if isinstance(ims, list) else [ims])
        assert o["output_ids"] == want
        assert ("image_tokens" in o["meta_info"]) == (ims is not None)


def test_images_at_the_processor_size_match_hf(vlm, hf_model):
    """Images the processor keeps at their size (patches made on the device from their RGB bytes), alone,
    two per prompt of different sizes, and in one step with resized ones: token-identical to HF."""
    _, eng = vlm
    prompts = [_prompt(eng, 1, "What is this?"), _prompt(eng, 2, "Compare them."), _prompt(eng, 1, "Colours?"),
               _prompt(eng, 1, "Shapes?")]
    images = [_image(56, 56, seed=21), [_image(28, 84, seed=22), _image(56, 56, seed=23)], _image(60, 90, seed=24),
              _image(84, 56, seed=25)]
    outs = eng.generate(prompts, SP, image_data=images)
    for p, ims, o in zip(prompts, images, outs):
        assert o["output_ids"] == _hf_generate(hf_model, eng.tokenizer, p, ims if isinstance(ims, list) else [ims])


def test_text_tail_after_the_image_matches_hf(vlm, hf_model):
    """A long text after the image (chunks of 16): the chunks starting past the last image slot run as
    plain text on the ordinary path at positions p + rope_delta."""
    _, eng = vlm
    img = _image(*SIZES[0], seed=7)
    prompt = _prompt(eng, 1, "Describe the colours, the shapes and the texture of this picture. " * 4)
    out = eng.generate(prompt, SP, image_data=img)
    assert out["output_ids"] == _hf_generate(hf_model, eng.tokenizer, prompt, [img])


def test_prefix_cache_shares_by_image_hash(vlm):
    _, eng = vlm
    prompt = _prompt(eng, 1, "Tell me about this picture in a few words.")
    a, b = _image(56, 56, seed=21), _image(56, 56, seed=22)     # same size, different content
    eng.flush_cache()
    first = eng.generate(prompt, SP, image_data=a)
    same = eng.generate(prompt, SP, image_data=a)
    other = eng.generate(prompt, SP, image_data=b)
    assert same["output_ids"] == first["output_ids"]
    pair = eng.generate(prompt, {**SP, "n": 2}, image_data=a)          # n > 1: one prompt, two requests
    assert [o["output_ids"] for o in pair] == [first["output_ids"]] * 2
    assert same["meta_info"]["cached_tokens"] > first["meta_info"]["prompt_tokens"] // 2
    # the image starts after the template's first few tokens: a different image shares nothing past them
    start = eng.tokenizer(prompt).input_ids.index(eng.hf_config.image_token_id)
    assert other["meta_info"]["cached_tokens"] <= start


def test_batch_image_ids_come_in_order_and_key_the_cache(vlm):
    """A batch's image ids are hashed on a pool while its first requests already run: the same images
    share KV across calls, a different one shares nothing past the text before it, and the outputs
    equal those of the same prompts sent one by one (ids computed at once); the async path waits for
    the ids before the loop reads them."""
    import asyncio

    _, eng = vlm
    eng.flush_cache()
    prompt = _prompt(eng, 1, "What do you see here?")
    ims = [_image(56, 56, seed=70 + i) for i in range(5)]
    first = eng.generate([prompt] * 5, SP, image_data=ims)
    again = eng.generate([prompt] * 5, SP, image_data=ims[:4] + [_image(56, 56, seed=99)])
    start = eng.tokenizer(prompt).input_ids.index(eng.hf_config.image_token_id)
    for f, g in zip(first[:4], again[:4]):
        assert g["output_ids"] == f["output_ids"]
        assert g["meta_info"]["cached_tokens"] > f["meta_info"]["prompt_tokens"] // 2
    assert again[4]["meta_info"]["cached_tokens"] <= start
    eng.flush_cache()
    alone = [eng.generate(prompt, SP, image_data=im)["output_ids"] for im in ims]
    assert [o["output_ids"] for o in first] == alone
    eng.flush_cache()
    got = asyncio.run(eng.async_generate([prompt] * 5, SP, image_data=ims))
    assert [o["output_ids"] for o in got] == alone


def test_image_data_forms_agree(vlm, tmp_path):
    _, eng = vlm
    img = _image(60, 90, seed=5)
    path = tmp_path / "img.png"
    img.save(path)
    raw = path.read_bytes()
    b64 = base64.b64encode(raw).decode()
    prompt = _prompt(eng, 1)
    forms = [img, str(path), f"file://{path}", raw, b64, f"data:image/png;base64,{b64}"]
    outs = [eng.generate(prompt, SP, image_data=f)["output_ids"] for f in forms]
    assert all(o == outs[0] for o in outs)
    # a prompt without placeholders gets one per image in front
    bare = eng.generate("Describe.", SP, image_data=img)
    assert bare["meta_info"]["image_tokens"] > 0


def test_image_data_refusals(vlm, tiny_llama_dir):
    _, eng = vlm
    prompt = _prompt(eng, 1)
    img = _image(56, 56, seed=6)
    with pytest.raises(ValueError, match="could not fetch"):
        eng.generate(prompt, SP, image_data="http://127.0.0.1:9/none.png")
    with pytest.raises(ValueError, match="image placeholder"):
        eng.generate(prompt, SP, image_data=[img, img])
    with pytest.raises(ValueError, match="image_data"):
        eng.generate(prompt, SP, image_data="/no/such/file.png")
    with pytest.raises(ValueError, match="image_data"):
        eng.generate([prompt, prompt], SP, image_data=[img])
    with pytest.raises(ValueError, match="logprob_start_len"):
        eng.generate(prompt, SP, image_data=img, return_logprob=True, logprob_start_len=0)
    with pytest.raises(ValueError, match="session"):
        eng.generate(prompt, SP, image_data=img, session_params={"id": "nope"})
    buf = io.BytesIO(b"not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        eng.generate(prompt, SP, image_data=buf.getvalue())
    assert eng.generate(prompt, SP, image_data=img)["meta_info"]["completion_tokens"] == SP["max_new_tokens"]


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_text_model_refuses_images(tiny_engine):
    with pytest.raises(ValueError, match="vision-language"):
        tiny_engine.generate("hi", SP, image_data=_image(28, 28, seed=0))


def test_unsupported_vlm_architecture_is_named():
    from nbgen.models.model_config import ModelConfig
    from nbgen.models.registry import get_model_class

    with pytest.raises(ValueError, match="Qwen2_5_VLForConditionalGeneration"):
        get_model_class(ModelConfig({"architectures": ["Idefics3ForConditionalGeneration"]}))


def test_generate_df_image_column_and_thumbnails(vlm, tmp_path):
    import pandas as pd

    _, eng = vlm
    img = _image(60, 90, seed=7)
    path = tmp_path / "a.png"
    img.save(path)
    df = pd.DataFrame({"prompt": ["Caption this.", "Caption this.", "Caption this.", "No image.", "Caption this."],
                       "image": [str(path), img, path.read_bytes(), None, str(tmp_path / "missing.png")]})
    out = nbgen.generate_df(df, "prompt", engine=eng, sampling_params=SP, image_column="image", progress=False)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Caption this."}]}]
    want = eng.generate(eng.apply_chat_template(msgs), SP, image_data=img)["text"]
    assert out["text"].tolist()[:3] == [want] * 3
    assert out["error"].tolist()[:4] == [None] * 4 and out["text"][3]
    assert out["error"][4] is not None and "missing.png" in out["error"][4]
    page = nbgen.show_images(out, "image", size=32)._repr_html_()
    assert page.count("<img") == 3 and "unreadable image" in page and want.split()[0][:3] in page
    with pytest.raises(KeyError, match="image_column="):
        nbgen.generate_df(df, "prompt", engine=eng, image_column="photo")


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_vlm_bench_runs_on_cpu():
    from nbgen.bench.vlm import main

    res = main(["--tiny", "--device", "cpu", "--num-requests", "3", "--image-size", "56", "--output-len", "3",
                "--hf-requests", "2", "--hf-batch-size", "2", "--tower-batch", "2"])
    assert res["nbgen"]["out_tokens"] == 9 and res["hf"]["out_tokens"] == 6
    assert res["nbgen"]["image_tokens"] == 4 and 0 < res["vision"]["share_of_nbgen_time"]


def test_engine_info_on_a_vlm(vlm):
    import json

    _, eng = vlm
    json.dumps(eng.get_server_info(), default=str)
    info = eng.get_model_info()
    assert info is not None


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_sglang_offline_vlm_example_shape(vlm, tmp_path):
    """SGLang's examples/runtime/engine/offline_batch_inference_vlm.py with the model path changed (and a
    local file for its URL: no network here): the image token inside a raw prompt."""
    import nbgen as sgl

    d, _ = vlm
    path = tmp_path / "example_image.png"
    _image(64, 80, seed=9).save(path)
    image_token = "<|vision_start|><|image_pad|><|vision_end|>"
    with sgl.Engine(model_path=d, device="cpu") as vlm_engine:
        prompt = f"What's in this image?\n{image_token}"
        output = vlm_engine.generate(prompt=prompt, image_data=str(path),
                                     sampling_params={"temperature": 0.001, "max_new_tokens": 30})
    assert isinstance(output["text"], str) and output["meta_info"]["completion_tokens"] > 0
    assert output["meta_info"]["image_tokens"] > 0


def test_older_checkpoint_layout_loads(vlm):
    """Checkpoints saved before transformers 5 name the decoder ``model.*`` and the tower ``visual.*``."""
    from nbgen.models.loader import iter_safetensors
    from nbgen.models.model_config import read_model_config
    from nbgen.models.registry import get_model_class, prepare_config

    d, _ = vlm
    cfg = prepare_config(read_model_config(d))
    new, old = get_model_class(cfg)(cfg), get_model_class(cfg)(cfg)
    new.load_weights(iter_safetensors(d))
    renamed = ((n.replace("model.language_model.", "model.").replace("model.visual.", "visual."), t)
               for n, t in iter_safetensors(d))
    old.load_weights(renamed)
    a, b = new.state_dict(), old.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="vision tensor"):
        get_model_class(cfg)(cfg).load_weights((n, t) for n, t in iter_safetensors(d) if "merger" not in n)


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_preempted_image_requests_recompute_the_same_tokens(vlm):
    """A KV cache too small for the batch: requests are preempted mid-decode and recompute their prompt
    (the tower encodes again, positions straddle prompt and output) with the same greedy tokens."""
    d, eng = vlm
    prompts = [_prompt(eng, 1, f"Picture number {i}, describe it.") for i in range(4)]
    images = [_image(*SIZES[i % 4], seed=40 + i) for i in range(4)]
    sp = {**SP, "max_new_tokens": 24}
    want = [o["output_ids"] for o in eng.generate(prompts, sp, image_data=images)]
    with nbgen.Engine(d, dtype="float32", device="cpu", page_size=4, max_total_tokens=128,
                      chunked_prefill_size=16, disable_radix_cache=True) as small:
        outs = small.generate(prompts, sp, image_data=images)
    assert [o["output_ids"] for o in outs] == want
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0


def test_processor_output_format_as_sglang(vlm, hf_model):
    """SGLang's "processor output" form: input_ids with expanded placeholders and the HF processor's
    tensors in ``dict(..., format="processor_output")`` -> the same tokens as the image itself."""
    _, eng = vlm
    img = _image(60, 90, seed=31)
    prompt = _prompt(eng, 1, "What is this?")
    want = eng.generate(prompt, SP, image_data=img)["output_ids"]
    x = hf_model[1](images=[img], return_tensors="pt")
    n = int(x["image_grid_thw"].prod()) // 4
    ids = eng.tokenizer(prompt.replace("<|image_pad|>", "<|image_pad|>" * n)).input_ids
    out = eng.generate(input_ids=ids, sampling_params=SP, image_data=[dict(x, format="processor_output")])
    assert out["output_ids"] == want
    with pytest.raises(ValueError, match="precomputed_embedding"):
        eng.generate(input_ids=ids, sampling_params=SP, image_data=[{"format": "precomputed_embedding"}])


def test_stream_async_and_chat_take_images(vlm):
    import asyncio

    _, eng = vlm
    img = _image(56, 84, seed=51)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Stream it."}]}]
    prompt = eng.apply_chat_template(msgs)
    want = eng.generate(prompt, SP, image_data=img)
    chunks = list(eng.generate(prompt, SP, image_data=img, stream=True))
    assert "".join(c["text"] for c in chunks) == want["text"]
    got = asyncio.run(eng.async_generate(prompt, SP, image_data=img))
    assert got["output_ids"] == want["output_ids"]
    assert eng.chat(msgs, SP, image_data=img)["output_ids"] == want["output_ids"]
    assert [o["output_ids"] for _, o in eng.generate_iter([prompt], SP, image_data=[img])] == [want["output_ids"]]


@pytest.mark.filterwarnings("ignore:.*other nbgen Engine")
def test_auto_truncate_into_an_image_is_refused(vlm):
    d, _ = vlm
    img = _image(112, 112, seed=61)                      # 16 image tokens
    with nbgen.Engine(d, dtype="float32", device="cpu", context_length=16, allow_auto_truncate=True) as eng:
        with pytest.raises(ValueError, match="cuts into its image"):
            eng.generate("Describe.", {"max_new_tokens": 2}, image_data=img)
        assert eng.generate("Describe.", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1
