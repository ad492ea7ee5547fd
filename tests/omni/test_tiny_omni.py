"""The `tiny:qwen2_5_omni` recipes: a checkpoint transformers loads and runs end to end."""

from __future__ import annotations

import json

import torch


def test_special_ids_inside_vocabularies(omni_dir, omni_gqa_dir):
    from transformers import AutoTokenizer

    for path in (omni_dir, omni_gqa_dir):
        cfg = json.loads((path / "config.json").read_text())
        tok = AutoTokenizer.from_pretrained(str(path))
        thinker, talker = cfg["thinker_config"], cfg["talker_config"]
        vocab = thinker["text_config"]["vocab_size"]
        assert tok.audio_token_id == thinker["audio_token_index"] < vocab
        assert tok.convert_tokens_to_ids(tok.image_token) == thinker["image_token_index"]
        for key in ("tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id"):
            assert 0 <= talker[key] < vocab
        for key in ("tts_codec_start_token_id", "tts_codec_end_token_id", "tts_codec_pad_token_id"):
            assert 0 <= talker[key] < talker["vocab_size"]
        assert cfg["token2wav_config"]["dit_config"]["num_embeds"] >= talker["vocab_size"]
        voices = torch.load(path / "spk_dict.pt", weights_only=True)
        assert set(voices) == {"Chelsie", "Ethan"}
        assert all(0 <= v["bos_token"] < vocab for v in voices.values())


def test_gqa_variant_differs_where_tests_need_it(omni_dir, omni_gqa_dir):
    base = json.loads((omni_dir / "config.json").read_text())["thinker_config"]["text_config"]
    gqa = json.loads((omni_gqa_dir / "config.json").read_text())["thinker_config"]["text_config"]
    assert base["num_key_value_heads"] == base["num_attention_heads"]
    assert gqa["num_attention_heads"] == 4 * gqa["num_key_value_heads"]
    assert base["rope_parameters"]["mrope_section"] != gqa["rope_parameters"]["mrope_section"]


def test_transformers_generates_text_and_a_non_trivial_waveform(omni_dir, omni_ref):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(omni_dir))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hello, how are you?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, return_tensors="pt").input_ids
    talker = omni_ref.talker
    torch.manual_seed(0)
    with torch.no_grad():
        seq, wav = omni_ref.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            speaker="Ethan",
            thinker_max_new_tokens=8,
            thinker_do_sample=False,
            talker_max_new_tokens=8,
            talker_eos_token_id=[talker.codec_pad_token, talker.config.tts_codec_end_token_id],
        )
    reply = seq[0, ids.shape[1] :].tolist()
    assert len(reply) >= 2 and len(set(reply)) >= 2
    assert wav.ndim == 1 and wav.numel() > 0 and torch.isfinite(wav).all()
    assert wav.abs().max() > 1e-2  # not the near-silent output of the default small init
