"""Ctrl+C while `omnistage` is still importing its libraries: remembered, not only raised.

torch's import of numpy swallows whatever that import raises, KeyboardInterrupt included, so a
Ctrl+C landing there was lost and the server went on to start. The handler installed here raises
KeyboardInterrupt as Python's own does, and also notes the interrupt, which the command checks
again (`raise_if_interrupted`) before the server takes over SIGINT for its drain.
"""

from __future__ import annotations

import signal

_interrupted = False


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def install() -> None:
    """SIGINT raises KeyboardInterrupt and is remembered (main thread only)."""
    global _interrupted
    _interrupted = False
    signal.signal(signal.SIGINT, _on_sigint)


def interrupted() -> bool:
    return _interrupted


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a Ctrl+C came since install(), even one something swallowed."""
    if _interrupted:
        raise KeyboardInterrupt
