"""A deliberately slow torch module for serving tests (built inside stage workers)."""

import time

import torch

from omnistage.errors import InvalidRequestError

# Inputs that make the module fail, so tests can see how stage failures reach HTTP clients.
INVALID_BELOW = -1000.0  # the request's own fault -> InvalidRequestError -> 400
CRASH_ABOVE = 1e6  # a stage failure -> RuntimeError -> 500


class SlowScale(torch.nn.Module):
    """y = x * factor, after sleeping `delay_s` (per call) to keep a request in flight.

    Built with `pass_params: true`, a request may set its own {"delay_s": ...}.
    `build_delay_s` sleeps once while the worker builds the module, so the stage stays
    not-ready that long.
    """

    def __init__(self, factor: float = 2.0, delay_s: float = 0.0, build_delay_s: float = 0.0):
        super().__init__()
        time.sleep(build_delay_s)
        self.factor = factor
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        if (x < INVALID_BELOW).any():
            raise InvalidRequestError(f"x must be >= {INVALID_BELOW}", param="x")
        if (x > CRASH_ABOVE).any():
            raise RuntimeError("value too large for this test module")
        delay = float((params or {}).get("delay_s", self.delay_s))
        if delay:
            time.sleep(delay)
        return x * self.factor
