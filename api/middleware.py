"""ASGI middleware of the server: the API key check, the request-body size limit, and the
`Warning` header naming the request fields a route ignored.

The first two answer with OpenAI's error body. They are plain ASGI (not BaseHTTPMiddleware) so streaming
responses and disconnects pass through them untouched.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.api.errors import APIError, error_response


class ApiKeyMiddleware:
    """401 for /v1/* without `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`); /,
    /health and /metrics stay public.

    The comparison runs in constant time (`hmac.compare_digest`) so response timing reveals nothing
    about how much of a guessed key was right.
    """

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[int, str], None] | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1") or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        provided = headers.get(b"authorization", b"")
        if hmac.compare_digest(provided, self.expected) or (
                b"x-api-key" in headers and hmac.compare_digest(b"Bearer " + headers[b"x-api-key"], self.expected)):
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(401, scope["path"])
        message = "missing API key" if not (provided or b"x-api-key" in headers) else "invalid API key"
        response = error_response(APIError(
            401, f"{message}: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        ), scope["path"])
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes`: at once from Content-Length, else while reading
    (chunked uploads), by failing the body read with an `APIError` that the handlers answer."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[int, str], None] | None = None) -> None:
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            if self.on_reject is not None:
                self.on_reject(413, scope["path"])
            await error_response(self._too_large(), scope["path"])(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large")


def warning_value(ignored: list[str], most: int = 16) -> bytes:
    """The header's value: a quoted string escaped as JSON escapes it (ASCII, no line breaks, which
    a field name from a client's JSON may hold), at most `most` names."""
    names = ", ".join(ignored[:most]) + (f" and {len(ignored) - most} more" if len(ignored) > most else "")
    return b"299 specdec " + json.dumps(f"ignored unknown fields: {names}").encode()


class IgnoredFieldsHeader:
    """Adds `Warning: 299 specdec "ignored unknown fields: a, b"` (RFC 9111's miscellaneous
    persistent warning) to the answer of a request whose route set `request.state.ignored_fields`
    (`ServerState.screen_fields`), streamed or not."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_warning(message: Message) -> None:
            ignored = scope.get("state", {}).get("ignored_fields")
            if message["type"] == "http.response.start" and ignored:
                message = {**message, "headers": [*message.get("headers", []), (b"warning", warning_value(ignored))]}
            await send(message)

        await self.app(scope, receive, send_with_warning)
