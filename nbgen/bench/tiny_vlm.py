"""A tiny random Qwen2-VL / Qwen2.5-VL or LLaVA checkpoint built with transformers: config, fp32 weights,
a byte-level BPE tokenizer trained in memory with the vision tokens and a chat template that places
images, and the image processor (PIL backend). No hub access: the notebook, the benchmark's CPU
smoke run and the tests build one in a directory. Its outputs are random text from random weights.
"""
from __future__ import annotations

import os
from typing import Any

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_CORPUS = ["A photo of a red square on a white background.", "The cat sat on the mat in the sun.",
           "Describe the image: colours, shapes and text.", "{\"colour\": \"blue\", \"shape\": \"circle\"}",
           "Numbers 0 1 2 3 4 5 6 7 8 9, punctuation !?.,;:'\"()[]{}"]
# Qwen2-VL's template shape: a content list of {"type": "image"} / {"type": "text", "text": ...} parts
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_vlm_tokenizer(vocab_size: int = 320, extra: tuple[str, ...] = ()) -> Any:
    """Byte-level BPE with <|endoftext|>, <|im_start|>, <|im_end|>, the vision tokens and ``extra``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + VISION_TOKENS + list(extra)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=VISION_TOKENS + list(extra))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_vlm(path: str, family: str = "qwen2_vl", seed: int = 0, max_pixels: int = 28 * 28 * 16,
                  min_pixels: int = 28 * 28, **text_overrides: Any) -> str:
    """Save a tiny random fp32 ``family`` ('qwen2_vl' | 'qwen2_5_vl') model with tokenizer and image
    processor into ``path``; images are resized to [min_pixels, max_pixels] (4 to 16 image tokens)."""
    import transformers as tf

    tok = make_vlm_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0,
                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    text.update(text_overrides)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2)
        cfg_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        # window 56 px = 2x2 merged tokens per window; block 1 attends over the whole image
        vision = dict(depth=3, hidden_size=32, out_hidden_size=text["hidden_size"], intermediate_size=48,
                      num_heads=2, window_size=56, fullatt_block_indexes=[1])
        cfg_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    else:
        raise ValueError(f"family must be 'qwen2_vl' or 'qwen2_5_vl', got {family!r}")
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    with torch.no_grad():   # random init is small; widen so greedy choices are not near-ties
        for name, p in model.named_parameters():
            if p.dim() == 2 and "visual" not in name:
                p.mul_(3.0)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    tf.Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(path)
    return path


def make_tiny_llava(path: str, text_family: str = "llama", seed: int = 0, image_size: int = 28,
                    patch_size: int = 7, anyres: bool = False, **text_overrides: Any) -> str:
    """Save a tiny random fp32 LLaVA-1.5 (CLIP tower, feature layer -2, CLS dropped, GELU projector,
    ``text_family`` 'llama' | 'qwen2' decoder) with tokenizer (``<image>`` token, Qwen-style chat
    template), CLIP image processor and LlavaProcessor into ``path``: (image_size / patch_size)^2 = 16
    tokens per image. ``anyres``: LLaVA-NeXT instead (tiles on 1x2, 2x1 and 2x2 grids, image_newline)."""
    import transformers as tf

    tok = make_vlm_tokenizer(extra=("<image>",))
    tok.chat_template = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>\n")
    if text_family not in ("llama", "qwen2"):
        raise ValueError(f"text_family must be 'llama' or 'qwen2', got {text_family!r}")
    text = dict(model_type=text_family, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_theta=10000.0, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                pad_token_id=tok.pad_token_id)
    text.update(text_overrides)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=image_size, patch_size=patch_size, projection_dim=32)
    image_id = tok.convert_tokens_to_ids("<image>")
    pins = [[image_size, 2 * image_size], [2 * image_size, image_size], [2 * image_size, 2 * image_size]]
    if anyres:
        cfg = tf.LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=image_id,
                                 image_grid_pinpoints=pins, tie_word_embeddings=False)
    else:
        cfg = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_id,
                             image_seq_length=(image_size // patch_size) ** 2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = (tf.LlavaNextForConditionalGeneration if anyres else tf.LlavaForConditionalGeneration)(cfg)
    model = model.to(torch.float32).eval()
    with torch.no_grad():   # as make_tiny_vlm: widen the decoder so greedy choices are not near-ties
        for name, p in model.named_parameters():
            if p.dim() == 2 and "vision_tower" not in name:
                p.mul_(3.0)
            if name.endswith("image_newline"):
                p.normal_()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    sizes = dict(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    proc = tf.LlavaNextImageProcessorPil(image_grid_pinpoints=pins, **sizes) if anyres else \
        tf.CLIPImageProcessorPil(**sizes)
    proc.save_pretrained(path)
    (tf.LlavaNextProcessor if anyres else tf.LlavaProcessor)(image_processor=proc, tokenizer=tok, patch_size=patch_size, num_additional_image_tokens=1,
                      vision_feature_select_strategy="default", chat_template=tok.chat_template).save_pretrained(path)
    return path
