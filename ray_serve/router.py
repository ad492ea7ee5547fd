"""PinnedRouter: Serve's power-of-two-choices routing, except for a request's follow-up calls.

A stage replica keeps per-request state (the fan-in join, the engine's sequence), so the
deliveries that follow a request's `open` must reach that same replica. Those calls carry the
replica's id as the `replica` keyword argument; this router sends them there and nowhere else
when that replica is still a candidate. When it is gone, any replica gets the call and
answers that it does not know the request, which fails the request (only that one).
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

PIN_KWARG = "replica"


class PinnedRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pin = pending_request.kwargs.get(PIN_KWARG) if pending_request is not None else None
        if pin:
            held = [r for r in candidate_replicas if r.replica_id.unique_id == pin]
            if held:
                return [held]
        return await super().choose_replicas(candidate_replicas, pending_request)
