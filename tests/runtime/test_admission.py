"""Admission, deadlines, errors and large tensors on a two-stage pipeline (sleeper -> copy)."""

import threading
import time

import pytest
import torch

from omnistage.errors import DeadlineExceededError, InvalidRequestError, OverloadedError


def test_full_intake_rejects_at_once(sleepy):
    assert sleepy.spec.max_queued_requests == 3
    done = []
    threads = [
        threading.Thread(target=lambda: done.append(sleepy.run({"x": torch.ones(2)}, {"sleeper": {"delay": 0.6}})))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while sleepy.num_requests() < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    with pytest.raises(OverloadedError, match="overloaded"):
        sleepy.run({"x": torch.ones(2)})
    rejected_after = time.monotonic() - t0
    for t in threads:
        t.join(30)
    # "at once" against a baseline from this run: the three queued requests still needed >= 1.2 s
    # (0.6 s each, one at a time) to drain; the refusal did not wait for them
    drained_after = time.monotonic() - t0
    assert rejected_after < 0.25 * drained_after, (rejected_after, drained_after)
    assert len(done) == 3 and all(torch.equal(d["y"], torch.ones(2)) for d in done)
    assert sleepy.request_counts["rejected"] >= 1


def test_deadline_exceeded(sleepy):
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        sleepy.run({"x": torch.ones(2)}, {"sleeper": {"delay": 1.5}}, timeout=0.3)
    failed_after = time.monotonic() - t0
    # the stage finishes its sleep, then the pipeline serves the next request normally
    assert torch.equal(sleepy.run({"x": torch.ones(3)}, timeout=10)["y"], torch.ones(3))
    # baseline from this run: the next request had to wait for the 1.5 s sleep to end; the
    # deadline error did not
    assert failed_after < 0.6 * (time.monotonic() - t0), failed_after


def test_invalid_request_error_reaches_the_caller(sleepy):
    with pytest.raises(InvalidRequestError, match="asked to be invalid"):
        sleepy.run({"x": torch.ones(2)}, {"sleeper": {"invalid": True}})
    with pytest.raises(InvalidRequestError, match="no pipeline inputs"):
        sleepy.run({})
    with pytest.raises(InvalidRequestError, match="unknown stage"):
        sleepy.run({"x": torch.ones(1)}, {"nope": {}})
    with pytest.raises(InvalidRequestError, match="must be an object") as refused:  # was a TypeError
        sleepy.run({"x": torch.ones(1)}, {"sleeper": 5})
    assert refused.value.param == "params.sleeper"


def test_64mib_tensor_round_trip(sleepy):
    x = torch.randn(16 * 1024 * 1024)  # 64 MiB of float32
    for _ in range(2):  # the second trip reuses the pooled segments
        y = sleepy.run({"x": x}, timeout=60)["y"]
        assert torch.equal(x, y)


def test_full_edge_holds_back_its_producer(sleepy):
    """pre -> sleeper has max_inflight 1: while the sleeper works, `pre` admits nothing more."""
    done = []
    threads = [
        threading.Thread(target=lambda: done.append(sleepy.run({"x": torch.ones(2)}, {"sleeper": {"delay": 0.6}})))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    # Sample until the sleeper holds the first request (it may still be on its way from `pre`
    # through the hub when `pre` already queues the other two) while `pre` holds the rest.
    deadline = time.monotonic() + 5.0
    held_back, most_in_sleeper = None, 0
    while held_back is None and time.monotonic() < deadline:
        stats = sleepy.stage_stats()
        in_sleeper = stats["sleeper"]["inflight"] + stats["sleeper"]["queue_depth"]
        most_in_sleeper = max(most_in_sleeper, in_sleeper)
        if in_sleeper == 1 and stats["pre"]["queue_depth"] == 2:
            held_back = stats
        time.sleep(0.01)
    for t in threads:
        t.join(30)
    assert most_in_sleeper <= 1, "the edge let more than max_inflight requests through"
    assert held_back is not None, ("never saw the sleeper busy with one request while pre held two", stats)
    assert len(done) == 3


def test_nested_tensors_of_every_size_and_dtype_round_trip(sleepy):
    small = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    value = {
        "big": torch.randn(300, 100),  # shared memory
        "parts": [small, torch.tensor(3.5), torch.empty(0, 4), torch.ones(5, dtype=torch.int64)],
        "strided": torch.randn(64, 64).t()[::2],  # non-contiguous
        "meta": ("text", 7),
    }
    out = sleepy.run({"x": value}, timeout=30)["y"]
    assert torch.equal(out["big"], value["big"])
    for got, want in zip(out["parts"], value["parts"]):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(out["strided"], value["strided"])
    assert out["meta"] == ("text", 7)
    assert not small.is_shared()  # inline tensors are copied as bytes, the caller's stay private
