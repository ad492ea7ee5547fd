"""The step engine's aging bound is a denoiser stage param, validated when the YAML loads."""

import pytest

from omnistage.graph.loader import PipelineValidationError, load_pipeline_text
from omnistage.stages.diffusion.denoiser import DenoiserStage

YAML = """\
name: aging
inputs: {prompt: text}
outputs: {image: image}
stages:
  enc: {kind: text_encoder, model: tiny:tiny-sd3}
  den:
    kind: denoiser
    model: tiny:tiny-sd3
    batching: {policy: step, max_batch_size: 4}
    params: {aging_factor: AGING}
  vae: {kind: vae_decoder, model: tiny:tiny-sd3}
edges:
  - {from: inputs.prompt, to: enc.prompt}
  - {from: enc.prompt_embeds, to: den.prompt_embeds}
  - {from: enc.pooled_prompt_embeds, to: den.pooled_prompt_embeds}
  - {from: den.latents, to: vae.latents}
  - {from: vae.image, to: outputs.image}
"""


def test_negative_aging_factor_is_a_positioned_yaml_error():
    with pytest.raises(PipelineValidationError) as err:
        load_pipeline_text(YAML.replace("AGING", "-1"), "aging.yaml")
    assert any(
        p.startswith("aging.yaml:10:") and "aging_factor must be a number >= 0" in p for p in err.value.problems
    ), err.value.problems


def test_aging_factor_reaches_the_step_engine(sd3_dir, make_ctx_fn):
    spec = load_pipeline_text(YAML.replace("AGING", "1.5"), "aging.yaml")
    stage = DenoiserStage(make_ctx_fn("denoiser", sd3_dir, params=spec.stages["den"].params, max_batch_size=4))
    assert stage.engine.aging_factor == 1.5
