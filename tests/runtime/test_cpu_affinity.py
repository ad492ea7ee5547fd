"""`pool.cpus`: a stage's workers run on the CPUs it names (the kernel's affinity of the worker
process is the judge), and CPUs the machine lacks fail the start with the stage's place."""

import os

import pytest

from omnistage import Pipeline
from omnistage.errors import StageError

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")


def test_the_workers_run_on_the_pools_cpus():
    with Pipeline.from_yaml("tiny-llm", ["stages.llm.pool.cpus=1"]) as pipeline:
        pids = [pid for pids in pipeline.worker_pids().values() for pid in pids]
        assert pids and all(os.sched_getaffinity(pid) == {1} for pid in pids)
        out = pipeline.run({"prompt": "Hello"}, {"llm": {"max_tokens": 3, "temperature": 0}})
        assert out["info"]["usage"]["completion_tokens"] == 3
    with Pipeline.from_yaml("tiny-llm") as pipeline:  # no cpus: where this process may run
        pids = [pid for pids in pipeline.worker_pids().values() for pid in pids]
        assert all(os.sched_getaffinity(pid) == os.sched_getaffinity(0) for pid in pids)


def test_cpus_the_machine_lacks_fail_the_start():
    with pytest.raises(StageError, match=r"pool\.cpus: no CPU 4096 on this machine .*tiny-llm\.yaml:\d+:\d+"):
        Pipeline.from_yaml("tiny-llm", ["stages.llm.pool.cpus=[1, 4096]"])
