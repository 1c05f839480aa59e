"""server/guards.py as ASGI middleware, without a server: the API-key compare (which paths, which keys, the tenant id
it records) and the bounded, timed body read (what the app receives, and the status codes it answers instead)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.server.guards import TENANT_KEY, ApiKeyAuth, BodyLimit, key_id


class App:
    """The app behind the guard: records each call's scope and the body it read."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        self.calls.append(scope)
        message = await receive()
        self.bodies.append(message.get("body", b""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def run(guard, scope: dict, messages: list[dict], delay_s: float = 0.0) -> tuple[int, dict, dict | None]:
    """Call the guard with `messages` as the client's; the status, headers and JSON body it answered with."""
    sent: list[dict] = []
    queue = list(messages)

    async def receive() -> dict:
        if delay_s:
            await asyncio.sleep(delay_s)
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, (json.loads(body) if headers.get("content-type") == "application/json" else None)


def http(path: str = "/v1/completions", method: str = "POST", auth: str | None = None) -> dict:
    headers = [(b"authorization", auth.encode())] if auth is not None else []
    return {"type": "http", "method": method, "path": path, "headers": headers}


BODY = [{"type": "http.request", "body": b"{}", "more_body": False}]


def test_key_id_is_stable_and_not_the_key():
    assert key_id("sk-a") == key_id("sk-a") != key_id("sk-b")
    assert len(key_id("sk-a")) == 16 and "sk-a" not in key_id("sk-a")


def test_the_right_bearer_key_passes_and_names_its_tenant():
    app = App()
    guard = ApiKeyAuth(app, ("sk-a", "sk-b"))
    for auth, key in (("Bearer sk-b", "sk-b"), ("bearer sk-a", "sk-a"), ("Bearer  sk-a ", "sk-a")):
        status, _, _ = run(guard, http(auth=auth), BODY)
        assert status == 200
        assert app.calls[-1]["state"][TENANT_KEY] == key_id(key)
    assert len(app.calls) == 3


@pytest.mark.parametrize("auth, message", [
    (None, "You didn't provide an API key"),
    ("Bearer sk-c", "Incorrect API key provided."),
    ("Basic sk-a", "Incorrect API key provided."),  # the right key under another scheme
    ("sk-a", "Incorrect API key provided."),  # no scheme at all
    ("Bearer sk-", "Incorrect API key provided."),  # a prefix of a key
])
def test_a_missing_or_wrong_key_is_a_401_in_openais_shape(auth, message):
    app = App()
    status, headers, body = run(ApiKeyAuth(app, ("sk-a",)), http(auth=auth), BODY)
    assert status == 401 and app.calls == []
    assert headers["www-authenticate"] == 'Bearer realm="pagedserve"'
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(message)


@pytest.mark.parametrize("path, protected", [("/v1/models", True), ("/metrics", True), ("/docs", True),
                                             ("/openapi.json", True), ("/health", False), ("/ready", False),
                                             ("/", False), ("/app.js", False)])
def test_which_paths_need_a_key(path, protected):
    app = App()
    status, _, _ = run(ApiKeyAuth(app, ("sk-a",)), http(path, "GET"), BODY)
    assert (status == 401) == protected and len(app.calls) == (0 if protected else 1)


def test_without_keys_nothing_is_checked():
    app = App()
    status, _, _ = run(ApiKeyAuth(app, ()), http(), BODY)
    assert status == 200 and TENANT_KEY not in app.calls[0].get("state", {})


def chunks(*parts: bytes) -> list[dict]:
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


def test_the_app_gets_the_whole_body_in_one_message():
    app = App()
    status, _, _ = run(BodyLimit(app, max_bytes=10, timeout_s=5), http(), chunks(b"abc", b"", b"defg", b"hij"))
    assert status == 200 and app.bodies == [b"abcdefghij"]  # exactly the limit is allowed


def test_a_body_over_the_limit_is_a_413_and_never_reaches_the_app():
    app = App()
    status, headers, body = run(BodyLimit(app, max_bytes=10, timeout_s=5), http(), chunks(b"abcdef", b"ghijk"))
    assert status == 413 and app.calls == []
    assert headers["connection"] == "close" and body["error"]["code"] == "request_too_large"
    assert "10 bytes" in body["error"]["message"]


def test_a_slow_body_is_a_408():
    app = App()
    status, headers, body = run(BodyLimit(app, max_bytes=10, timeout_s=0.05), http(), chunks(b"a", b"b"),
                                delay_s=0.2)
    assert status == 408 and app.calls == []
    assert headers["connection"] == "close" and body["error"]["code"] == "request_timeout"


def test_a_disconnect_before_the_body_ends_is_passed_on():
    app = App()
    status, _, _ = run(BodyLimit(app, max_bytes=10, timeout_s=5), http(), [{"type": "http.disconnect"}])
    assert status == 200 and app.bodies == [b""]  # the app saw the disconnect message, not a body


def test_reads_without_a_body_pass_straight_through():
    app = App()
    for method in ("GET", "HEAD", "OPTIONS"):
        status, _, _ = run(BodyLimit(app, max_bytes=1, timeout_s=5), http(method=method), chunks(b"too long"))
        assert status == 200
    assert app.bodies == [b"too long"] * 3  # the guard did not read (or cap) them


def test_anthropics_x_api_key_passes_and_the_messages_routes_refuse_in_anthropics_shape():
    app = App()
    guard = ApiKeyAuth(app, ("sk-a", "sk-b"))
    scope = {**http("/v1/messages"), "headers": [(b"x-api-key", b"sk-b"), (b"anthropic-version", b"2023-06-01")]}
    status, _, _ = run(guard, scope, BODY)
    assert status == 200 and app.calls[-1]["state"][TENANT_KEY] == key_id("sk-b")
    for headers in ([(b"x-api-key", b"sk-c")], []):
        status, _, body = run(guard, {**http("/v1/messages"), "headers": headers}, BODY)
        assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    status, _, body = run(BodyLimit(app, max_bytes=1, timeout_s=5), http("/v1/messages/count_tokens"), BODY)
    assert status == 413 and body["error"]["type"] == "request_too_large"
