"""DynamicBatchEngine on its own (no processes): batching knobs, keys, failure isolation,
chunked outputs, streaming inputs, abort."""

import time

import torch

from omnistage.errors import InvalidRequestError
from omnistage.graph.spec import BatchingSpec
from omnistage.stages.base import Port, StageContext, StageRequest
from omnistage.stages.dynamic import DynamicBatchEngine


class Doubler(DynamicBatchEngine):
    inputs = {"x": Port("tensor")}
    outputs = {"y": Port("tensor")}

    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls = []

    def batch_key(self, request):
        return request.params.get("key")

    def forward_batch(self, requests):
        self.calls.append([r.request_id for r in requests])
        out = []
        for r in requests:
            if r.params.get("poison"):
                raise ValueError("poisoned")
            if r.params.get("invalid"):
                out.append(InvalidRequestError("bad value"))
            elif r.params.get("chunks"):
                out.append(iter([{"y": torch.tensor([i])} for i in range(r.params["chunks"])]))
            else:
                x = r.inputs.get("x", r.inputs.get("s"))
                out.append({"y": x * 2})
        return out


class StreamDoubler(Doubler):
    inputs = {"s": Port("tensor", streaming=True)}


def engine(cls=Doubler, **batching):
    ctx = StageContext(
        "d", "doubler", None, None, None, torch.device("cpu"), torch.float32, BatchingSpec(**batching), {}
    )
    return cls(ctx)


def req(rid, **params):
    return StageRequest(rid, {"x": torch.tensor([1.0])}, params)


def test_waits_up_to_max_wait_then_batches_what_is_ready():
    e = engine(max_batch_size=4, max_wait_ms=80)
    for i in range(3):
        e.add(req(f"r{i}"))
    assert not e.has_work() and 0 < e.next_wakeup() <= 0.08
    time.sleep(e.next_wakeup() + 0.005)
    assert e.has_work()
    ems = e.step()
    assert e.calls == [["r0", "r1", "r2"]] and all(m.finished and m.error is None for m in ems)
    assert e.num_requests() == 0 and e.step_log[-1].batch_size == 3


def test_full_batch_runs_at_once_and_keys_never_mix():
    e = engine(max_batch_size=2, max_wait_ms=10_000)
    e.add(req("a", key=1))
    e.add(req("b", key=2))
    assert not e.has_work()
    e.add(req("c", key=1))
    assert e.has_work()  # the oldest request's key now fills a batch
    e.step()
    assert e.calls == [["a", "c"]]


def test_policy_none_runs_each_request_alone_without_waiting():
    e = engine(policy="none", max_batch_size=8, max_wait_ms=1000)
    e.add(req("a"))
    e.add(req("b"))
    assert e.has_work()
    e.step()
    e.step()
    assert e.calls == [["a"], ["b"]]


def test_a_raising_batch_is_retried_member_by_member():
    e = engine(max_batch_size=8, max_wait_ms=0)
    for rid, params in [("ok1", {}), ("bad", {"poison": True}), ("inv", {"invalid": True}), ("ok2", {})]:
        e.add(req(rid, **params))
    ems = {m.request_id: m for m in e.step()}
    assert e.calls[0] == ["ok1", "bad", "inv", "ok2"] and ["ok1"] in e.calls  # whole, then singly
    assert ems["ok1"].error is None and torch.equal(ems["ok1"].outputs["y"], torch.tensor([2.0]))
    assert ems["ok2"].error is None
    assert ems["bad"].error == "ValueError: poisoned" and ems["bad"].error_kind == "internal"
    assert ems["inv"].error == "bad value" and ems["inv"].error_kind == "invalid_request"


def test_iterator_results_stream_one_chunk_per_step():
    e = engine(max_batch_size=8, max_wait_ms=0)
    e.add(req("s", chunks=2))
    e.add(req("plain"))
    first = {m.request_id: m for m in e.step()}
    assert first["s"].outputs["y"].tolist() == [0] and not first["s"].finished
    assert first["plain"].finished
    second = e.step()
    assert [(m.outputs["y"].tolist(), m.finished) for m in second] == [([1], False)]
    third = e.step()
    assert [(m.outputs, m.finished) for m in third] == [({}, True)]
    assert e.num_requests() == 0 and not e.has_work()


def test_streamed_chunks_are_concatenated_and_abort_forgets():
    e = engine(StreamDoubler, max_batch_size=8, max_wait_ms=0)
    e.add(StageRequest("s", {}, {}))
    e.feed("s", "s", torch.tensor([1.0, 2.0]), False)
    assert not e.has_work()  # the stream is still open
    e.feed("s", "s", torch.tensor([3.0]), True)
    (m,) = e.step()
    assert m.outputs["y"].tolist() == [2.0, 4.0, 6.0]
    e.add(StageRequest("gone", {}, {}))
    e.feed("gone", "s", torch.tensor([1.0]), False)
    e.abort("gone")
    assert e.num_requests() == 0 and not e.has_work()
