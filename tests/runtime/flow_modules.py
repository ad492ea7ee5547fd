"""torch_module factories for the backpressure test (imported by worker processes as
omnistage.tests.runtime.flow_modules)."""

from __future__ import annotations

import time

import torch
from torch import nn


class ManyChunks(nn.Module):
    """x = [n_chunks, rows, delay] -> n_chunks chunks of `rows` x 1024 float32, one per engine
    step, `delay` seconds apart; chunk i is filled with i (the consumer reports it)."""

    def forward(self, x):
        n_chunks, rows, delay = x.reshape(-1)[:3].tolist()

        def chunks():
            for i in range(int(n_chunks)):
                if i and delay:
                    time.sleep(delay)
                yield {"h": torch.full((int(rows), 1024), float(i))}

        return chunks()


class SlowReader(nn.Module):
    """Per chunk: sleep `delay` seconds, then one row (the chunk's first value, its row count)."""

    def __init__(self, delay: float = 0.02):
        super().__init__()
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        if x.shape[0] == 0:
            return x.new_zeros((0, 2))
        return torch.tensor([[float(x[0, 0]), float(x.shape[0])]])
