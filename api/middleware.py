"""ASGI middleware of the server: the API key check and the request-body size limit.

Both answer with OpenAI's error body. They are plain ASGI (not BaseHTTPMiddleware) so streaming
responses and disconnects pass through them untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.api.errors import APIError, error_response


class ApiKeyMiddleware:
    """401 for /v1/* without `Authorization: Bearer <key>`; /, /health and /metrics stay public.

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
        provided = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(provided, self.expected):
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(401, scope["path"])
        message = "missing API key" if not provided else "invalid API key"
        response = error_response(APIError(
            401, f"{message}: send 'Authorization: Bearer <key>'", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        ))
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
            await error_response(self._too_large())(scope, receive, send)
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
