"""M-RoPE with 3-D positions, inputs_embeds prompts and hidden-state output against the
transformers Qwen2.5-Omni thinker (loaded from an Omni-layout checkpoint via weight_prefix)."""

from __future__ import annotations

import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import OMNI_TOKENS, assert_pool_full, run_to_completion

NEW = 6


def _image_prompt(n_text_before: int, n_text_after: int, grid: tuple[int, int, int]) -> torch.Tensor:
    t, h, w = grid
    n_img = t * h * w // 4  # spatial_merge_size 2
    ids = list(range(10, 10 + n_text_before)) + [OMNI_TOKENS["vision_start_token_id"]]
    ids += [OMNI_TOKENS["image_token_index"]] * n_img + [OMNI_TOKENS["vision_end_token_id"]]
    ids += list(range(200, 200 + n_text_after))
    return torch.tensor([ids])


def test_mrope_inputs_embeds_hidden_states_match_transformers(omni_thinker):
    path, hf = omni_thinker
    g = torch.Generator().manual_seed(0)
    cases = []
    for before, after, grid in [(3, 4, (1, 4, 4)), (20, 30, (2, 8, 6)), (1, 2, (1, 4, 8))]:
        ids = _image_prompt(before, after, grid)
        mask = torch.ones_like(ids)
        grid_t = torch.tensor([grid])
        pos, delta = hf.model.get_rope_index(ids, image_grid_thw=grid_t, attention_mask=mask)
        assert int(delta) != 0 and not torch.equal(pos[0], pos[1])  # really 3-D positions
        embeds = hf.get_input_embeddings()(ids).detach().clone()
        img = ids[0] == OMNI_TOKENS["image_token_index"]
        embeds[0, img] = torch.randn(int(img.sum()), embeds.shape[-1], generator=g) * 0.5  # "vision features"
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                inputs_embeds=embeds,
                attention_mask=mask,
                image_grid_thw=grid_t,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                output_hidden_states=True,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        lps = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens)]
        n_layers = len(out.hidden_states[0]) - 1
        # hidden states of every processed position: the prompt, then each fed-back token
        hs = {i: torch.cat([step[i][0] for step in out.hidden_states], dim=0) for i in range(n_layers + 1)}
        cases.append((embeds[0], pos[:, 0], tokens, lps, hs))
    assert len({t for c in cases for t in c[2]}) >= 8  # diverse reference

    engine = LLMEngine(
        EngineConfig(
            model_path=path, weight_prefix="thinker.", hidden_state_layers=(0, 1, -1), max_num_batched_tokens=24
        )
    )
    assert engine.model_config.uses_mrope
    for i, (emb, pos, *_rest) in enumerate(cases):
        engine.add_request(
            f"m{i}",
            None,
            SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1),
            inputs_embeds=emb,
            position_ids=pos,
        )
    # A plain token prompt in the same batch (1-D positions on all three axes).
    engine.add_request("text", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    results = run_to_completion(engine)
    for i, (emb, _pos, tokens, lps, hs) in enumerate(cases):
        got = results[(f"m{i}", 0)]
        assert got["tokens"] == tokens
        for step, tok in enumerate(tokens):
            assert abs(got["logprobs"][step][tok] - lps[step]) < 1e-4
        chunks = [o.hidden_states for o in got["outputs"] if o.hidden_states is not None]
        for layer, ref_idx in [(0, 0), (1, 1), (-1, 2)]:
            ours = torch.cat([c[layer] for c in chunks], dim=0)
            # the last sampled token is never fed back, so it has no hidden state
            assert ours.shape == hs[ref_idx].shape == (emb.shape[0] + NEW - 1, emb.shape[1])
            torch.testing.assert_close(ours, hs[ref_idx], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        ref_text = hf.generate(
            input_ids=torch.tensor([[5, 6, 7, 8, 9]]),
            attention_mask=torch.ones(1, 5, dtype=torch.long),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    assert results[("text", 0)]["tokens"] == ref_text[0, 5:].tolist()
    assert_pool_full(engine)
