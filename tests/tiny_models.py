"""Tiny random models built with transformers (fp32) and saved with save_pretrained, plus a tokenizer."""
from __future__ import annotations

import os

import torch

_CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Hello, my name is nbgen and I generate text in notebooks.",
    "def add(a, b):\n    return a + b\n",
    "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9, \u65e5\u672c\u8a9e, emoji \U0001F600 \U0001F680.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation !?.,;:'\"()[]{}",
]


def make_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained in memory (no hub), with a chat template and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


def make_tiny_model(family: str, path: str, vocab_size: int = 384, **overrides) -> str:
    """Save a tiny random fp32 model of ``family`` ('llama' | 'llama3' | 'qwen2' | 'qwen3') with a tokenizer."""
    import transformers as tf

    tok = make_tokenizer(vocab_size)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    common.update(overrides)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "llama3":
        common["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(tie_word_embeddings=True, **common), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = tf.Qwen3Config(head_dim=32, **common), tf.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    # random init is small; widen the logits so greedy choices are not near-ties
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
