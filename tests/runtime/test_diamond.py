"""The tiny-diamond graph across worker processes, judged against the same modules run in
this process (configs/tiny-diamond.yaml: producer -> summary (streaming) and dense (2
replicas) -> join)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import torch

from omnistage.errors import StageError, WorkerDiedError
from omnistage.runtime.testmodules import ChunkedLinear, ChunkSummary, Dense, Join

from .test_assembler import reference_chunks

torch.manual_seed(1234)
_A = ChunkedLinear(dim=8, chunk=4, seed=0).eval()
_B = ChunkSummary(dim=8, seed=1).eval()
_C = Dense(dim=8, seed=2).eval()
_D = Join(dim=8, seed=3).eval()


@torch.no_grad()
def reference(x: torch.Tensor) -> dict[str, torch.Tensor]:
    h = _A.lin(x)
    summary = torch.cat([_B(c) for c in reference_chunks(h, 3, 1)])
    return {"h": h, "summary": summary, "y": _D(summary, _C(h))}


def assert_matches(out, x):
    want = reference(x)
    for port in ("h", "summary", "y"):
        assert out[port].shape == want[port].shape, port
        torch.testing.assert_close(out[port], want[port], rtol=1e-5, atol=1e-5)


def test_diamond_equals_single_process_reference(diamond):
    for rows in (16, 7, 3, 12, 1):
        x = torch.randn(rows, 8)
        assert_matches(diamond.run({"x": x}, timeout=30), x)


def test_downstream_gets_first_chunk_before_upstream_finishes(diamond):
    x = torch.randn(16, 8)

    async def collect():
        events = []
        async for c in diamond.stream({"x": x}, params={"producer": {"delay": 1.0}}):
            events.append((time.monotonic(), c.stage, c.port, c.final))
        return events

    events = asyncio.run(collect())
    first_summary = next(t for t, stage, port, _ in events if port == "summary")
    producer_done = next(t for t, stage, port, final in events if port == "h" and final)
    # the producer spends >= 3 x 1 s after its first chunk; summary answers well before that
    # (a runtime that buffered the stream would deliver it after the producer's last chunk)
    assert first_summary < producer_done - 1.0
    # streaming output edges pass chunks as produced; a non-streaming one delivers one
    # concatenated chunk when its producer finishes
    assert len([e for e in events if e[2] == "h"]) >= 4
    assert [(stage, final) for _, stage, port, final in events if port == "y"] == [("join", True)]


def _stage_view(p):
    return {s: (v["inflight"], v["queue_depth"], v.get("engine_requests", 0)) for s, v in p.stage_stats().items()}


def _in_every_stage(view) -> bool:
    return view["producer"][0] == 1 and view["summary"][0] == 1 and view["dense"][1] == 1


def test_cancel_mid_flight_frees_state_in_every_stage(diamond):
    x = torch.randn(16, 8)

    async def cancel_after_first_summary():
        agen = diamond.stream({"x": x}, params={"producer": {"delay": 3.0}}, request_id="to-cancel")
        async for c in agen:
            if c.port == "summary":
                # the producer needs >= 6 s more: wait for each worker's figures to show the
                # request (they lag on a loaded machine), then cancel
                deadline = time.monotonic() + 5
                held = _stage_view(diamond)
                while not _in_every_stage(held) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    held = _stage_view(diamond)
                await agen.aclose()  # the client goes away
                return held

    held = asyncio.run(cancel_after_first_summary())
    assert held["producer"][0] == 1  # generating
    assert held["summary"][0] == 1  # consuming chunks
    assert held["dense"][1] == 1  # waiting for the producer's whole output
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        view = _stage_view(diamond)
        if all(v == (0, 0, 0) for v in view.values()):
            break
        time.sleep(0.05)
    assert all(v == (0, 0, 0) for v in view.values()), view
    assert diamond.request_counts["cancelled"] >= 1
    x2 = torch.randn(5, 8)
    assert_matches(diamond.run({"x": x2}, timeout=30), x2)


def test_sigkill_worker_fails_only_its_request_then_recovers(diamond):
    x = torch.randn(16, 8)
    result: dict = {}

    def slow_request():
        try:
            result["out"] = diamond.run({"x": x}, params={"producer": {"delay": 2.0}}, timeout=60)
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc

    t = threading.Thread(target=slow_request)
    t.start()
    # routed to the producer (the hub's own table, not the worker's lagging figures): from then
    # on its death fails the request; the request stays there >= 6 s (3 x 2 s between chunks)
    _wait_until(lambda: _held(diamond, "producer") == [1], "the request never reached the producer")
    pid = diamond.worker_pids()["producer"][0]
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    err = result.get("error")
    assert isinstance(err, WorkerDiedError), result
    assert "producer" in str(err) and "SIGKILL" in str(err)
    diamond.wait_ready(60)
    assert diamond.worker_pids()["producer"][0] != pid
    x2 = torch.randn(9, 8)
    assert_matches(diamond.run({"x": x2}, timeout=30), x2)


def _held(p, stage) -> list[int]:
    """Requests routed to each replica of `stage` and not finished there (the hub's own table)."""
    return [r["held_requests"] for r in p.replica_stats(timeout=0.2)[stage]]


def _wait_until(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_dead_replica_fails_only_the_requests_it_held(diamond):
    """Two requests wait in different `dense` replicas; killing one replica fails only its own.

    Where each request is comes from the hub's routing table, not from worker figures (those
    lag under load). Request 0's chunks are 3 s apart, so it holds its dense replica >= 9 s
    while request 1 (0.3 s apart) reaches the other one: the kill lands well inside that."""
    xs = [torch.randn(16, 8), torch.randn(16, 8)]
    results: list = [None, None]

    def one(i, delay):
        try:
            results[i] = diamond.run({"x": xs[i]}, params={"producer": {"delay": delay}}, timeout=60)
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=one, args=(0, 3.0)), threading.Thread(target=one, args=(1, 0.3))]
    threads[0].start()
    _wait_until(lambda: sum(_held(diamond, "dense")) == 1, "request 0 never reached dense")
    victim_index = _held(diamond, "dense").index(1)
    threads[1].start()
    # least-loaded routing sends request 1 to the other replica
    _wait_until(lambda: _held(diamond, "dense") == [1, 1], "request 1 never reached the other dense replica")
    victim = diamond.worker_pids()["dense"][victim_index]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert isinstance(results[0], WorkerDiedError) and "dense" in str(results[0]), results[0]
    assert isinstance(results[1], dict), results[1]
    assert_matches(results[1], xs[1])
    diamond.wait_ready(60)
    x = torch.randn(6, 8)
    assert_matches(diamond.run({"x": x}, timeout=30), x)


