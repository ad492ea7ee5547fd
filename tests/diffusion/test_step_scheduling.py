"""StepEngine scheduling on the real tiny SD3 denoiser: budgets, buckets served fairly (no
head-of-line blocking, no starvation), arrival order inside a bucket."""

from __future__ import annotations

from omnistage.stages.diffusion.adapters.base import GenerationParams
from omnistage.stages.diffusion.step_engine import StepEngine


def add(engine, kit, rid, size=32, steps=4, n=1, seed=0):
    adapter, text = kit
    params = GenerationParams.from_dict(
        dict(height=size, width=size, num_inference_steps=steps, num_images_per_prompt=n, seed=seed,
             guidance_scale=4.0)
    )
    engine.add(adapter.prepare(rid, params, text))


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


def test_new_small_bucket_is_served_at_the_next_step(sd3_denoise_kit):
    engine = StepEngine(sd3_denoise_kit[0], max_batch_size=8)
    add(engine, sd3_denoise_kit, "big", size=64, steps=20)
    engine.step()
    engine.step()
    add(engine, sd3_denoise_kit, "small", size=32, steps=4)
    engine.step()
    assert engine.step_log[-1].request_ids == ("small",)
    finals = engine.run_until_done()
    order = [rid for rid in finals]
    assert order == ["small", "big"]  # the small request finished while the big one ran
    # while both were active, the big bucket got about a quarter as many forwards (4x the work)
    both = engine.step_log[2:]
    small_forwards = [i for i, r in enumerate(both) if r.request_ids == ("small",)]
    assert small_forwards[-1] < 8


def test_big_request_is_not_starved_by_a_stream_of_small_ones(sd3_denoise_kit):
    engine = StepEngine(sd3_denoise_kit[0], max_batch_size=8)
    add(engine, sd3_denoise_kit, "big", size=64, steps=4)
    seq = 0
    gaps, since_big = [], 0
    while engine.state("big") is not None:
        # keep the small bucket busy: a new small request whenever it runs dry
        if not any(rid.startswith("s") for rid in engine.request_ids()):
            add(engine, sd3_denoise_kit, f"s{seq}", size=32, steps=2, seed=seq)
            seq += 1
        engine.step()
        if "big" in engine.step_log[-1].request_ids:
            gaps.append(since_big)
            since_big = 0
        else:
            since_big += 1
        assert len(engine.step_log) < 60, "the big request is starved"
    assert len(gaps) == 4
    # big costs 4x a small forward: at most ~4 small forwards between two big ones
    assert max(gaps) <= 5, gaps


def test_first_steps_go_first_with_bounded_lead(sd3_denoise_kit):
    """A new request starts at the next step even when its bucket is ahead in the fair order;
    a big request keeps progressing while a small request arrives at every step."""
    adapter = sd3_denoise_kit[0]
    engine = StepEngine(adapter, max_batch_size=8)
    add(engine, sd3_denoise_kit, "big", size=64, steps=30)
    add(engine, sd3_denoise_kit, "s0", size=32, steps=30)
    small_key = engine.state("s0").bucket
    big_key = engine.state("big").bucket
    for _ in range(10):  # until the fair order alone would serve the big bucket next
        engine.step()
        v = engine.bucket_vtimes()
        # ahead (or level and served last): fair order alone picks the big bucket next
        if v[small_key] > v[big_key] or (v[small_key] == v[big_key] and engine.step_log[-1].request_ids == ("s0",)):
            break
    else:
        raise AssertionError("the small bucket never got ahead")
    add(engine, sd3_denoise_kit, "s1", size=32, steps=3)
    engine.step()
    assert set(engine.step_log[-1].request_ids) == {"s0", "s1"}

    # a small arrival at every step cannot starve the big request
    gaps, since_big, seq = [], 0, 0
    while engine.state("big") is not None:
        add(engine, sd3_denoise_kit, f"x{seq}", size=32, steps=3, seed=seq)
        seq += 1
        engine.step()
        if "big" in engine.step_log[-1].request_ids:
            gaps.append(since_big)
            since_big = 0
        else:
            since_big += 1
        assert len(engine.step_log) < 400, "the big request is starved"
    # the big forward (2 rows x 256 tokens) is worth 4 small requests': equal shares of work
    # plus a lead of one forward bound the small forwards between two big ones
    assert max(gaps) <= 3, gaps
