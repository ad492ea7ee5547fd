"""Small deterministic torch modules for runtime tests, benchmarks and configs/tiny-diamond.yaml.

Each takes a `seed` so a test can build the same module in its own process as a reference.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from omnistage.errors import InvalidRequestError


def _seeded_linear(dim_in: int, dim_out: int, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(dim_in, dim_out)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(dim_out, dim_in, generator=g) / dim_in**0.5)
        lin.bias.copy_(torch.randn(dim_out, generator=g) * 0.1)
    return lin


class ChunkedLinear(nn.Module):
    """x [T, dim] -> h = Linear(x), emitted `chunk` rows at a time (a generator: one chunk per
    engine step). params.delay seconds pass between chunks (a slow upstream producer)."""

    def __init__(self, dim: int = 8, chunk: int = 4, seed: int = 0):
        super().__init__()
        self.lin = _seeded_linear(dim, dim, seed)
        self.chunk = chunk

    def forward(self, x, params=None):
        delay = float((params or {}).get("delay", 0.0))
        h = self.lin(x)

        def chunks():
            for i in range(0, h.shape[0], self.chunk):
                if i and delay:
                    time.sleep(delay)
                yield {"h": h[i : i + self.chunk]}

        return chunks()


class ChunkSummary(nn.Module):
    """A streaming consumer: each chunk (with its left context rows) -> one row,
    mean over rows of tanh(Linear(chunk)). An empty chunk gives no row."""

    def __init__(self, dim: int = 8, seed: int = 1):
        super().__init__()
        self.lin = _seeded_linear(dim, dim, seed)

    def forward(self, x):
        if x.shape[0] == 0:
            return x.new_zeros((0, x.shape[-1]))
        return torch.tanh(self.lin(x)).mean(0, keepdim=True)


class Dense(nn.Module):
    """relu(Linear(x)); raises on NaN input (a poisoned request)."""

    def __init__(self, dim: int = 8, seed: int = 2):
        super().__init__()
        self.lin = _seeded_linear(dim, dim, seed)

    def forward(self, x):
        if torch.isnan(x).any():
            raise ValueError("poisoned input: NaN values")
        return torch.relu(self.lin(x))


class Join(nn.Module):
    """Fan-in of two ports: Linear(cat([a, b], 0))."""

    def __init__(self, dim: int = 8, seed: int = 3):
        super().__init__()
        self.lin = _seeded_linear(dim, dim, seed)

    def forward(self, a, b):
        return self.lin(torch.cat([a, b], 0))


class MaybeSide(nn.Module):
    """x -> {"main": x + 1, "side": x * 2}; with params.side false the side port is ABSENT
    (the stages fed only by it never see the request)."""

    def forward(self, x, params=None):
        from omnistage.stages.base import ABSENT

        side = (params or {}).get("side", True)
        return {"main": x + 1, "side": x * 2 if side else ABSENT}


class Sleeper(nn.Module):
    """Returns x after params.delay seconds; params.invalid raises InvalidRequestError."""

    def forward(self, x, params=None):
        params = params or {}
        if params.get("invalid"):
            raise InvalidRequestError("this request asked to be invalid", param="invalid")
        delay = float(params.get("delay", 0.0))
        if delay:
            time.sleep(delay)
        return x


class SlowToBuild(nn.Module):
    """Identity that takes `build_s` seconds to construct (a model still loading)."""

    def __init__(self, build_s: float = 60.0):
        super().__init__()
        time.sleep(build_s)

    def forward(self, x):
        return x