def test_poisoned_request_in_a_batch_fails_alone(diamond):
    before = [r["engine"].get("batch_size_max", 0) for r in diamond.replica_stats()["dense"]]
    xs = [torch.randn(4, 8) for _ in range(8)]
    xs[3][1, 2] = float("nan")
    results: list = [None] * len(xs)

    def one(i):
        try:
            results[i] = diamond.run({"x": xs[i]}, timeout=30)
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(results[3], StageError) and "poisoned" in str(results[3]) and "dense" in str(results[3])
    for i, out in enumerate(results):
        if i != 3:
            assert isinstance(out, dict), out
            assert_matches(out, xs[i])
    after = [r["engine"].get("batch_size_max", 0) for r in diamond.replica_stats()["dense"]]
    assert max(after) >= 2, (before, after)  # the requests really shared batches


def test_200_concurrent_requests(diamond):
    xs = [torch.randn(1 + i % 20, 8) for i in range(200)]

    async def all_requests():
        return await asyncio.gather(*(diamond.generate({"x": x}) for x in xs))

    outs = asyncio.run(all_requests())
    for out, x in zip(outs, xs):
        assert_matches(out, x)


def test_prometheus_collector_exports_stage_figures(diamond):
    from prometheus_client import CollectorRegistry, generate_latest

    from omnistage.runtime.metrics import PipelineMetricsCollector

    diamond.run({"x": torch.randn(4, 8)})
    reg = CollectorRegistry()
    reg.register(PipelineMetricsCollector([diamond]))
    text = generate_latest(reg).decode()
    for series in (
        'omnistage_stage_queue_depth{pipeline="tiny-diamond",replica="1",stage="dense"}',
        'omnistage_stage_inflight_requests{pipeline="tiny-diamond",replica="0",stage="join"}',
        'omnistage_stage_batch_size_bucket{le="+Inf",pipeline="tiny-diamond",replica="0",stage="producer"}',
        "omnistage_stage_step_seconds_sum",
        'omnistage_stage_requests_total{outcome="ok",pipeline="tiny-diamond",replica="0",stage="join"}',
        'omnistage_pipeline_requests_total{outcome="ok",pipeline="tiny-diamond"}',
        'omnistage_engine_batches_total{pipeline="tiny-diamond",replica="0",stage="producer"}',
    ):
        assert series in text, series


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_idle_workers_do_not_spin(diamond):
    diamond.run({"x": torch.randn(4, 8)})
    time.sleep(0.3)  # let every worker settle into its blocking wait
    pids = [pid for reps in diamond.worker_pids().values() for pid in reps]
    before = {pid: _cpu_seconds(pid) for pid in pids}
    time.sleep(1.0)
    used = {pid: _cpu_seconds(pid) - before[pid] for pid in pids}
    assert all(u <= 0.05 for u in used.values()), used  # blocked, not polling


def test_workers_freeze_their_startup_heap(diamond):
    # objects from start-up (torch, the modules) are out of the collector's view, so a full
    # collection does not pause the engine to rescan them
    for stage, reps in diamond.replica_stats().items():
        for r in reps:
            assert r["gc_frozen_objects"] > 10_000, (stage, r["gc_frozen_objects"])


def test_requests_one_at_a_time_alternate_between_idle_replicas():
    """Both `dense` replicas idle for every request: the hub spreads them (judged by each
    worker's own count of finished requests), not all to the first one."""
    from omnistage.runtime.pipeline import Pipeline

    with Pipeline.from_yaml("tiny-diamond", ready_timeout=120) as p:
        for _ in range(6):
            x = torch.randn(5, 8)
            assert_matches(p.run({"x": x}, timeout=30), x)
        served = [r["outcomes"]["ok"] for r in p.replica_stats()["dense"]]
    assert served == [3, 3], served
