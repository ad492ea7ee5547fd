"""Start-up failures are reported clearly and leave nothing running."""

import multiprocessing

import pytest

from omnistage.errors import StageError

YAML = """
name: bad-device
inputs: {x: any}
outputs: {y: any}
stages:
  n:
    kind: noop
    pool: {devices: ["cuda:63"]}
edges:
  - {from: inputs.x, to: n.x}
  - {from: n.x, to: outputs.y}
"""


def test_missing_device_is_a_clear_start_error():
    from omnistage.graph.loader import load_pipeline_text
    from omnistage.runtime.pipeline import Pipeline

    spec = load_pipeline_text(YAML, "bad-device.yaml")
    with pytest.raises(StageError, match=r"cuda:63 is not available"):
        Pipeline.from_spec(spec, ready_timeout=60)
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("omnistage:bad-device:")]


def test_workers_get_the_bounded_openmp_spin(diamond):
    # Unbounded spin-waiting steals the cores other stages need, sleeping at once slows every
    # op: workers get the bounded spin of runtime.openmp unless the environment says otherwise.
    from omnistage.runtime.openmp import openmp_env

    pids = [pid for reps in diamond.worker_pids().values() for pid in reps if pid]
    assert pids
    want = openmp_env()
    assert want  # the default, or the settings the test run was started with
    for pid in pids:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        for key, value in want.items():
            assert f"{key}={value}".encode() in env
