"""Runtime faults: a stage whose constructor raises, restarts that keep failing (give up),
requests that arrive while a replica restarts."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch

from omnistage.errors import StageError, WorkerDiedError
from omnistage.graph.loader import load_pipeline_text
from omnistage.runtime.pipeline import Pipeline
from omnistage.runtime.replicas import MAX_RESTART_FAILURES
from omnistage.tests.runtime.conftest import one_stage_yaml, wait_for


def one_stage(factory: str, kwargs: str = "{}", name: str = "faulty") -> str:
    return one_stage_yaml(factory, name=name, kwargs=kwargs, pass_params=False)


def test_constructor_that_raises_fails_the_start_with_its_message(caplog):
    caplog.set_level(logging.WARNING, logger="omnistage.runtime")
    spec = load_pipeline_text(
        one_stage("omnistage.tests.runtime.fault_modules:RaisesInConstructor", "{message: weights are corrupt}"),
        "f.yaml",
    )
    t0 = time.monotonic()
    with pytest.raises(StageError, match="weights are corrupt") as info:
        Pipeline.from_spec(spec)
    assert "s" in str(info.value) and "failed to start" in str(info.value)
    assert time.monotonic() - t0 < 60  # reported, not waited out
    # where the stage is in the file, as a YAML error would say it
    assert str(info.value).endswith(f"(stage defined at {spec.stages['s'].pos})")
    assert str(spec.stages["s"].pos).startswith("f.yaml:")
    # the log has the worker's traceback (the exception's message is one line)
    logged = [r.getMessage() for r in caplog.records if r.name == "omnistage.runtime"]
    assert any("failed to start" in m and "Traceback" in m for m in logged), logged


def test_restarts_that_keep_failing_give_up_and_fail_requests(tmp_path, caplog):
    marker = tmp_path / "built"
    spec = load_pipeline_text(
        one_stage("omnistage.tests.runtime.fault_modules:BuildsOnce", f"{{marker: '{marker}'}}"), "f.yaml"
    )
    caplog.set_level(logging.ERROR, logger="omnistage.runtime")
    with Pipeline.from_spec(spec) as p:
        x = torch.arange(4.0)
        assert torch.equal(p.run({"x": x}, timeout=30)["y"], x * 2)
        (pid,) = p.worker_pids()["s"]
        os.kill(pid, signal.SIGKILL)
        # every restart's build raises: MAX_RESTART_FAILURES more tries, then it gives up
        wait_for(
            lambda: marker.stat().st_size >= MAX_RESTART_FAILURES + 1,
            60,
            f"restarts stopped early: {marker.stat().st_size} refused builds",
        )
        time.sleep(1.0)  # a replica that had not given up would try again within this
        assert marker.stat().st_size == MAX_RESTART_FAILURES + 1
        with pytest.raises(WorkerDiedError, match="could not be restarted.*rebuild refused") as info:
            p.run({"x": x}, timeout=30)
        assert p.stage_ready() == {"s": False}
    assert_short_client_message(str(info.value), "stage 's'", "replica 0", "not retryable")
    # the worker's traceback went to the server log, not to the client
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "omnistage.runtime")
    assert "Traceback" in logged and "fault_modules.py" in logged and "rebuild refused" in logged, logged


def assert_short_client_message(message: str, *must_name: str) -> None:
    """What may reach an HTTP client: one line naming the stage, replica and whether a retry
    can help; no traceback, no source paths."""
    assert "\n" not in message and "Traceback" not in message and 'File "' not in message, message
    assert ".py" not in message and len(message) < 300, message
    for part in must_name:
        assert part in message, (part, message)


def test_requests_arriving_during_a_restart_complete():
    spec = load_pipeline_text(
        one_stage("omnistage.runtime.testmodules:SlowToBuild", "{build_s: 1.0}", name="restarting"), "r.yaml"
    )
    with Pipeline.from_spec(spec) as p:
        x = torch.arange(3.0)
        assert torch.equal(p.run({"x": x}, timeout=30)["y"], x)
        (pid,) = p.worker_pids()["s"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not p.stage_ready()["s"], 10, "the death was never noticed")
        results: dict[int, object] = {}

        def call(i):
            try:
                results[i] = p.run({"x": x + i}, timeout=20)["y"]
            except Exception as exc:  # noqa: BLE001 - reported below
                results[i] = exc

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        for i in range(4):
            assert isinstance(results[i], torch.Tensor), results[i]
            assert torch.equal(results[i], x + i)
        assert p.stage_ready() == {"s": True}
        new_pid = p.worker_pids()["s"][0]
        assert new_pid != pid
