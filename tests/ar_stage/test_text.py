"""Tokenizer, chat template, incremental detokenization and stop strings against transformers."""

import random

import pytest

from omnistage.errors import InvalidRequestError
from omnistage.models.tiny_llm import _CORPUS
from omnistage.stages.ar.text import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    OutputText,
    StopStringMatcher,
    normalize_stop,
)

MULTIBYTE = "你好世界机器学习こんにちは안녕하세요Привет€£¥∑∫√😀😂🎉🚀🤖🔥👨‍👩‍👧‍👦éñüß"


def _random_text(rng: random.Random, n: int) -> str:
    chars = sorted(set(_CORPUS)) + list(MULTIBYTE) * 3
    return "".join(rng.choice(chars) for _ in range(n))


def _stream(detok: IncrementalDetokenizer, ids, rng: random.Random):
    deltas, i = [], 0
    while i < len(ids):
        k = rng.choice([1, 1, 1, 2, 3])
        deltas.append(detok.push(ids[i : i + k]))
        i += k
    return deltas


def test_encode_and_chat_template_match_transformers(text_tokenizer, hf_tokenizer):
    rng = random.Random(1)
    for _ in range(200):
        s = _random_text(rng, rng.randint(0, 60))
        assert text_tokenizer.encode(s) == hf_tokenizer(s)["input_ids"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello 你好 😀"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Again"},
    ]
    for msgs in (messages, messages[1:2]):
        ref = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert text_tokenizer.apply_chat_template(msgs) == ref
        ref_ids = hf_tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert text_tokenizer.encode_chat(msgs) == list(ref_ids)
    # text-only content parts are joined into a plain string before templating
    parts = [{"role": "user", "content": [{"type": "text", "text": "Ag"}, {"type": "text", "text": "ain"}]}]
    assert text_tokenizer.apply_chat_template(parts) == text_tokenizer.apply_chat_template(messages[3:])
    assert set(text_tokenizer.eos_token_ids) == {
        hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),
        hf_tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    with pytest.raises(InvalidRequestError):
        text_tokenizer.encode_chat([{"content": "no role"}])


def test_tokenizer_splits_multibyte_characters(text_tokenizer, hf_tokenizer):
    """The test vocabulary must really cut characters across tokens, or the next test is moot."""
    ids = hf_tokenizer(MULTIBYTE)["input_ids"]
    partial = [t for t in ids if REPLACEMENT_CHAR in hf_tokenizer.decode([t])]
    assert len(partial) >= 10


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_detokenizer_valid_text(text_tokenizer, hf_tokenizer, skip_special):
    rng = random.Random(7 + skip_special)
    for _ in range(300):
        text = _random_text(rng, rng.randint(1, 50))
        ids = hf_tokenizer(text)["input_ids"]
        if rng.random() < 0.3:  # special tokens between characters and at the end
            cut = len(text) // 2
            ids = hf_tokenizer(text[:cut])["input_ids"] + [1] + hf_tokenizer(text[cut:])["input_ids"] + [2]
        reference = hf_tokenizer.decode(ids, skip_special_tokens=skip_special)
        detok = IncrementalDetokenizer(text_tokenizer, skip_special_tokens=skip_special)
        deltas = _stream(detok, ids, rng)
        assert all(REPLACEMENT_CHAR not in d for d in deltas), (text, deltas)
        deltas.append(detok.flush())
        assert "".join(deltas) == reference
        assert detok.text == reference


def test_incremental_detokenizer_random_ids(text_tokenizer, hf_tokenizer):
    """Arbitrary token ids (broken UTF-8 included): every prefix is final, the end is exact."""
    rng = random.Random(3)
    vocab = len(hf_tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        skip = rng.random() < 0.5
        reference = hf_tokenizer.decode(ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(text_tokenizer, skip_special_tokens=skip)
        released = ""
        for delta in _stream(detok, ids, rng):
            released += delta
            assert reference.startswith(released)
        released += detok.flush()
        assert released == reference


def test_stop_matcher_against_str_find():
    rng = random.Random(11)
    alphabet = "ab c😀é"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        hits = [text.find(s) for s in stops if s in text]
        expected = text[: min(hits)] if hits else text
        matcher = StopStringMatcher(stops)
        out, i, stopped = "", 0, False
        while i < len(text) and not stopped:
            k = rng.randint(1, 4)
            piece, stopped = matcher.push(text[i : i + k])
            out += piece
            assert expected.startswith(out)  # nothing later cut was ever released
            i += k
        if not stopped:
            out += matcher.flush()
        assert stopped == bool(hits)
        assert out == expected


def test_stop_string_across_token_boundaries(text_tokenizer, hf_tokenizer):
    text = "Once upon a time, in a small village by the sea, there lived 你好世界 an old fisherman."
    ids = hf_tokenizer(text)["input_ids"]
    for stop in ["small village", "a time", "界 an", "fisherman.", "好世", "lived 你"]:
        # the stop string must straddle tokens for this to test anything
        assert not any(stop in hf_tokenizer.decode([t]) for t in ids)
        out = OutputText(text_tokenizer, stops=[stop, "never appears"])
        released, stopped = "", False
        for t in ids:
            delta = out.push([t])
            released += delta.text
            if delta.stopped:
                stopped = True
                break
        assert stopped
        assert released == text[: text.find(stop)]
        assert stop not in released


def test_output_text_without_stop_releases_held_tail(text_tokenizer, hf_tokenizer):
    text = "the end is nea"
    ids = hf_tokenizer(text)["input_ids"]
    out = OutputText(text_tokenizer, stops=["near!"])
    released = "".join(out.push([t]).text for t in ids)
    assert released == "the end is "  # "nea" may still become "near!"
    final = out.finish()
    assert not final.stopped
    assert released + final.text == text


def test_normalize_stop():
    assert normalize_stop(None) == []
    assert normalize_stop("x") == ["x"]
    assert normalize_stop(["a", "", "b"]) == ["a", "b"]
    with pytest.raises(InvalidRequestError):
        normalize_stop([1])
