"""`omnistage bench runtime [--quick] [--runs N] [--json FILE]`: the embedded runtime's costs
(`--backend ray`: the Ray Serve backend against it, see bench/ray_runtime.py).

Measured through the runtime's real worker loop (Pipeline -> orchestrator -> worker processes):
- hop_us_p50 / hop_us_p99: one-way latency of an empty message from the emitting stage's
  module returning to the next stage's module being called with it (receiver idle: requests
  are sent one at a time). Both stamps are CLOCK_MONOTONIC, comparable across processes.
- transfer_gbps: a 64 MiB float32 tensor held in the producer's private memory, from the
  producer's module returning it to the consumer's module having summed every element
  (steady state: the first transfer of each run is a warm-up and not counted). Each transfer
  carries a different tensor (the request's nonce is written into its first element) and the
  consumer reports the CRC-32 of the bytes it read, which the bench checks against its own
  copy: a corrupted, stale or skipped transfer fails the run.
- graph4_overhead_ms_p50: end-to-end `Pipeline.run` time of a diamond of four no-op stages.
References measured in the same run (each right after the figure it explains, since the
machine is shared and noisy): a bare multiprocessing pipe one-way hop between two processes,
and, inside the producer worker, one copy of the same tensor into a private buffer plus a sum
of it (the floor of any transport that must copy out of the producer's private memory once),
with the ratios of each figure to its reference.
Each figure is the median over runs, with min and max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

TARGETS = {"hop_us_p50": ("<=", 500.0), "transfer_gbps": (">=", 2.0), "graph4_overhead_ms_p50": ("<=", 5.0)}


# -- modules run inside the workers (imported there by factory path) -------------------------
class HopStamp(nn.Module):
    def forward(self, x):
        return {"t": time.perf_counter_ns()}


class HopReceive(nn.Module):
    def forward(self, t):
        return {"hop_ns": time.perf_counter_ns() - t}


class BigProducer(nn.Module):
    """Sends its private tensor; with params.reference it instead times, in its own process,
    one copy into a private buffer plus a sum of it (the floor of any copy-once transport)."""

    def __init__(self, mib: int = 64, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.buf = torch.randn(mib * 1024 * 1024 // 4, generator=g)
        self.scratch = torch.zeros_like(self.buf)  # touched: no page faults when timed

    def forward(self, x, params=None):
        if (params or {}).get("nonce") is not None:  # a different tensor for every transfer
            self.buf[0] = float(params["nonce"])
        if (params or {}).get("reference"):
            t0 = time.perf_counter_ns()
            self.scratch.copy_(self.buf)
            total = float(self.scratch.sum())
            return {"payload": {"tensor": None, "ref_dt_ns": time.perf_counter_ns() - t0, "sum": total}}
        return {"payload": {"tensor": self.buf, "t0": time.perf_counter_ns()}}


class BigConsumer(nn.Module):
    def forward(self, payload):
        if payload["tensor"] is None:
            return {"result": {"dt_ns": payload["ref_dt_ns"], "sum": payload["sum"]}}
        total = float(payload["tensor"].sum())  # reads every byte
        dt_ns = time.perf_counter_ns() - payload["t0"]
        crc = zlib.crc32(payload["tensor"].numpy())  # after the clock stops: not timed
        return {"result": {"dt_ns": dt_ns, "sum": total, "crc32": crc}}


def _yaml(name: str, body: str) -> str:
    return f"name: {name}\n" + body


HOP_YAML = """
inputs: {x: any}
outputs: {hop_ns: any}
stages:
  src:
    kind: torch_module
    params: {factory: "omnistage.bench.runtime:HopStamp", inputs: {x: any}, outputs: {t: any}}
    batching: {policy: none}
  dst:
    kind: torch_module
    params: {factory: "omnistage.bench.runtime:HopReceive", inputs: {t: any}, outputs: {hop_ns: any}}
    batching: {policy: none}
edges:
  - {from: inputs.x, to: src.x}
  - {from: src.t, to: dst.t}
  - {from: dst.hop_ns, to: outputs.hop_ns}
"""

BIG_YAML = """
inputs: {x: any}
outputs: {result: json}
stages:
  producer:
    kind: torch_module
    params: {factory: "omnistage.bench.runtime:BigProducer", kwargs: {mib: MIB}, inputs: {x: any}, outputs: {payload: any}, pass_params: true}
    batching: {policy: none}
  consumer:
    kind: torch_module
    params: {factory: "omnistage.bench.runtime:BigConsumer", inputs: {payload: any}, outputs: {result: json}}
    batching: {policy: none}
