"""Recipe `tiny-llm`: a tiny random-weight Qwen2-architecture chat model, built locally.

The tokenizer is a byte-level BPE trained here with the `tokenizers` library on a small
built-in corpus (English, code, accented Latin, CJK, emoji), so multi-byte characters are
often split across several tokens: exactly the case incremental detokenization must handle.
Special tokens and the chat template follow Qwen's (`<|im_start|>role\n...<|im_end|>\n`).

Weights use initializer_range 0.3 so greedy output is diverse instead of collapsing onto
a few repeated tokens (which would hide KV-cache and RoPE bugs).

`build_qwen2_checkpoint` is reused by the AR benchmark and tests for other model shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnistage.models.recipes import register_recipe

SEED = 1234

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
QWEN_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Qwen's chat template, minus tool calling: an optional leading system message, then turns.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
The pipeline streams text, audio and images; every stage batches requests on its own device.
Hello, world! How are you today? I am fine, thank you. What would you like to talk about?
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i * 2))
import torch\nx = torch.randn(4, 8)\ny = x @ x.T\nprint(y.shape)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 -17 +23 1e-6
Café, naïve, résumé, façade, jalapeño, Müller, Straße, Ærø, smörgåsbord, crème brûlée.
Привет, как дела? Всё хорошо, спасибо. Москва — столица России.
Γειά σου κόσμε. Αλφα, βήτα, γάμμα, δέλτα.
你好，世界！今天天气很好。我们一起去公园散步吧。机器学习和人工智能正在改变世界。
こんにちは、世界。私は学生です。東京は日本の首都です。ありがとうございます。
안녕하세요, 세계! 만나서 반갑습니다. 감사합니다.
مرحبا بالعالم. שלום עולם. नमस्ते दुनिया।
Emoji: 😀 😂 🎉 🚀 ❤️ 👍 🌍 🐍 🤖 🔥 ✨ 👨‍👩‍👧‍👦 🇯🇵 🏳️‍🌈
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π θ λ μ ± × ÷ → ⇒ ∀ ∃ ∈ ∉
Quotes: “double” ‘single’ «guillemets» — en–dash … ellipsis • bullet © ® ™ € £ ¥
User: Please summarise the following article in three sentences.
Assistant: Sure! Here is a short summary of the article you provided.
The model generates one token at a time, reusing the keys and values it cached before.
Paged attention stores the cache in fixed-size blocks, so memory is not wasted on padding.
"""


def train_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the built-in corpus (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # The same normalizer / pre-tokenizer pipeline as Qwen2's tokenizer.json, so transformers'
    # Qwen2Tokenizer (which rebuilds that pipeline around our vocab and merges) agrees with it.
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.strip().splitlines() if line]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    return tok


def save_tokenizer(out_dir: Path, vocab_size: int = 1024):
    """Train and save the tokenizer with transformers' save_pretrained; returns it (HF fast)."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def build_qwen2_checkpoint(
    out_dir: Path,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.3,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    seed: int = SEED,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Random-weight Qwen2ForCausalLM saved with save_pretrained (safetensors)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id, do_sample=False)
    model.save_pretrained(str(out_dir))


@register_recipe("tiny-llm", version="1")
def build(out_dir: Path) -> None:
    tok = save_tokenizer(out_dir)
    vocab = len(tok)
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    endoftext, im_end = ids[0], ids[2]
    build_qwen2_checkpoint(
        out_dir,
        vocab_size=vocab,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.3,
        eos_token_id=[im_end, endoftext],
        pad_token_id=endoftext,
    )
    (out_dir / "omnistage_recipe.json").write_text(json.dumps({"recipe": "tiny-llm", "seed": SEED}))
