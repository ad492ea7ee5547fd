"""Start-up failures are reported clearly and leave nothing running."""

import multiprocessing
import os

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


def test_a_factory_that_does_not_resolve_is_one_line_with_a_suggestion(caplog):
    from omnistage.graph.loader import load_pipeline_text
    from omnistage.runtime.pipeline import Pipeline

    text = YAML.replace(
        'kind: noop\n    pool: {devices: ["cuda:63"]}', "kind: torch_module\n    params: {factory: 'torch.nn:Linr'}"
    )
    text = text.replace("inputs: {x: any}", "inputs: {x: tensor}").replace("outputs: {y: any}", "outputs: {y: tensor}")
    text = text.replace("n.x, to: outputs", "n.y, to: outputs")
    spec = load_pipeline_text(text, "bad-factory.yaml")
    with pytest.raises(StageError, match=r"'torch.nn' has no attribute 'Linr' \(did you mean 'Linear'\?\)"):
        Pipeline.from_spec(spec, ready_timeout=60)
    logged = [r.getMessage() for r in caplog.records if "failed to start" in r.getMessage()]
    assert logged and all("Traceback" not in m and "\n" not in m for m in logged), logged


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


def test_a_pipeline_start_prints_no_third_party_chatter(tmp_path):
    """Workers start with transformers', diffusers' and huggingface_hub's advisories and bars
    off (runtime/third_party_output.py): a tiny-image start and close prints nothing; with
    OMNISTAGE_QUIET=0 diffusers' advisory about `accelerate` is back (the judge that the
    libraries do print when allowed to)."""
    import subprocess
    import sys

    script = "from omnistage import Pipeline\nwith Pipeline.from_yaml('tiny-image', ready_timeout=120):\n    pass\n"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSFORMERS_", "DIFFUSERS_", "HF_HUB_"))}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**base, "PYTHONSAFEPATH": "1", **extra},
        )  # fmt: skip
        for extra in ({}, {"OMNISTAGE_QUIET": "0"})
    ]  # both at once: each mostly waits on its workers' start
    (quiet, _), (loud, _) = [(p.communicate(timeout=300)[1], p.returncode) for p in runs]
    quiet_code, loud_code = (p.returncode for p in runs)
    assert quiet_code == 0 and quiet == "", quiet[-2000:]
    assert loud_code == 0 and "accelerate" in loud, loud[-2000:]


def test_a_pipeline_not_ready_in_time_raises_pipeline_not_ready():
    """An OmnistageError like every other failure of the API, and still a TimeoutError."""
    from omnistage.errors import OmnistageError, PipelineNotReadyError
    from omnistage.graph.loader import load_pipeline_text
    from omnistage.runtime.pipeline import Pipeline
    from omnistage.tests.runtime.conftest import slow_build_yaml

    with pytest.raises(PipelineNotReadyError) as info:
        Pipeline.from_spec(load_pipeline_text(slow_build_yaml(60), "slow-build.yaml"), ready_timeout=1)
    assert isinstance(info.value, OmnistageError) and isinstance(info.value, TimeoutError)
    assert info.value.status == 503 and "loading" in str(info.value)
