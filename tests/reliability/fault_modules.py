"""torch_module factories for the reliability tests (imported by worker processes as
omnistage.tests.reliability.fault_modules)."""

from __future__ import annotations

import os
import time

from torch import nn


class HangsOnFlag(nn.Module):
    """Returns x * 2, except while the file `params.flag` exists: then its forward never
    returns (a stuck kernel or a deadlock, as the worker's engine step sees it)."""

    def forward(self, x, params=None):
        flag = (params or {}).get("flag")
        while flag and os.path.exists(flag):
            time.sleep(0.01)
        return x * 2


class LeaksMemory(nn.Module):
    """Returns x + 1 and keeps params.leak_mib MiB of touched memory per request forever
    (a slow leak: the process's RSS only grows)."""

    def __init__(self):
        super().__init__()
        self.kept: list[bytearray] = []

    def forward(self, x, params=None):
        mib = int((params or {}).get("leak_mib", 0))
        if mib:
            self.kept.append(bytearray(os.urandom(1)) * (mib << 20))
        delay = float((params or {}).get("delay", 0.0))
        if delay:
            time.sleep(delay)
        return x + 1
