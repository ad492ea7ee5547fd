"""OpenAI-style JSON errors for every failure the HTTP layer can answer with.

Body: {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}.
`type` follows OpenAI's families by status (invalid_request_error for 4xx, server_error for
5xx, ...); `code` is the specific reason (omnistage.errors classes carry it as `.code`).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.errors import NotFoundError, OmnistageError

log = logging.getLogger("omnistage.serving")


def error_type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def error_body(
    message: str, *, status: int, code: str | None = None, param: str | None = None, type: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or error_type_for(status), "param": param, "code": code}}


def error_response(
    message: str,
    *,
    status: int,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, status=status, code=code, param=param), status_code=status, headers=headers)


class ServiceUnavailableError(OmnistageError):
    """503 raised by the HTTP layer itself (server draining, model still loading)."""

    status = 503
    code = "service_unavailable"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code:
            self.code = code


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"

    def __init__(self, model: str, available: list[str]):
        names = ", ".join(sorted(available)) or "none"
        super().__init__(f"The model {model!r} does not exist. Available models: {names}.")
        self.param = "model"


def omnistage_error_response(err: OmnistageError) -> JSONResponse:
    retry_after = getattr(err, "retry_after", None)  # an error that knows when to come back says so
    headers = {"Retry-After": str(retry_after or 1)} if retry_after or err.status == 503 else None
    return error_response(
        str(err) or err.__class__.__name__,
        status=err.status,
        code=err.code,
        param=getattr(err, "param", None),
        headers=headers,
    )


# Parts of a pydantic error location that name a member of a union, not a field:
# ("body", "voice", "str") is the field `voice` tried as a str.
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none"})


def _is_union_member_tag(part: str) -> bool:
    return part in _UNION_MEMBER_TAGS or part[:1].isupper() or any(c in part for c in "[]-'(), ")


def loc_to_param(loc: tuple | list) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; ("body", "voice", "str") -> "voice"."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header", "cookie")]
    parts = [p for p in parts if not (isinstance(p, str) and _is_union_member_tag(p))]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _most_specific(errors: list[dict]) -> tuple[dict, int]:
    """The error to report, and how many other problems there are. Of the errors at one field
    tried as each member of a union (`content` as a string, then as a list of parts), the one
    that got deepest into the value is the member the client meant; the others are not more
    problems."""
    if not errors:
        return {}, 0
    fields = [_union_field(e.get("loc", ())) for e in errors]
    same_field = [e for e, f in zip(errors, fields) if f == fields[0]]
    chosen = max(same_field, key=lambda e: len(e.get("loc", ())))
    member = _union_member(chosen.get("loc", ()))
    in_member = {tuple(e.get("loc", ())) for e in same_field if _union_member(e.get("loc", ())) == member}
    return chosen, len(set(fields)) - 1 + len(in_member) - 1


def _union_member(loc: tuple | list) -> tuple:
    """An error location up to and including its first union member tag."""
    field = _union_field(loc)
    return tuple(loc[: len(field) + 1])


def _union_field(loc: tuple | list) -> tuple:
    """An error location up to its first union member tag: the field the union is at."""
    out = []
    for part in loc:
        if isinstance(part, str) and _is_union_member_tag(part):
            break
        out.append(part)
    return tuple(out)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    # OpenAI answers malformed requests with 400 invalid_request_error naming the parameter.
    errors = exc.errors()
    first, others = _most_specific(errors)
    param = loc_to_param(first.get("loc", ()))
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        message = "We could not parse the JSON body of your request" + (f" ({detail})." if detail else ".")
        return error_response(message, status=400, code="invalid_json")
    if param is None and first.get("type") == "missing":
        return error_response("The request has no body: send a JSON object.", status=400, code="missing_body")
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        message = "The request body must be a JSON object, sent with Content-Type: application/json."
        return error_response(message, status=400, code="invalid_body")
    message = f"{param}: {msg}" if param else msg
    if others:
        message += f" (and {others} more problem{'s' if others > 1 else ''})"
    return error_response(message, status=400, code="invalid_value" if param else "invalid_request", param=param)


def http_error_response(exc: StarletteHTTPException, request: Request) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        message = f"Unknown route: {request.method} {request.url.path}"
        code = "not_found"
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
        code = "method_not_allowed"
    elif status == 413:
        limit = getattr(request.app.state, "max_body_bytes", None)
        message = body_too_large_message(limit) if limit is not None else "The request body is too large."
        code = "body_too_large"
    elif status == 400 and exc.detail == BODY_PARSE_FAILED:
        message, code = _parse_failure_message(exc.__cause__), "invalid_json"
    else:
        message = str(exc.detail)
        code = None
    return error_response(message, status=status, code=code, headers=getattr(exc, "headers", None))


# FastAPI's detail when reading the body failed other than by a JSON syntax error
BODY_PARSE_FAILED = "There was an error parsing the body"


def _parse_failure_message(cause: BaseException | None) -> str:
    if isinstance(cause, RecursionError):
        return "We could not parse the JSON body of your request: it is nested too deeply."
    if isinstance(cause, UnicodeDecodeError):
        return "We could not parse the JSON body of your request: it is not valid UTF-8."
    return "We could not parse the JSON body of your request."


def body_too_large_message(limit: int) -> str:
    return f"The request body is larger than this server's limit of {limit} bytes (--max-body-bytes)."


def storage_full(exc: BaseException | None) -> bool:
    """A write failed for lack of space: ENOSPC/EDQUOT/EFBIG (RLIMIT_FSIZE), or SQLite's
    "database or disk is full", also as the cause of another exception."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if type(exc).__name__ == "OperationalError" and "disk is full" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OmnistageError)
    async def _omnistage(request: Request, exc: OmnistageError):
        prompt_field = getattr(request.state, "prompt_field", None)  # set by an OpenAI-style route
        if prompt_field is not None and getattr(exc, "param", None) == "prompt":
            exc.param = prompt_field
        if exc.status >= 500 and exc.status != 503:
            log.warning("%s %s failed: %s", request.method, request.url.path, exc)
        return omnistage_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return http_error_response(exc, request)

    # handled here rather than by the catch-all below, which answers and then re-raises (the
    # server closes the connection)
    async def _storage(request: Request, exc: Exception):
        if not storage_full(exc):
            raise exc
        log.error("%s %s: storage full: %s", request.method, request.url.path, exc)
        return error_response(
            "The server's storage is full (its job store or output directory); nothing was stored. Retry later.",
            status=507,
            code="storage_full",
            headers={"Retry-After": "30"},
        )

    app.add_exception_handler(OSError, _storage)
    app.add_exception_handler(sqlite3.OperationalError, _storage)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"Internal server error: {exc.__class__.__name__}", status=500, code="internal_error")
