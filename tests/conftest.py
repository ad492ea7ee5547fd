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
    """`omnistage serve tiny-llm tiny-image tiny-image-previews tiny-video tiny-diamond`: the
    shipped tiny pipelines behind HTTP, for every test that sends them requests and leaves the
    server as it found it."""
    from omnistage.tests.serving.conftest import start_server

    args = ["tiny-llm", "tiny-image", "tiny-image-previews", "tiny-video", "tiny-diamond"]
    server = start_server(args, tmp_path_factory.mktemp("serve-tiny") / "server.log")
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def omni_server(tmp_path_factory):
    """`omnistage serve tiny-omni` (no API key, jobs in a temporary folder): chat with audio,
    speech, audio outputs and jobs, for the tests that only send it requests."""
    from omnistage.tests.api.conftest import live_server

    with live_server(tmp_path_factory, ["tiny-omni"], timeout=600) as server:
        yield server