edges:
  - {from: inputs.x, to: producer.x}
  - {from: producer.payload, to: consumer.payload}
  - {from: consumer.result, to: outputs.result}
"""

GRAPH4_YAML = """
inputs: {x: any}
outputs: {y: any}
stages:
  a: {kind: noop, params: {inputs: {x: any}}, batching: {policy: dynamic, max_wait_ms: 0}}
  b: {kind: noop, params: {inputs: {x: any}}, batching: {policy: dynamic, max_wait_ms: 0}}
  c: {kind: noop, params: {inputs: {x: any}}, batching: {policy: dynamic, max_wait_ms: 0}}
  d: {kind: noop, params: {inputs: {l: any, r: any}}, batching: {policy: dynamic, max_wait_ms: 0}}
edges:
  - {from: inputs.x, to: a.x}
  - {from: a.x, to: b.x}
  - {from: a.x, to: c.x}
  - {from: b.x, to: d.l}
  - {from: c.x, to: d.r}
  - {from: d.l, to: outputs.y}
"""


# -- reference: a bare pipe between two processes --------------------------------------------
def _pipe_echo(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(msg)


def pipe_hop_us(samples: int) -> list[float]:
    from omnistage.runtime.fork_server import mp_context, without_main_reimport

    ctx = mp_context()
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_pipe_echo, args=(b,), daemon=True)
    with without_main_reimport():
        proc.start()
    b.close()
    out = []
    for i in range(samples + 20):
        t0 = time.perf_counter_ns()
        a.send({"t": t0})
        a.recv()
        if i >= 20:
            out.append((time.perf_counter_ns() - t0) / 2000.0)
        time.sleep(0.0005)
    a.send(None)
    proc.join(5)
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summary(runs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def _hop_samples(hop, count: int) -> list[float]:
    """One-way hop latencies (us), one request at a time so the receiver is idle."""
    for _ in range(10):
        hop.run({"x": 0})
    samples = []
    for _ in range(count):
        samples.append(hop.run({"x": 0})["hop_ns"] / 1000.0)
        time.sleep(0.001)  # receiver idle when the next message comes
    return samples


class TransferCheck:
    """The bench's own copy of the producer's tensor: the CRC-32 each transfer must arrive with."""

    def __init__(self, mib: int):
        self.buf = BigProducer(mib).buf
        self.nonce = 0
        self.verified: list[dict[str, int]] = []

    def params(self) -> dict[str, Any]:
        self.nonce += 1
        return {"producer": {"nonce": self.nonce}}

    def verify(self, result: dict[str, Any]) -> None:
        self.buf[0] = float(self.nonce)
        expected = zlib.crc32(self.buf.numpy())
        if result["crc32"] != expected:
            raise RuntimeError(f"transfer {self.nonce} corrupted: crc32 {result['crc32']:#x} != {expected:#x}")
        self.verified.append({"nonce": self.nonce, "crc32": expected})


def _transfer_rates(big, mib: int, count: int, check: TransferCheck) -> tuple[float, float]:
    """Median GB/s of the producer -> consumer transfer (each one's checksum verified), then of
    the in-producer copy + sum reference measured right after it (same process, same conditions)."""
    check.verify(big.run({"x": 0}, check.params())["result"])  # warm-up: segments allocated and mapped
    rates = []
    for _ in range(count):
        r = big.run({"x": 0}, check.params())["result"]
        check.verify(r)
        rates.append(mib * 1024 * 1024 / (r["dt_ns"] / 1e9) / 1e9)
    ref_rates = []
    for _ in range(count):
        r = big.run({"x": 0}, {"producer": {"reference": True}})["result"]
        ref_rates.append(mib * 1024 * 1024 / (r["dt_ns"] / 1e9) / 1e9)
    return statistics.median(rates), statistics.median(ref_rates)


def _graph4_p50_ms(graph, count: int) -> float:
    """p50 of end-to-end Pipeline.run through the diamond of four no-op stages (ms)."""
    for _ in range(10):
        graph.run({"x": 0})
    times = []
    for i in range(count):
        t0 = time.perf_counter()
        out = graph.run({"x": i})
        times.append((time.perf_counter() - t0) * 1000.0)
        if out["y"] != i:
            raise RuntimeError(f"graph4 returned {out['y']!r} for input {i}")
    return _pct(times, 0.5)


def run_bench(quick: bool = False, runs: int = 3, progress: bool = True) -> dict[str, Any]:
    from omnistage.graph.loader import load_pipeline_text
    from omnistage.runtime.pipeline import Pipeline

    torch.set_num_threads(1)
    mib = 8 if quick else 64
    hops_per_run = 40 if quick else 300
    transfers_per_run = 3 if quick else 8
    graph_per_run = 30 if quick else 200
    specs = {
        "hop": load_pipeline_text(_yaml("bench-hop", HOP_YAML), "bench-hop.yaml"),
        "big": load_pipeline_text(_yaml("bench-transfer", BIG_YAML.replace("MIB", str(mib))), "bench-transfer.yaml"),
        "graph4": load_pipeline_text(_yaml("bench-graph4", GRAPH4_YAML), "bench-graph4.yaml"),
    }
    pipes = {k: Pipeline.from_spec(s, wait_ready=False) for k, s in specs.items()}  # start in parallel
    try:
        for p in pipes.values():
            p.wait_ready(300)
        from tqdm import tqdm

        bar = tqdm(total=runs * 4, desc="bench runtime", disable=not progress, file=sys.stderr)
        hop_p50, hop_p99, pipe_p50, gbps, g4, ref_copy = [], [], [], [], [], []
        hop_samples, pipe_samples = [], []  # every run's samples, for the histogram
        check = TransferCheck(mib)
        for _ in range(runs):
            samples = _hop_samples(pipes["hop"], hops_per_run)
            hop_p50.append(_pct(samples, 0.5))
            hop_p99.append(_pct(samples, 0.99))
            hop_samples += samples
            bar.update()
            pipe = pipe_hop_us(hops_per_run)
            pipe_p50.append(_pct(pipe, 0.5))
            pipe_samples += pipe
            bar.update()
            rate, reference_rate = _transfer_rates(pipes["big"], mib, transfers_per_run, check)
            gbps.append(rate)
            ref_copy.append(reference_rate)
            bar.update()
            g4.append(_graph4_p50_ms(pipes["graph4"], graph_per_run))
            bar.update()
        bar.close()
    finally:
        for p in pipes.values():
            p.close(drain_timeout=5)
    spread = {
        "hop_us_p50": _summary(hop_p50),
        "hop_us_p99": _summary(hop_p99),
        "transfer_gbps": _summary(gbps),
        "graph4_overhead_ms_p50": _summary(g4),
    }
    figures = {k: v["median"] for k, v in spread.items()}
    reference = {
        "pipe_hop_us_p50": _summary(pipe_p50),
        "producer_copy_and_sum_gbps": _summary(ref_copy),
        "transfer_vs_producer_copy_and_sum": _summary([g / r for g, r in zip(gbps, ref_copy)]),
        "hop_vs_pipe_p50": _summary([h / q for h, q in zip(hop_p50, pipe_p50)]),
    }
    meets = {}
    for k, (op, bound) in TARGETS.items():
        meets[k] = figures[k] <= bound if op == "<=" else figures[k] >= bound
    return {
        "bench": "runtime",
        **figures,
        "spread": spread,
        "reference": reference,
        "targets": {k: f"{op} {b}" for k, (op, b) in TARGETS.items()},
        "meets_targets": meets,
        "settings": {
            "quick": quick,
            "runs": runs,
            "tensor_mib": mib,
            "hops_per_run": hops_per_run,
            "transfers_per_run": transfers_per_run,
            "graph4_requests_per_run": graph_per_run,
            "torch_threads_per_worker": 1,
            "start_method": "forkserver",
        },
        "samples": {"hop_us": hop_samples, "pipe_hop_us": pipe_samples},
        "transfer_checksums": check.verified,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="omnistage bench runtime", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small smoke run (8 MiB, few samples)")
    ap.add_argument("--runs", type=int, default=3, help="runs per figure (median reported; >= 3)")
    ap.add_argument("--json", dest="json_path", help="write the results to this file")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the hop latency histogram into this PNG")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--backend",
        choices=["embedded", "ray"],
        default="embedded",
        help="ray: Ray Serve vs embedded (bench/ray_runtime.py)",
    )
    args = ap.parse_args(argv)
    if args.backend == "ray":
        from omnistage.bench.ray_runtime import run_bench as run_ray_bench

        result = run_ray_bench(quick=args.quick, runs=max(1, args.runs), progress=not args.no_progress)
    else:
        result = run_bench(quick=args.quick, runs=max(1, args.runs), progress=not args.no_progress)
    result["command"] = "omnistage bench runtime " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json_path, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    if args.plot and args.backend == "embedded":
        from omnistage.bench.plot import plot_runtime

        plot_runtime(result, args.plot)
    # stdout: the figures and whether they meet their targets; --json has everything
    left_out = ("samples", "reference", "settings", "transfer_checksums")
    print(json.dumps({k: v for k, v in result.items() if k not in left_out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
