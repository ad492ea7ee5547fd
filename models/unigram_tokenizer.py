"""A small Unigram (sentencepiece-like) fast tokenizer trained on a fixed corpus, for the tiny
checkpoints: metaspace pre-tokenizer, specials appended by a template, nothing downloaded.
Used by the tiny Wan recipe (T5 style) and the diffusion benchmark model (CLIP and T5 styles).
"""

from __future__ import annotations

from collections.abc import Sequence

_ALPHABET = list("abcdefghijklmnopqrstuvwxyz0123456789,.!?'-")


def train_unigram_tokenizer(
    corpus: Sequence[str],
    vocab_size: int,
    *,
    eos: str,
    pad: str,
    unk: str = "<unk>",
    bos: str | None = None,
    specials: Sequence[str] | None = None,
    lowercase: bool = False,
    collapse_double_spaces: bool = False,
    pair_template: bool = False,
    model_max_length: int = 512,
):
    """A `PreTrainedTokenizerFast`: "[bos] text eos" (and "text eos text eos" for pairs when
    `pair_template`), right padding. `specials` fixes the special tokens' ids by order
    (default: pad, eos, unk)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    norms = [normalizers.NFKC()]
    if collapse_double_spaces:
        norms.append(normalizers.Replace("  ", " "))
    if lowercase:
        norms.append(normalizers.Lowercase())
    tok.normalizer = normalizers.Sequence(norms)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials) if specials is not None else [pad, eos, unk],
        unk_token=unk,
        initial_alphabet=_ALPHABET,
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    marks = [(bos, tok.token_to_id(bos))] if bos is not None else []
    marks.append((eos, tok.token_to_id(eos)))
    head = f"{bos} " if bos is not None else ""
    template = {"single": f"{head}$A {eos}", "special_tokens": marks}
    if pair_template:
        template["pair"] = f"{head}$A {eos} $B {eos}"
    tok.post_processor = processors.TemplateProcessing(**template)
    kwargs = dict(pad_token=pad, eos_token=eos, unk_token=unk, model_max_length=model_max_length)
    if bos is not None:
        kwargs["bos_token"] = bos
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="right", **kwargs)
