"""ASGI guards in front of the routes: API-key auth, and a bounded, timed read of the request body.

Both answer themselves, before FastAPI parses anything, in the error shape of the route's dialect (server/errors.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_answer

TENANT_KEY = "pagedserve.tenant"  # scope["state"][TENANT_KEY]: an id of the API key that authenticated
PROTECTED = ("/v1/", "/metrics", "/docs", "/openapi.json")  # /health, /ready and the page stay open


async def send_error(scope: Scope, send: Send, status: int, message: str, code: str,
                     headers: list[tuple[bytes, bytes]]) -> None:
    """An `invalid_request_error` (in OpenAI's terms), the type of every refusal here."""
    status, error, _ = error_answer(scope.get("path", ""), status, message, code=code)
    body = json.dumps(error).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def key_id(key: str) -> str:
    """A stable, non-secret name for a key (prefix-cache namespace, logs): never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ApiKeyAuth:
    """OpenAI bearer auth for the API, /metrics and the API's documents (/health stays open for load balancers);
    Anthropic's `x-api-key` header is taken too, as its clients send the key there.

    Every configured key is compared in constant time, so the time to refuse says nothing about a key.
    """

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [(k.encode(), key_id(k)) for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.keys or not path.startswith(PROTECTED):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth, x_api_key = headers.get(b"authorization", b""), headers.get(b"x-api-key")
        scheme, _, token = auth.partition(b" ")
        given = [token.strip()] if scheme.lower() == b"bearer" else []
        given += [x_api_key.strip()] if x_api_key is not None else []
        # every key is compared with every key given, whatever matches: constant time
        matches = [kid for t in given for key, kid in self.keys if hmac.compare_digest(t, key)]
        if not matches:
            message = ("Incorrect API key provided." if auth or x_api_key is not None else
                       "You didn't provide an API key. You need to provide your API key in an Authorization "
                       "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
            return await send_error(scope, send, 401, message, "invalid_api_key",
                                    [(b"www-authenticate", b'Bearer realm="pagedserve"')])
        scope.setdefault("state", {})[TENANT_KEY] = matches[0]
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads a request's whole body before the app sees it: at most `max_bytes` (else 413), within
    `timeout_s` (else 408, so a client trickling its body cannot hold a slot for ever).

    The app then gets the body in one message; later `receive` calls go to the client again, so
    disconnects are still seen while the response streams.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0

        async def read_all() -> Message | None:
            """The whole body as one message; None if too large (read to its end and dropped, so the client
            gets the 413 instead of a reset connection); a disconnect message if the client left."""
            nonlocal size
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return message
                size += len(message.get("body", b""))
                if size <= self.max_bytes:
                    chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    if size > self.max_bytes:
                        return None
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        try:
            first = await asyncio.wait_for(read_all(), self.timeout_s)
        except asyncio.TimeoutError:
            if size <= self.max_bytes:
                return await send_error(scope, send, 408, f"the request body was not received within "
                                        f"{self.timeout_s:g} s", "request_timeout", [(b"connection", b"close")])
            first = None
        if first is None:
            return await send_error(scope, send, 413, f"the request body is larger than {self.max_bytes} bytes",
                                    "request_too_large", [(b"connection", b"close")])
        unread = [first]

        async def replay() -> Message:
            return unread.pop() if unread else await receive()

        await self.app(scope, replay, send)
