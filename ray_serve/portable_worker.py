"""The worker a stage replica's engine process runs (see ray_serve/engine_process.py):
`python -m omnistage.ray_serve.portable_worker FD`, FD its end of the replica's pipe.

Outputs travel by value in the pipe to the replica, not as references to the runtime's
shared-memory segments: the next hop is Ray's object store, which copies them anyway, maybe
to another node. Device tensors are copied to the host first.
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from omnistage.errors import one_line_error
from omnistage.ray_serve.options import PipelineSource
from omnistage.runtime.messages import StartFailed, recv_msg, send_msg
from omnistage.runtime.worker import Worker, WorkerConfig, worker_main


def run_worker(conn: Connection) -> None:
    """Read (pipeline source, pipeline, stage, replica index) from the replica, load the
    pipeline and run the worker."""
    source, pipeline, stage, replica = recv_msg(conn)
    try:
        spec = PipelineSource.from_dict(source).load(pipeline)
    except Exception as exc:  # noqa: BLE001 - reported as the replica's start-up error
        send_msg(conn, StartFailed(one_line_error(exc), traceback.format_exc(limit=6)))
        return
    # Ray hands a GPU replica its device as the only visible one
    device = "cuda:0" if any(d.startswith("cuda") for d in spec.stages[stage].pool.devices) else "cpu"
    # the prefix names shared-memory segments, which this worker never creates
    cfg = WorkerConfig(spec, stage, replica, device, f"omnistage-ray-{os.getpid()}")
    worker_main(cfg, conn, PortableWorker)


class PortableWorker(Worker):
    """The embedded worker, its outputs sent by value instead of as shared-memory references.
    Edge permits and streaming credit are the graph driver's business (ray_serve/driver.py)."""

    def _encode_output(self, value: Any, readers: int) -> Any:
        return portable(value)


def portable(value: Any) -> Any:
    """A value another node can read: device tensors are copied to the host."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.cpu()
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        return type(value)(portable(v) for v in value)
    return value


if __name__ == "__main__":  # started by ray_serve/engine_process.py with its end of the pipe
    run_worker(Connection(int(sys.argv[1])))
