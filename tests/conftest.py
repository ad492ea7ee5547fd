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


# Servers more than one folder talks to without changing them: started once per session (each
# start costs seconds of imports and engine builds), stopped when the session ends.


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """`omnistage serve` as `make run` starts it: every shipped configs/tiny-*.yaml (tiny-llm,
    tiny-image, tiny-image-previews, tiny-video, tiny-diamond, tiny-omni) behind HTTP, no API
    key, jobs in a temporary folder; for every test that sends it requests and leaves the
    server as it found it."""
    from omnistage.tests.api.conftest import live_server

    with live_server(tmp_path_factory, [], timeout=600) as server:
        yield server


@pytest.fixture(scope="session")
def omni_server(tiny_server):
    """tiny-omni behind HTTP (chat with audio, speech, audio outputs, jobs): the shared server."""
    return tiny_server
