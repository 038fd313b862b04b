"""The servers' token check (rollout.server_auth.BearerTokenMiddleware) as the vLLM server runs it: an ASGI app.

The real server's routes, with and without the token, are in tests/e2e/test_vllm_server.py.
"""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.rollout.server_auth import BearerTokenMiddleware, is_loopback, token_of

TOKEN = "a-token-of-this-test-0123456789"


def _http(path: str, method: str = "POST", authorization: str | None = None, kind: str = "http") -> dict:
    headers = [(b"content-type", b"application/json")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    return {"type": kind, "path": path, "method": method, "headers": headers, "root_path": ""}


def _middleware(monkeypatch, token: str | None):
    if token is None:
        monkeypatch.delenv("MEGATRON_RL_SERVER_TOKEN", raising=False)
    else:
        monkeypatch.setenv("MEGATRON_RL_SERVER_TOKEN", token)

    async def app(scope, receive, send):
        app.ran.append(scope["path"])

    app.ran = []
    return BearerTokenMiddleware(app), app


@pytest.mark.parametrize("token", [TOKEN, None])
def test_only_the_token_opens_a_route_and_health_is_open_to_reads(monkeypatch, token):
    middleware, app = _middleware(monkeypatch, token)
    statuses = {}

    def status(scope):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        before = len(app.ran)
        asyncio.run(middleware(scope, receive, send))
        if len(app.ran) > before:
            return "passed"
        return sent[0].get("status", sent[0]["type"])

    for name, scope in {
        "health": _http("/health", "GET"),
        "health head": _http("/health", "HEAD"),
        "health post": _http("/health", "POST"),
        "rpc, no token": _http("/collective_rpc"),
        "rpc, wrong token": _http("/collective_rpc", authorization="Bearer not-the-token-0123456789"),
        "rpc, token without Bearer": _http("/collective_rpc", authorization=TOKEN),
        "rpc, token as a prefix": _http("/collective_rpc", authorization=f"Bearer {TOKEN}x"),
        "rpc, token": _http("/collective_rpc", authorization=f"Bearer {TOKEN}"),
        "sleep, token": _http("/sleep", authorization=f"Bearer {TOKEN}"),
        "completions, no token": _http("/v1/completions"),
        "websocket, no token": _http("/v1/realtime", "GET", kind="websocket"),
    }.items():
        statuses[name] = status(scope)
    opened = "passed" if token else 401
    assert statuses == {
        "health": "passed", "health head": "passed", "health post": 401,
        "rpc, no token": 401, "rpc, wrong token": 401, "rpc, token without Bearer": 401, "rpc, token as a prefix": 401,
        "rpc, token": opened, "sleep, token": opened,  # a server started without its token stays closed
        "completions, no token": 401, "websocket, no token": "websocket.close",
    }


def test_lifespan_events_pass_and_loopback_is_told_from_other_addresses(monkeypatch):
    middleware, app = _middleware(monkeypatch, TOKEN)

    async def receive():
        return {"type": "lifespan.startup"}

    async def send(message):
        raise AssertionError(message)

    asyncio.run(middleware({"type": "lifespan", "path": "lifespan"}, receive, send))
    assert app.ran == ["lifespan"]
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "localhost", "0.0.0.0", "::", "10.0.0.5", "node7")] == [
        True, True, True, True, False, False, False, False]


def test_servers_of_one_engine_share_one_token():
    class Server:
        def __init__(self, token):
            self.token = token

    assert token_of([Server(TOKEN), "http://elsewhere:8000", Server(TOKEN)]) == TOKEN
    with pytest.raises(ValueError, match="hold different tokens"):
        token_of([Server(TOKEN), Server(TOKEN + "b")])
