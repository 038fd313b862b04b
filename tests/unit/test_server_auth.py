"""The servers' token check (rollout.server_auth.BearerTokenMiddleware) as the vLLM server runs it: an ASGI app; and
the request limits (rollout.server_limits) on a real uvicorn server with the same protocol and middleware stack.

The real server's routes, with and without the token, and its limits are in tests/e2e/test_vllm_server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

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
        "rpc, token, lower-case scheme": _http("/collective_rpc", authorization=f"bearer {TOKEN}"),
        "rpc, token, upper-case scheme, two spaces": _http("/collective_rpc", authorization=f"BEARER  {TOKEN}"),
        "rpc, token, another scheme": _http("/collective_rpc", authorization=f"Basic {TOKEN}"),
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
        # RFC 7235 section 2.1: the auth-scheme is case-insensitive
        "rpc, token, lower-case scheme": opened, "rpc, token, upper-case scheme, two spaces": opened,
        "rpc, token, another scheme": 401,
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


def send_head(port: int, header_bytes: int, *, end: bool = True, authorization: str = "") -> tuple[int, bytes]:
    """Send GET /v1/models with one header of `header_bytes` bytes to 127.0.0.1:port, a megabyte at a time; returns
    (the header bytes the server took before it closed the connection, its answer). end: finish the head."""
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        auth = f"Authorization: {authorization}\r\n".encode() if authorization else b""
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n" + auth + b"X-Padding: ")
        block = b"a" * (1 << 20)
        try:
            while sent < header_bytes:
                sent += sock.send(block[: header_bytes - sent])
            if end:
                sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while data := sock.recv(1 << 16):
                answer += data
        except ConnectionResetError:
            pass
    return sent, answer


def status_of(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


async def body_length(scope, receive, send):
    """The app behind the middleware: answers the length of the body it read."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    out = str(len(body)).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


@contextlib.contextmanager
def uvicorn_serving(app):
    """uvicorn on a free loopback port, in a thread, with the protocol megatron_rl.rollout.server_main gives vLLM's."""
    import uvicorn

    from megatron_rl.ports import free_port
    from megatron_rl.rollout.server_limits import head_limited_protocol

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=head_limited_protocol(),
                                           lifespan="off", log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def limited_server(monkeypatch):
    """The stack a server runs: the token check outside the body limit (1000 bytes here), on the head-limited
    protocol."""
    from megatron_rl.rollout.server_limits import BODY_LIMIT_ENV, BodyLimitMiddleware

    monkeypatch.setenv("MEGATRON_RL_SERVER_TOKEN", TOKEN)
    monkeypatch.setenv(BODY_LIMIT_ENV, "1000")
    with uvicorn_serving(BearerTokenMiddleware(BodyLimitMiddleware(body_length))) as port:
        yield port


def test_a_request_head_over_the_limit_is_refused_before_it_is_read_in_full(limited_server):
    from megatron_rl.rollout.server_limits import HEAD_LIMIT_BYTES

    sent, answer = send_head(limited_server, HEAD_LIMIT_BYTES + (16 << 10), end=False)  # the head never ends
    assert status_of(answer) == 431 and b"request head over 65536 bytes" in answer, answer
    # 64 MiB: the server stops reading at the limit and closes; what got through is what the kernel's socket
    # buffers held (a few MB on loopback), nowhere near the whole header
    sent, answer = send_head(limited_server, 64 << 20)
    assert sent < 32 << 20, sent
    # a head under the limit reaches the token check, and with the token (any case of the scheme) the app
    sent, answer = send_head(limited_server, 1000)
    assert status_of(answer) == 401, answer
    sent, answer = send_head(limited_server, HEAD_LIMIT_BYTES // 2, authorization=f"bearer {TOKEN}")
    assert status_of(answer) == 200 and answer.endswith(b"\r\n\r\n0"), answer
    # a small head followed at once by a large body (one write, as a weight push over HTTP sends it): the body is
    # not counted as head
    with socket.create_connection(("127.0.0.1", limited_server), timeout=30) as sock:
        body = b"z" * (4 << 20)
        sock.sendall(f"POST /collective_rpc HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        assert status_of(sock.recv(1 << 16)) == 401  # the token check's answer, not the head limit's


def test_a_body_over_the_limit_is_refused_with_413_before_the_app_reads_it(limited_server):
    import httpx

    url, auth = f"http://127.0.0.1:{limited_server}/v1/completions", {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(timeout=30) as client:
        assert client.post(url, content=b"x" * 1000, headers=auth).text == "1000"  # at the limit: read
        refused = client.post(url, content=b"x" * 1001, headers=auth)  # declared over it: nothing read
        assert refused.status_code == 413 and "rollout.server_max_body_mb" in refused.text

        def chunks():  # no Content-Length: refused when the body passes the limit
            for _ in range(8):
                yield b"y" * 400

        assert client.post(url, content=chunks(), headers=auth).status_code == 413
        # without the token the body is never looked at: 401 whatever its size
        assert client.post(url, content=b"x" * 5000).status_code == 401
    # a declared size far beyond anything sent is refused at once
    with socket.create_connection(("127.0.0.1", limited_server), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Length: 5000000000\r\n\r\n".encode())
        assert status_of(sock.recv(1 << 16)) == 413
