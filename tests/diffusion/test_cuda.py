"""configs/tiny-image.yaml with all three stages on a CUDA device, through real worker
processes, against the diffusers pipeline run on the same device in this process. Runs only
where torch sees a CUDA device.

Both sides draw the initial noise from a CPU generator with the request's seed, then move it
to the GPU, so they start from the same latents. They are not bit-equal: cuDNN may use TF32 for
convolutions (the VAE) on both sides, and the engine batches the guidance rows its own way,
so the tolerance is 1e-3 on [0, 1] pixels (ten times the CPU tests'); the sensitivity check
shows a different seed moves the image by far more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.stages.diffusion import stage_params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOL = 1e-3
GEN = dict(height=32, width=32, max_sequence_length=24, guidance_scale=4.0, num_inference_steps=4)
PROMPT = "a photo of a cat sitting on a red chair"


def _diffusers_on_cuda(model_dir, seed: int) -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator("cpu").manual_seed(seed)
    return pipe(PROMPT, generator=gen, output_type="np", **GEN).images


def test_tiny_image_on_cuda_equals_diffusers_on_cuda(sd3_dir):
    from omnistage import Pipeline

    on_gpu = [f"stages.{s}.pool.devices=[cuda:0]" for s in ("text_encoder", "denoiser", "vae")]
    with Pipeline.from_yaml("tiny-image", overrides=on_gpu) as pipe:
        params = stage_params(pipe, dict(GEN, seed=7, output_type="float"))
        image = pipe.run({"prompt": PROMPT}, params, timeout=300)["image"]
        image = image.cpu().numpy()
    ref = _diffusers_on_cuda(sd3_dir, 7)
    assert image.shape == ref.shape
    assert float(image.std()) > 0.02  # real spread, not a flat image
    err = float(np.abs(image - ref).max())
    assert err <= TOL, f"max |omnistage - diffusers| on cuda = {err}"
    # sensitivity: another seed's reference is far outside the tolerance
    assert float(np.abs(_diffusers_on_cuda(sd3_dir, 8) - ref).max()) > 10 * TOL
