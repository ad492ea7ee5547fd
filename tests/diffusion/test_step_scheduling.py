"""StepEngine scheduling on the real tiny SD3 denoiser: budgets, arrival order inside a bucket,
least remaining work first across buckets (small requests overtake a big one) with an aging
bound (the big one is never starved)."""

from __future__ import annotations

import pytest

from omnistage.stages.diffusion.adapters.base import GenerationParams
from omnistage.stages.diffusion.step_engine import StepEngine


def add(engine, kit, rid, size=32, steps=4, n=1, seed=0):
    adapter, text = kit
    params = GenerationParams.from_dict(
        dict(height=size, width=size, num_inference_steps=steps, num_images_per_prompt=n, seed=seed, guidance_scale=4.0)
    )
    state = adapter.prepare(rid, params, text)
    engine.add(state)
    return state.cost


def test_budget_max_batch_size_and_arrival_order(sd3_denoise_kit):
    engine = StepEngine(sd3_denoise_kit[0], max_batch_size=2)
    for i in range(5):
        add(engine, sd3_denoise_kit, f"r{i}", steps=2, seed=i)
    add(engine, sd3_denoise_kit, "n3", steps=1, n=3)  # bigger than the budget: runs alone
    engine.run_until_done()
    log = engine.step_log
    assert [r.request_ids for r in log[:2]] == [("r0", "r1"), ("r0", "r1")]
    assert all(r.batch_size <= 2 or r.request_ids == ("n3",) for r in log)
    assert any(r.request_ids == ("n3",) and r.batch_size == 3 for r in log)
    assert engine.num_requests() == 0 and engine.completed == 6


def test_budget_max_latent_tokens(sd3_denoise_kit):
    # 32x32 with CFG: 2 rows x 64 latent tokens = 128 per request
    engine = StepEngine(sd3_denoise_kit[0], max_batch_size=16, max_latent_tokens=256)
    for i in range(5):
        add(engine, sd3_denoise_kit, f"r{i}", steps=2, seed=i)
    engine.run_until_done()
    assert max(len(r.request_ids) for r in engine.step_log) == 2
    assert all(r.extra["rows"] * 64 <= 256 for r in engine.step_log)


def test_small_requests_arriving_while_a_big_one_runs_finish_first(sd3_denoise_kit):
    engine = StepEngine(sd3_denoise_kit[0], max_batch_size=8)
    big_cost = add(engine, sd3_denoise_kit, "big", size=64, steps=20)
    engine.step()
    engine.step()
    small_cost = add(engine, sd3_denoise_kit, "s0", size=32, steps=4, seed=1)
    add(engine, sd3_denoise_kit, "s1", size=32, steps=4, seed=2)
    assert big_cost == 4 * small_cost  # 4x the latent tokens
    finals = engine.run_until_done()
    assert list(finals) == ["s0", "s1", "big"]
    # served from the next step boundary, together, until done: the big bucket waited (its
    # passed-over work, 4 forwards x 2 small requests = 2 big forwards, is within the bound)
    after = [r.request_ids for r in engine.step_log[2:]]
    assert after[:4] == [("s0", "s1")] * 4
    assert all(ids == ("big",) for ids in after[4:]) and len(after) == 4 + 18
    assert all(not e.error for e in finals.values())


def _gaps_and_work(engine, costs, rid):
    """For each forward of `rid`: the other forwards' work since its previous one."""
    gaps, passed = [], 0
    for r in engine.step_log:
        if rid in r.request_ids:
            gaps.append(passed)
            passed = 0
        else:
            passed += sum(costs[x] for x in r.request_ids)
    return gaps


@pytest.mark.parametrize("aging_factor", [4.0, 1.0])
def test_big_request_is_not_starved_by_a_stream_of_small_ones(sd3_denoise_kit, aging_factor):
    engine = StepEngine(sd3_denoise_kit[0], max_batch_size=8, aging_factor=aging_factor)
    costs = {"big": add(engine, sd3_denoise_kit, "big", size=64, steps=6)}
    seq = 0
    small_forwards = 0
    while engine.state("big") is not None:
        # a continuous stream: a new small request (always less remaining work) at every step
        costs[f"s{seq}"] = add(engine, sd3_denoise_kit, f"s{seq}", size=32, steps=2, seed=seq)
        seq += 1
        engine.step()
        small_forwards += "big" not in engine.step_log[-1].request_ids
        assert len(engine.step_log) < 200, "the big request is starved"
    assert small_forwards > 0  # the small stream was preferred ...
    gaps = _gaps_and_work(engine, costs, "big")
    assert len(gaps) == 6
    # ... but the big bucket is served once passed over for more than aging_factor x its own
    # forward: the gap exceeds the bound by at most the last small forward before it
    largest_small_forward = max(
        sum(costs[x] for x in r.request_ids) for r in engine.step_log if "big" not in r.request_ids
    )
    bound = aging_factor * costs["big"]
    assert max(gaps) > bound / 2  # the bound, not plain alternation, decided the gaps
    assert all(g <= bound + largest_small_forward for g in gaps), (gaps, bound)


def test_aging_wait_seconds_bound(sd3_denoise_kit):
    """With a time bound, a bucket not served for aging_wait_s seconds goes next, whatever the
    work bound says (a fake clock advancing 1 s per read makes it deterministic)."""
    ticks = iter(range(10**6))
    engine = StepEngine(
        sd3_denoise_kit[0], max_batch_size=8, aging_factor=1e9, aging_wait_s=5.0, clock=lambda: float(next(ticks))
    )
    add(engine, sd3_denoise_kit, "big", size=64, steps=3)
    seq = 0
    while engine.state("big") is not None:
        add(engine, sd3_denoise_kit, f"s{seq}", size=32, steps=2, seed=seq)
        seq += 1
        engine.step()
        assert len(engine.step_log) < 100, "the big request is starved"
    big_at = [i for i, r in enumerate(engine.step_log) if "big" in r.request_ids]
    assert len(big_at) == 3
    gaps = [b - a - 1 for a, b in zip(big_at, big_at[1:])]
    assert min(gaps) >= 1 and max(gaps) <= 5, gaps
