"""The steps both runtimes (the embedded orchestrator and the Ray driver) take alike around
their requests: waiting until every stage is ready, refusing a request that cannot be admitted
now, and draining the requests in flight at close. Each runs with the runtime's condition held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from omnistage.errors import InvalidRequestError, OverloadedError, PipelineClosedError, PipelineNotReadyError
from omnistage.graph.spec import PipelineSpec
from omnistage.runtime.routing import RequestRecord, Router


def wait_until_ready(
    cond: threading.Condition,
    pipeline: str,
    timeout: float | None,
    *,
    ready: Callable[[], bool],
    closed: Callable[[], bool],
    waiting: Callable[[], list[str]],
    check: Callable[[], None] = lambda: None,
) -> None:
    """With `cond` held: returns once `ready()`; raises PipelineClosedError once `closed()`,
    PipelineNotReadyError naming `waiting()` after `timeout` seconds (None: no limit), and
    whatever `check()` raises (a replica that failed to start)."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        check()
        if ready():
            return
        if closed():
            raise PipelineClosedError(f"pipeline {pipeline!r} is closed")
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            raise PipelineNotReadyError(
                f"pipeline {pipeline!r}: not ready after {timeout}s (waiting for {', '.join(waiting())})"
            )
        cond.wait(left if left is not None else 1.0)


def refuse_unadmittable(
    spec: PipelineSpec, requests: dict[str, RequestRecord], rid: str, *, started: bool, closing: bool,
    counts: dict[str, int],
) -> None:  # fmt: skip
    """With the runtime's lock held: raise when request `rid` cannot be admitted now (the
    pipeline not started or closing, `max_queued_requests` in flight, the id already in flight;
    a refusal for load counts in `counts["rejected"]`)."""
    if closing or not started:
        raise PipelineClosedError(f"pipeline {spec.name!r} is {'not started' if not started else 'closed'}")
    if len(requests) >= spec.max_queued_requests:
        counts["rejected"] += 1
        raise OverloadedError(
            f"pipeline {spec.name!r} is overloaded: {len(requests)} requests in flight "
            f"(max_queued_requests={spec.max_queued_requests}); retry later"
        )
    if rid in requests:
        raise InvalidRequestError(f"request id {rid!r} is already in flight", param="request_id")


def drain_requests(cond: threading.Condition, requests: dict[str, RequestRecord], router: Router, pipeline: str,
                   timeout: float) -> None:  # fmt: skip
    """With `cond` held: waits up to `timeout` seconds for `requests` to finish (their ends notify
    `cond`), then ends every one left with PipelineClosedError."""
    end = time.monotonic() + max(0.0, timeout)
    while requests and time.monotonic() < end:
        cond.wait(min(0.1, max(0.0, end - time.monotonic())))
    for req in list(requests.values()):
        router.finish(req, PipelineClosedError(f"pipeline {pipeline!r} closed before the request finished"), "closed")
