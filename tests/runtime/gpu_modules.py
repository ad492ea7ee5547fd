"""torch_module factories for the GPU runtime tests (imported by worker processes as
omnistage.tests.runtime.gpu_modules). The runtime moves each module to its replica's device."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class WhereAmI(nn.Module):
    """y = x * scale on the module's device, and where it ran: the parameter's device, the
    process's current CUDA device (-1 without CUDA) and its pid."""

    def __init__(self, scale: float = 2.0, hold: float = 0.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(scale)))
        self.hold = hold

    def forward(self, x):
        time.sleep(self.hold)  # held: a concurrent request goes to the other replica
        current = torch.cuda.current_device() if torch.cuda.is_available() else -1
        y = x.to(self.scale.device) * self.scale
        return {"y": y, "where": {"param": str(self.scale.device), "current": current, "pid": os.getpid()}}


class Checksum(nn.Module):
    """x -> (x + 1 on this module's device, what arrived: device, sum, a position-weighted sum)."""

    def __init__(self):
        super().__init__()
        self.one = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        arrived = str(x.device)
        x = x.to(self.one.device)
        weights = torch.arange(x.numel(), device=x.device, dtype=torch.float64) % 977
        info = {
            "arrived_on": arrived,
            "sum": float(x.double().sum()),
            "weighted": float((x.double().reshape(-1) * weights).sum()),
        }
        return {"y": x + self.one, "info": info}
