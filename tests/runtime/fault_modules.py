"""torch_module factories for the runtime fault tests (imported by worker processes as
omnistage.tests.runtime.fault_modules)."""

from __future__ import annotations

import os

from torch import nn


class RaisesInConstructor(nn.Module):
    def __init__(self, message: str = "weights are corrupt"):
        super().__init__()
        raise RuntimeError(message)


class BuildsOnce(nn.Module):
    """Builds the first time; every later build (a restart) raises: a replica whose restarts
    keep failing. `marker` is a file path private to the test."""

    def __init__(self, marker: str):
        super().__init__()
        if os.path.exists(marker):
            with open(marker, "a") as f:
                f.write("x")  # one byte per refused build
            raise RuntimeError("rebuild refused")
        open(marker, "w").close()

    def forward(self, x):
        return x * 2
