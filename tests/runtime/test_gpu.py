"""The runtime's GPU paths: device selection from the pool, CUDA tensors between processes.
They run only where torch sees a CUDA device (skipped elsewhere)."""

from __future__ import annotations

import threading

import pytest
import torch

from omnistage.graph.loader import load_pipeline_text
from omnistage.runtime.pipeline import Pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WHERE_YAML = """
name: gpu-where
inputs: {x: tensor}
outputs: {y: tensor, where: any}
stages:
  s:
    kind: torch_module
    pool: {devices: %(devices)s, replicas: %(replicas)d}
    params:
      factory: "omnistage.tests.runtime.gpu_modules:WhereAmI"
      kwargs: {scale: 2.0, hold: %(hold)s}
      inputs: {x: tensor}
      outputs: {y: tensor, where: any}
    batching: {policy: none}
edges:
  - {from: inputs.x, to: s.x}
  - {from: s.y, to: outputs.y}
  - {from: s.where, to: outputs.where}
"""

CHAIN_YAML = """
name: gpu-chain
inputs: {x: tensor}
outputs: {y: tensor, first: any, second: any}
stages:
  a:
    kind: torch_module
    pool: {devices: ["cuda:0"]}
    params:
      factory: "omnistage.tests.runtime.gpu_modules:Checksum"
      inputs: {x: tensor}
      outputs: {y: tensor, info: any}
    batching: {policy: none}
  b:
    kind: torch_module
    pool: {devices: [%(second)s]}
    params:
      factory: "omnistage.tests.runtime.gpu_modules:Checksum"
      inputs: {x: tensor}
      outputs: {y: tensor, info: any}
    batching: {policy: none}
edges:
  - {from: inputs.x, to: a.x}
  - {from: a.y, to: b.x}
  - {from: a.info, to: outputs.first}
  - {from: b.info, to: outputs.second}
  - {from: b.y, to: outputs.y}
"""


def _where(devices: list[str], replicas: int, hold: float = 0.0) -> Pipeline:
    text = WHERE_YAML % {"devices": "[" + ", ".join(devices) + "]", "replicas": replicas, "hold": hold}
    return Pipeline.from_spec(load_pipeline_text(text, "gpu-where.yaml"), ready_timeout=180)


def test_a_replica_runs_on_the_device_its_pool_names():
    last = torch.cuda.device_count() - 1  # not always device 0
    x = torch.arange(6.0)
    with _where([f"cuda:{last}"], 1) as p:
        out = p.run({"x": x}, timeout=60)
        on, y = out["y"].device, out.pop("y").cpu()
    assert out["where"]["param"] == f"cuda:{last}" and out["where"]["current"] == last
    assert on.type == "cuda" and torch.equal(y, x * 2)


def test_replicas_take_the_pool_devices_in_turn():
    # replica 0 -> devices[0], replica 1 -> devices[1]: two requests held at once by the
    # least-loaded router land on one replica each
    x = torch.arange(4.0)
    outs: dict[int, dict] = {}

    def call(i):
        outs[i] = p.run({"x": x + i}, timeout=60)

    with _where(["cuda:0", "cpu"], 2, hold=2.0) as p:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        for o in outs.values():
            o["on"], o["y"] = o["y"].device.type, o["y"].cpu()
    assert sorted(o["where"]["param"] for o in outs.values()) == ["cpu", "cuda:0"]
    assert len({o["where"]["pid"] for o in outs.values()}) == 2
    for i, o in outs.items():
        assert o["on"] == ("cuda" if o["where"]["param"] == "cuda:0" else "cpu")
        assert torch.equal(o["y"], (x + i) * 2)


def _expected_info(x: torch.Tensor) -> tuple[float, float]:
    flat = x.double().reshape(-1)
    weights = torch.arange(flat.numel(), dtype=torch.float64) % 977
    return float(flat.sum()), float((flat * weights).sum())


@pytest.mark.parametrize("second", ["cuda:0", "cpu"])
def test_cuda_tensors_cross_processes_intact(second):
    """a (cuda) emits a 16 MiB CUDA tensor: it reaches b (cuda: through a CUDA IPC handle;
    cpu: the same, opened in a CPU worker) and the caller, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * 2**20, generator=g)  # 16 MiB, far above the inline limit
    with Pipeline.from_spec(load_pipeline_text(CHAIN_YAML % {"second": second}, "gpu-chain.yaml")) as p:
        for i in range(3):  # repeated: the producer's sent tensors are released and reused
            xi = x + i
            out = p.run({"x": xi}, timeout=120)
            assert out["first"]["arrived_on"] == "cpu"  # the caller's CPU tensor, via /dev/shm
            assert out["second"]["arrived_on"] == "cuda:0"  # a's output stayed on the GPU
            s, w = _expected_info(xi + 1)
            assert out["second"]["sum"] == pytest.approx(s, rel=1e-9)
            assert out["second"]["weighted"] == pytest.approx(w, rel=1e-9)
            assert out["y"].device.type == ("cuda" if second == "cuda:0" else "cpu")
            assert torch.equal(out["y"].cpu(), (xi + 1) + 1)  # float32 adds, in the stages' order
            del out  # let go of b's CUDA memory before b exits


def test_a_cuda_input_from_the_caller_reaches_the_worker():
    x = torch.randn(2**20, generator=torch.Generator().manual_seed(4)).cuda()
    with Pipeline.from_spec(load_pipeline_text(CHAIN_YAML % {"second": "cuda:0"}, "gpu-chain.yaml")) as p:
        out = p.run({"x": x}, timeout=120)
        y = out.pop("y").cpu()
    assert out["first"]["arrived_on"] == "cuda:0"  # no copy through the host
    s, w = _expected_info(x.cpu())
    assert out["first"]["sum"] == pytest.approx(s, rel=1e-9) and out["first"]["weighted"] == pytest.approx(w, rel=1e-9)
    assert torch.equal(y, (x.cpu() + 1) + 1)
