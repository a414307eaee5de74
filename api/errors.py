"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure
(Anthropic's `{"type": "error", "error": {"type", "message"}}` on /v1/messages).

Handlers turn FastAPI's validation errors (bad JSON, wrong types, out-of-range values) into 400s,
`APIError` into its own status, and anything unexpected into a 500 with the same body shape, so a
client never sees a bare HTML or `{"detail": ...}` page.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("specdec.api")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(StarletteHTTPException):
    """An error answered with OpenAI's error body. Subclasses Starlette's HTTPException so that it
    also passes through FastAPI's body parsing (e.g. when raised by the body-size guard)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        type: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, headers=headers)
        self.message, self.param, self.code = message, param, code
        self.type = type or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    """The error's answer, in Anthropic's shape on its paths (/v1/messages...)."""
    body = (anthropic_error_body(exc.status_code, exc.message) if path.startswith("/v1/messages")
            else error_body(exc.message, exc.type, exc.param, exc.code))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending parameter (dotted path)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('msg', '')}", code="invalid_json")
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":  # OpenAI's answer to a field it does not know
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    msg = err.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI, on_error: Callable[[int, str], None] | None = None) -> None:
    """Register the handlers; `on_error(status, path)` is told about each error response (metrics)."""

    def _answer(request: Request, exc: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(exc.status_code, request.url.path)
        return error_response(exc, request.url.path)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(request, validation_error(exc))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, APIError):
            return _answer(request, exc)
        return _answer(request, APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _answer(request, APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
