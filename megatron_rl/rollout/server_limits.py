"""The rollout servers' request limits: each refused before the request is read in full.

A vLLM server's HTTP parser reads a request's whole head (its request line and
headers) before any route or middleware sees the request, the token check
included, so without a limit any local user could make the API server hold a
header of any size (uvicorn's default parser, httptools, has none: 128 MiB
were read and held). Two limits, each answered and the connection closed:

1. a request head above HEAD_LIMIT_BYTES (64 KiB): 431, from
   `HeadLimitedH11Protocol`, the HTTP protocol the server runs
   (megatron_rl.rollout.server_main hands it to vLLM's uvicorn server); it holds
   at most the limit and one network read more of a head;
2. a body above rollout.server_max_body_mb: 413, from `BodyLimitMiddleware`,
   before the app reads the body (a declared Content-Length), or as soon as a
   chunked body passes the limit. A request without the token never has its
   body read (rollout.server_auth answers 401 first).
"""

from __future__ import annotations

import logging
import os
from typing import Any

HEAD_LIMIT_BYTES = 64 << 10
"""Largest request head (request line + headers) a server reads; a request carries a few hundred bytes."""
BODY_LIMIT_ENV = "MEGATRON_RL_SERVER_MAX_BODY_BYTES"
"""The body limit in bytes, in the server's environment (rollout.server_max_body_mb)."""
MIDDLEWARE = "megatron_rl.rollout.server_limits.BodyLimitMiddleware"
"""The import path vLLM's `--middleware` takes."""

logger = logging.getLogger(__name__)


def limits_env(max_body_mb: float) -> dict[str, str]:
    """The server process's share of the limits (rollout.server_max_body_mb, in MB of 10^6 bytes)."""
    return {BODY_LIMIT_ENV: str(int(max_body_mb * 1_000_000))}


def _refusal(status: int, reason: str, text: str) -> bytes:
    body = (text + "\n").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def head_limited_protocol(head_limit: int = HEAD_LIMIT_BYTES) -> type:
    """uvicorn's h11 protocol that answers 431 and closes the connection once the head of a request passes
    `head_limit` bytes (uvicorn's own answer to h11's buffer limit is a 400, and its httptools parser has no limit)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadLimitedH11Protocol(H11Protocol):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            # h11's own buffer limit (uvicorn answers it with a 400) above this one by more than one read (asyncio
            # and uvloop read at most 256 KiB at a time), so that a long head meets this limit first
            self.conn = h11.Connection(h11.SERVER, max(config.h11_max_incomplete_event_size or 0, head_limit + (1 << 20)))

        def data_received(self, data: bytes) -> None:
            if self.transport is None or self.transport.is_closing():
                return
            super().data_received(data)
            # still IDLE after h11 parsed what came: no request head is complete yet, and what h11 holds unparsed is
            # that head (a complete one moves it on to the body, which is not counted here). uvicorn pauses reading
            # while a request is DONE, so a pipelined head waits at most one read in h11's buffer.
            if self.conn.their_state is h11.IDLE and len(self.conn.trailing_data[0]) > head_limit:
                logger.warning("refused a request head over %d bytes from %s (431)", head_limit, self.client)
                self.transport.write(_refusal(431, "Request Header Fields Too Large",
                                              f"request head over {head_limit} bytes: refused"))
                self.transport.close()

    return HeadLimitedH11Protocol


class BodyLimitMiddleware:
    """ASGI middleware of the vLLM server: 413 for a request body above the limit in MEGATRON_RL_SERVER_MAX_BODY_BYTES
    (no limit without the variable), before the app has read it."""

    def __init__(self, app: Any):
        self.app = app
        self.limit = int(os.environ.get(BODY_LIMIT_ENV, "0") or 0)

    async def _refuse(self, send: Any) -> None:
        body = f'{{"error": "request body over {self.limit} bytes (rollout.server_max_body_mb): refused"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.limit:
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope.get("headers", ()) if name.lower() == b"content-length"), None)
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            await self._refuse(send)  # nothing of the body read
            return
        state = {"read": 0, "refused": False, "started": False}

        async def limited_receive() -> dict:
            if state["refused"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > self.limit:  # a chunked body (no Content-Length) past the limit
                    state["refused"] = True
                    if not state["started"]:
                        await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if state["refused"]:
                return  # the 413 went out instead
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)
