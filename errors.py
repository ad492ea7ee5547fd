"""Errors that cross module boundaries. Each maps to one HTTP status in serving/."""

from __future__ import annotations


class OmnistageError(Exception):
    """Base class. `status` is the HTTP status the serving layer answers with."""

    status = 500
    code = "internal_error"


class InvalidRequestError(OmnistageError):
    """The request itself is wrong (bad parameter, prompt too long, ...)."""

    status = 400
    code = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class OverloadedError(OmnistageError):
    """The pipeline's intake queue is full; the request was rejected at once."""

    status = 503
    code = "overloaded"


class DeadlineExceededError(OmnistageError):
    status = 504
    code = "deadline_exceeded"


class RequestCancelledError(OmnistageError):
    status = 499
    code = "cancelled"


class StageError(OmnistageError):
    """A stage failed this request (raised in its engine, or its worker died)."""

    status = 500
    code = "stage_error"

    def __init__(self, stage: str, message: str):
        super().__init__(f"stage {stage!r}: {message}")
        self.stage = stage


class WorkerDiedError(StageError):
    code = "worker_died"


class PipelineClosedError(OmnistageError):
    status = 503
    code = "pipeline_closed"


class NotFoundError(OmnistageError):
    status = 404
    code = "not_found"
