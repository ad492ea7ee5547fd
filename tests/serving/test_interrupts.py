"""A Ctrl+C that a library swallows (torch's import of numpy swallows whatever its import
raises) is still remembered, and the command checks for it before the server starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from omnistage.serving import interrupts


def _swallowing_import() -> None:
    """What torch's C init does with its numpy import: any exception is cleared."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs here, in the main thread
    except BaseException:  # noqa: BLE001 - the library's behaviour under test
        pass


def test_a_swallowed_ctrl_c_is_raised_again_before_serving():
    previous = signal.getsignal(signal.SIGINT)
    try:
        interrupts.install()
        interrupts.raise_if_interrupted()  # nothing yet
        _swallowing_import()
        assert interrupts.interrupted()
        with pytest.raises(KeyboardInterrupt):
            interrupts.raise_if_interrupted()
        interrupts.install()  # a new command starts clean
        assert not interrupts.interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)
