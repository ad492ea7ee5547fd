"""The sampler's draws follow the processed distribution (chi-square, ~20k seeded draws).

test_sampling.py checks the processed probabilities against transformers' logits warpers;
this file checks the draw itself: many rows with the same fixed logits, each with its own seeded
generator (the per-request path) or the shared global generator (unseeded requests), counted
per token and compared with the probabilities transformers' warpers give. The seeds are fixed,
so the statistic is deterministic: the test cannot flake, and a wrong exponential-race formula
(or a wrong temperature, a leaked out-of-support token) moves it far past the bound.
"""

from __future__ import annotations

import pytest
import torch

from omnistage.stages.ar import SamplingParams
from omnistage.stages.ar.sampler import Sampler
from omnistage.stages.ar.sequence import Sequence

DRAWS = 20_000
V = 16
P_MIN = 1e-3  # reject when the chi-square p-value is below this


def fixed_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(V, generator=g) * 1.5


def reference_probs(logits: torch.Tensor, params: dict) -> torch.Tensor:
    """transformers' warpers (the independent judge), then softmax."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList([TemperatureLogitsWarper(params["temperature"])])
    if params.get("top_k"):
        procs.append(TopKLogitsWarper(params["top_k"]))
    if params.get("top_p", 1.0) < 1.0:
        procs.append(TopPLogitsWarper(params["top_p"]))
    if params.get("min_p"):
        procs.append(MinPLogitsWarper(params["min_p"]))
    return procs(torch.tensor([[0]]), logits[None].clone()).softmax(-1)[0].double()


def draw(logits: torch.Tensor, params: dict, seeded: bool) -> torch.Tensor:
    """DRAWS tokens from one Sampler call over DRAWS identical rows; counts per token."""
    seqs = []
    for i in range(DRAWS):
        s = Sequence(f"r{i}", 0, [0], 1, SamplingParams(**params), arrival=0)
        s.generator = torch.Generator().manual_seed(10_000 + i) if seeded else None
        seqs.append(s)
    torch.manual_seed(99)  # the unseeded rows' global generator
    tokens = Sampler(eos_token_ids=())(logits.expand(DRAWS, V).contiguous(), seqs).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=V).double()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic over the support and its p-value (upper regularized gamma)."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    assert expected.min() >= 5, "bins too small for the chi-square approximation"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, p


CASES = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=1.2, top_k=10, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_draws_follow_the_processed_distribution(params, seeded):
    logits = fixed_logits()
    probs = reference_probs(logits, params)
    counts = draw(logits, params, seeded)
    assert counts.sum() == DRAWS
    assert counts[probs == 0].sum() == 0, "a token outside the processed support was drawn"
    assert int((probs > 0).sum()) >= 3  # a real distribution, not one forced token
    stat, p = chi_square_p(counts, probs)
    assert p > P_MIN, f"chi2={stat:.1f}, p={p:.2e}, counts={counts.tolist()}, expected={(probs * DRAWS).tolist()}"


def test_the_test_rejects_a_neighbouring_temperature():
    """Sensitivity: draws at temperature 0.7 are rejected as samples of temperature 0.8."""
    logits = fixed_logits()
    counts = draw(logits, dict(temperature=0.7), seeded=True)
    _, p = chi_square_p(counts, reference_probs(logits, dict(temperature=0.8)))
    assert p < P_MIN
