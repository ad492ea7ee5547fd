"""Pipelines shared by the runtime tests (starting worker processes costs seconds), and
helpers they import (`from omnistage.tests.runtime.conftest import ...`)."""

from __future__ import annotations

import glob
import os
import time

import pytest


def one_stage_yaml(
    factory: str, pool: str = "{}", name: str = "rel", kwargs: str = "{}", pass_params: bool = True
) -> str:
    """A pipeline of one torch_module stage (x -> y), given its request params if pass_params."""
    return f"""
name: {name}
inputs: {{x: tensor}}
outputs: {{y: tensor}}
stages:
  s:
    kind: torch_module
    params:
      factory: "{factory}"
      kwargs: {kwargs}
      pass_params: {str(pass_params).lower()}
      inputs: {{x: tensor}}
      outputs: {{y: tensor}}
    batching: {{policy: none}}
    pool: {pool}
edges:
  - {{from: inputs.x, to: s.x}}
  - {{from: s.y, to: outputs.y}}
"""


def wait_for(predicate, timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(every)


def pid_exists(pid: int) -> bool:
    """True while the process exists, zombies included (os.kill with signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def semaphore_inodes(pid: int) -> set[int]:
    """Inodes of the POSIX named semaphores (/dev/shm/sem.*) a process has mapped."""
    inodes = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/sem."):
                inodes.add(int(fields[4]))
    return inodes


def semaphore_files(inodes: set[int]) -> list[str]:
    """The /dev/shm/sem.mp-* files (multiprocessing's semaphores) that are one of `inodes`."""
    found = []
    for path in glob.glob("/dev/shm/sem.mp-*"):
        try:
            if os.stat(path).st_ino in inodes:
                found.append(path)
        except FileNotFoundError:
            pass
    return found


def slow_build_yaml(build_s: float, replicas: int = 1) -> str:
    """A one-stage pipeline whose module takes `build_s` seconds to construct (a model still
    loading), with `replicas` replicas."""
    return f"""
name: slow-build
inputs: {{x: tensor}}
outputs: {{y: tensor}}
stages:
  loading:
    kind: torch_module
    params:
      factory: omnistage.runtime.testmodules:SlowToBuild
      kwargs: {{build_s: {build_s}}}
      inputs: {{x: tensor}}
      outputs: {{y: tensor}}
    batching: {{policy: none}}
    pool: {{replicas: {replicas}}}
edges:
  - {{from: inputs.x, to: loading.x}}
  - {{from: loading.y, to: outputs.y}}
"""


SMALL_YAML = """
name: sleepy
inputs: {x: tensor}
outputs: {y: tensor}
stages:
  pre:
    kind: noop
    params: {inputs: {x: tensor}, outputs: {y: tensor}}
    batching: {policy: dynamic, max_batch_size: 8, max_wait_ms: 0}
  sleeper:
    kind: torch_module
    params:
      factory: omnistage.runtime.testmodules:Sleeper
      inputs: {x: tensor}
      outputs: {y: tensor}
      pass_params: true
    batching: {policy: none}
  copy:
    kind: noop
    params: {inputs: {x: tensor}, outputs: {y: tensor}}
    batching: {policy: dynamic, max_batch_size: 8, max_wait_ms: 0}
edges:
  - {from: inputs.x, to: pre.x}
  - {from: pre.y, to: sleeper.x, max_inflight: 1}
  - {from: sleeper.y, to: copy.x}
  - {from: copy.y, to: outputs.y}
limits:
  max_queued_requests: 3
"""


@pytest.fixture(scope="session")
def diamond():
    from omnistage.runtime.pipeline import Pipeline

    # a wider batching window on `dense` makes the poisoned-batch test deterministic
    p = Pipeline.from_yaml("tiny-diamond", ["stages.dense.batching.max_wait_ms=60"], ready_timeout=120)
    yield p
    p.close(drain_timeout=5)


@pytest.fixture(scope="session")
def sleepy():
    from omnistage.graph.loader import load_pipeline_text
    from omnistage.runtime.pipeline import Pipeline

    p = Pipeline.from_spec(load_pipeline_text(SMALL_YAML, "sleepy.yaml"), ready_timeout=120)
    yield p
    p.close(drain_timeout=5)
