"""Start-up failures are reported clearly and leave nothing running."""

import os
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


def test_workers_wait_passively_for_openmp_partners(diamond):
    # Spin-waiting OpenMP threads steal the cores other stages need; workers default to PASSIVE.
    pids = [pid for reps in diamond.worker_pids().values() for pid in reps if pid]
    assert pids
    for pid in pids:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        expected = os.environ.get("OMP_WAIT_POLICY", "PASSIVE").encode()
        assert b"OMP_WAIT_POLICY=" + expected in env
