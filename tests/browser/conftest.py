"""Headless Chromium (Debian's chromium + chromedriver, driven by selenium) on the demo page
of one live `omnistage serve tiny-image tiny-video tiny-omni` that requires an API key (so
every test also covers how the page sends it), with a fake microphone fed from a speech file.

Set OMNISTAGE_DEMO_SCREENSHOTS=DIR to have the tests save each tab's screenshot there
(docs/img holds the committed ones: demo-talk.png, demo-jobs.png)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from omnistage.tests.serving.conftest import ServerProcess, start_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SPEECH = Path(__file__).parent.parent / "fixtures" / "speech-browser.wav"
SCREENSHOTS_ENV = "OMNISTAGE_DEMO_SCREENSHOTS"
API_KEY = "sk-browser-demo-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1100,800",
    "--autoplay-policy=no-user-gesture-required",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
]


def _require_chromium() -> None:
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            pytest.skip(f"{path} is missing: the browser tests need Debian's chromium and chromium-driver")


@pytest.fixture
def open_browser(tmp_path) -> Iterator[Callable[..., object]]:
    """open_browser(fake_audio=None) -> a selenium Chrome driver, quit after the test. With
    `fake_audio` the fake microphone plays that WAV file once, then silence."""
    _require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    drivers = []

    def open_(fake_audio: Path | None = None):
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={tmp_path / f'profile-{len(drivers)}'}")
        if fake_audio is not None:
            options.add_argument(f"--use-file-for-fake-audio-capture={fake_audio}%noloop")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        drivers.append(driver)
        return driver

    yield open_
    for driver in drivers:
        driver.quit()


def page_state(driver, expression: str = "window.demo"):
    return driver.execute_script(f"return {expression};")


def console_log(driver) -> str:
    try:
        return "\n".join(entry["message"] for entry in driver.get_log("browser"))
    except Exception:  # noqa: BLE001 - only for failure messages
        return "(no browser log)"


def wait_for(driver, expression: str, timeout: float, what: str):
    """Poll a JavaScript expression until it is truthy; fail with the page's state and log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(f"return {expression};")
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(
        f"{what}: not seen after {timeout}s\nstate: {page_state(driver)}\nconsole:\n{console_log(driver)}"
    )


def open_demo(driver, server: ServerProcess, tab: str, key: str | None = API_KEY) -> None:
    """Open the page on `tab`; with `key`, type it into the page's API key field (the page
    then reloads with it) and wait until the pickers are filled."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{server.url}/#{tab}")
    wait_for(driver, "window.demo && (window.demo.ready || window.demo.error)", 30, "the page set up")
    if key is not None:
        driver.execute_script("window.beforeKey = true;")  # gone once the page has reloaded
        driver.find_element(By.ID, "api-key").send_keys(key, Keys.TAB)  # change -> reload
        wait_for(driver, "!window.beforeKey && window.demo && window.demo.ready", 30, "the page set up with the key")
    assert page_state(driver, "window.demo.error") is None, page_state(driver, "window.demo.error")


def save_screenshot(driver, name: str) -> None:
    directory = os.environ.get(SCREENSHOTS_ENV)
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(directory) / name))


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory) -> Iterator[ServerProcess]:
    _require_chromium()  # before minutes of loading pipelines the tests could not use
    log_path = tmp_path_factory.mktemp("serve-browser") / "server.log"
    # its jobs live in that temporary folder (the server's working directory)
    # The random talker ends wherever it samples a codec end (half its answers last under a
    # second): at least 200 codes (4 s of speech) leave time to speak over an answer.
    talker_speaks_on = "tiny-omni:stages.talker.request_defaults={min_tokens: 200}"
    server = start_server(
        ["tiny-image", "tiny-video", "tiny-omni", "--api-key", API_KEY, "--set", talker_speaks_on], log_path
    )
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()
