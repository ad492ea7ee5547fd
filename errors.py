"""Errors that cross module boundaries. Each maps to one HTTP status in serving/."""

from __future__ import annotations


class OmnistageError(Exception):
    """Base class. `status` is the HTTP status the serving layer answers with."""

    status = 500
    code = "internal_error"


class InvalidRequestError(OmnistageError):
    """The request itself is wrong (bad parameter, prompt too long, ...)."""

    status = 400
    code = "invalid_request"  # a subclass's own reason replaces it

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:  # a more specific reason than the class's (image_too_large, ...)
            self.code = code
        elif param is not None and type(self).code == InvalidRequestError.code:
            self.code = "invalid_value"  # as a schema violation naming its field is


# the codes InvalidRequestError gives itself (from whether a param is named): not sent along
# with a stage's error, which the receiving side rebuilds with the same param
DEFAULT_INVALID_CODES = frozenset({"invalid_request", "invalid_value"})


class ContextLengthExceededError(InvalidRequestError):
    """The prompt does not fit the model's context (OpenAI's code for it)."""

    code = "context_length_exceeded"


class VideoTooLargeError(InvalidRequestError):
    """A video over its encoded size or decoded-RGB limit (stages/media_limits.py)."""

    status = 413
    code = "video_too_large"


_CODE_OWNERS = {cls.code: cls for cls in (ContextLengthExceededError, VideoTooLargeError)}


def invalid_request(message: str, param: str | None, code: str | None) -> InvalidRequestError:
    """An InvalidRequestError for `code`: of the class that owns the code where one does (its
    HTTP status comes with it), e.g. when a stage's error is rebuilt on this side of a worker."""
    return _CODE_OWNERS.get(code or "", InvalidRequestError)(message, param=param, code=code)


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
    """A replica's process died holding the request, or is down for good. The message may
    reach HTTP clients: one line (stage, replica, how it ended, whether a retry can help);
    the worker's traceback goes to the server log only."""

    code = "worker_died"
    status = 503  # the replica restarts: the same request sent again can succeed (Retry-After)
    retryable = True  # False: the replica is down for good

    @classmethod
    def replica_died(cls, stage: str, replica: int, how: str) -> WorkerDiedError:
        # the hub restarts the replica, so the same request sent again can succeed
        return cls(stage, f"replica {replica} died ({how}) while holding this request; retryable")

    @classmethod
    def replica_gone(cls, stage: str, replica: int, why: str | None) -> WorkerDiedError:
        error = cls(stage, f"replica {replica} is down and could not be restarted ({first_line(why)}); not retryable")
        error.retryable = False
        return error


def first_line(text: str | None, limit: int = 200) -> str:
    """The first line of an error text, at most `limit` characters."""
    lines = (text or "").strip().splitlines()
    line = lines[0] if lines else "unknown cause"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def one_line_error(exc: BaseException) -> str:
    """ "TypeError: message" on one line, for messages that may reach clients."""
    return first_line(f"{type(exc).__name__}: {exc}")


class PipelineNotReadyError(OmnistageError, TimeoutError):
    """A pipeline's stages were not ready within the time given (also a TimeoutError)."""

    status = 503
    code = "pipeline_not_ready"


class PipelineClosedError(OmnistageError):
    status = 503
    code = "pipeline_closed"


class NotFoundError(OmnistageError):
    status = 404
    code = "not_found"


class StageConfigError(ValueError):
    """A stage's YAML params that only building it finds wrong (a factory that does not
    import): its start fails with this message alone, no traceback."""
