"""What the server does for a pipeline before it reports ready (serving/warmup.py): the output
encoders' imports and the checkpoint limits, so that no request in flight waits for them."""

import json
import subprocess
import sys

SCRIPT = """
import json, sys
from omnistage.graph.loader import load_pipeline
from omnistage.serving.warmup import warm_serving
from omnistage.stages.diffusion import limits

PLUGINS = ("PIL.PngImagePlugin", "PIL.JpegImagePlugin", "PIL.WebPImagePlugin")
spec = load_pipeline("tiny-image")
before = [m for m in PLUGINS if m in sys.modules]
warm_serving(spec)
print(json.dumps({
    "before": before,
    "after": [m for m in PLUGINS if m in sys.modules],
    "limits": {key[0]: value is not None for key, value in limits._STAGE_LIMITS.items()},
}))
"""


def test_an_image_pipeline_is_warmed_before_ready():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] == []  # loading the pipeline file alone imports no encoder
    assert seen["after"] == ["PIL.PngImagePlugin", "PIL.JpegImagePlugin", "PIL.WebPImagePlugin"]
    # the size limits a queued job is checked against, read from the tiny checkpoint's files
    assert seen["limits"] == {"text_encoder": True, "denoiser": True}
