"""The AR engine's per-sequence hooks the talker uses, against transformers' logits processors:
tokens that are never sampled (suppress_tokens) and a codec prompt that counts for the
repetition penalty although the prompt was given as embeddings."""

from __future__ import annotations

import torch

from omnistage.stages.ar.config import SamplingParams
from omnistage.stages.ar.sampler import Sampler
from omnistage.stages.ar.sequence import Sequence


def test_suppressed_and_prompt_penalty_ids_match_transformers_processors():
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor

    g = torch.Generator().manual_seed(0)
    vocab, prompt_len = 40, 6
    codec_prompt = [30] * (prompt_len - 2) + [31, 32]  # mask * n, pad, bos
    outputs = [3, 7, 3, 12]
    logits = torch.randn(1, vocab, generator=g) * 3
    logits[0, 32] = 50.0  # the suppressed id would win otherwise
    seq = Sequence(
        request_id="r",
        index=0,
        token_ids=[0] * prompt_len + outputs,
        num_prompt_tokens=prompt_len,
        sampling=SamplingParams(temperature=0, repetition_penalty=1.3),
        arrival=0,
        prompt_embeds=torch.zeros(prompt_len, 4),
        suppress_token_ids=(32,),
        prompt_penalty_ids=codec_prompt,
    )
    ours = Sampler(eos_token_ids=()).penalized(logits, [seq])
    hf = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), SuppressTokensLogitsProcessor([32])])
    expected = hf(torch.tensor([codec_prompt + outputs]), logits.clone())
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert Sampler(eos_token_ids=())(logits, [seq]).token_ids[0] == int(expected.argmax())
