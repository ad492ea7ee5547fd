"""Suite-wide settings. Area fixtures live in tests/<area>/conftest.py."""

import os

# Triton reads TRITON_INTERPRET when a kernel is defined; any test module may import a kernel
# module while the suite is collected, so the interpreter is chosen before anything else loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests run many worker processes on a 2-core machine: keep the test process itself lean.
torch.set_num_threads(int(os.environ.get("OMNISTAGE_TEST_THREADS", "1")))


@pytest.fixture
def png_colors():
    """Reads a PNG back with Pillow: checks that it decodes and returns its set of RGB colours
    (the benchmark plots are checked for the colour of every series they must draw)."""
    from PIL import Image, ImageColor

    def read(path) -> set[tuple[int, int, int]]:
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            assert img.format == "PNG" and img.width > 100 and img.height > 100
            rgb = img.convert("RGB")
            return {color for _, color in rgb.getcolors(maxcolors=rgb.width * rgb.height)}

    read.rgb = ImageColor.getrgb
    return read
