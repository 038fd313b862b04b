"""The rollout servers' control plane, authenticated by one shared token per run.

Who can reach what: a vLLM server the trainer uses listens on a TCP port that
every host of the cluster network (and every user of its own host) can reach.
Its routes generate (/v1), replace or read the policy's weights
(/collective_rpc, /update_weights, ...), pause it (/sleep, /pause) or reset
it; so every route answers only a request that carries the run's token as
`Authorization: Bearer <token>`. The one open route is GET /health: vLLM's
load balancers probe it, and it only reads the engine's error flag. Anyone
who can read the token file (its owner: mode 600) or the processes'
environment (their user) can drive the servers; nobody else can.

Where the token comes from (`run_token`): `rollout.server_token_file` (a file
of mode 600 holding it), else the file MEGATRON_RL_SERVER_TOKEN_FILE names
(what launch/slurm.sbatch sets), else the MEGATRON_RL_SERVER_TOKEN variable;
servers the trainer starts itself get a fresh random one when none is set.
Rotating it: write a new file and restart the servers and the trainer.

How the server checks it: `BearerTokenMiddleware`, loaded by the server
process (`--middleware`), refuses every route but /health without the token
(the scheme `Bearer` in any case, as RFC 7235 reads it);
vLLM's own API-key check (given as VLLM_API_KEY) covers /v1, /v2, /inference
and /cohere only, not the dev routes VLLM_SERVER_DEV_MODE opens nor /pause,
/update_weights, /tokenize, /invocations and the others. The token reaches the
server in its environment (which only its user can read), never on its command
line (which `ps` shows every user), and is never logged. The sizes of what a
server reads of a request, before and after the token check, are
rollout.server_limits'.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from megatron_rl.config.core import ConfigError

TOKEN_ENV = "MEGATRON_RL_SERVER_TOKEN"
"""The token itself, in the environment."""
TOKEN_FILE_ENV = "MEGATRON_RL_SERVER_TOKEN_FILE"
"""A file holding the token (what the launch scripts set for the trainer and the servers)."""
MIDDLEWARE = "megatron_rl.rollout.server_auth.BearerTokenMiddleware"
"""The import path vLLM's `--middleware` takes."""
OPEN_ROUTES = frozenset({"/health"})
"""Paths answered without the token (GET and HEAD only): they change nothing."""
MIN_TOKEN_CHARS = 16
"""A shorter token could be guessed."""


class ServerTokenError(ConfigError):
    """The servers' token is missing, unreadable, too weak, or not the one a server holds."""


def read_token_file(path: str | os.PathLike, what: str = "rollout.server_token_file") -> str:
    """The token in `path`: the file must exist, be readable by its owner only, and hold one token."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as error:
        raise ServerTokenError(
            f"{what}={str(path)!r}: cannot read it ({error.strerror}): write the token there "
            f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}; chmod 600 {path})"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ServerTokenError(
            f"{what}={str(path)!r} has mode {stat.S_IMODE(mode):03o}: other users could read or change the token; "
            f"run chmod 600 {path}"
        )
    return _checked(text.strip(), f"{what}={str(path)!r}")


def _checked(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ServerTokenError(
            f"{where}: the token must be one word of at least {MIN_TOKEN_CHARS} characters "
            "(python -c 'import secrets; print(secrets.token_urlsafe(32))' makes one)"
        )
    return token


def token_origin(token_file: str = "") -> tuple[str, str] | None:
    """Where the run's token is given, in lookup order: ("rollout.server_token_file", path), (TOKEN_FILE_ENV, path),
    (TOKEN_ENV, "") for the token itself in the environment; None when none is set."""
    if token_file:
        return "rollout.server_token_file", token_file
    if os.environ.get(TOKEN_FILE_ENV):
        return TOKEN_FILE_ENV, os.environ[TOKEN_FILE_ENV]
    if os.environ.get(TOKEN_ENV):
        return TOKEN_ENV, ""
    return None


def configured_token(token_file: str = "") -> str | None:
    """The token the run was given (token_origin's order); None when none is set."""
    origin = token_origin(token_file)
    if origin is None:
        return None
    named_by, path = origin
    return read_token_file(path, named_by) if path else _checked(os.environ[TOKEN_ENV].strip(), TOKEN_ENV)


def run_token(token_file: str = "") -> str:
    """The run's token: the configured one, else a fresh random one (servers this process starts)."""
    return configured_token(token_file) or secrets.token_urlsafe(32)


def token_of(servers: list, token_file: str = "") -> str | None:
    """The token of the servers this process started (VLLMServer objects among `servers`: one for all), else the
    configured one (URLs of servers started elsewhere)."""
    tokens = {s.token for s in servers if not isinstance(s, str)}
    if len(tokens) > 1:
        raise ServerTokenError("the VLLMServers given to one VLLMServerEngine hold different tokens: give them one")
    return tokens.pop() if tokens else configured_token(token_file)


def auth_headers(token: str | None) -> dict[str, str]:
    """What every request to the servers carries (nothing for servers without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def server_env(token: str) -> dict[str, str]:
    """The server process's share of the token: the middleware's and vLLM's own /v1 check's."""
    return {TOKEN_ENV: token, "VLLM_API_KEY": token}


def is_loopback(host: str) -> bool:
    """Whether an address to listen on is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def refused(status: int | None) -> bool:
    """Whether an HTTP status says the server refused the caller's token."""
    return status in (401, 403)


def check_refused(status: int | None, url: str, token: str | None) -> None:
    """ServerTokenError in one line when the server at `url` refused the token (see refused_message)."""
    if refused(status):
        raise ServerTokenError(refused_message(url, token, status))


def refused_message(url: str, token: str | None, status: int | None = 401) -> str:
    """One line for a server that answered 401 / 403: which token to give the trainer."""
    sent = "refused this process's token" if token else "needs a token and this process has none"
    return (
        f"{url}: the vLLM server {sent} (HTTP {status}): give this process the servers' token with "
        f"rollout.server_token_file=FILE (mode 600), {TOKEN_FILE_ENV}=FILE or {TOKEN_ENV}"
    )


def weight_sync_client(url: str, timeout_s: float, token: str | None) -> Any:
    """vLLM's HTTPVLLMWeightSyncClient (the /init_weight_transfer_engine, /update_weights, ... routes), its requests
    carrying the token (it sends no headers of its own)."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    headers = auth_headers(token)

    class TokenWeightSyncClient(HTTPVLLMWeightSyncClient):
        def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
            response = requests.post(f"{self.base_url}/{path}", json=json, timeout=self.timeout, headers=headers)
            check_refused(response.status_code, self.base_url, token)
            response.raise_for_status()

    return TokenWeightSyncClient(url, timeout=timeout_s)


def bearer_credentials(authorization: bytes) -> bytes | None:
    """The credentials of an `Authorization: Bearer <token>` value; the scheme in any case (RFC 7235 section 2.1:
    auth-scheme is case-insensitive), one or more spaces after it. None for another scheme."""
    scheme, _, credentials = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credentials.lstrip(b" ")


class BearerTokenMiddleware:
    """ASGI middleware of the vLLM server: 401 for every request without `Authorization: Bearer <token>`
    (the token from MEGATRON_RL_SERVER_TOKEN; the scheme in any case), except GET/HEAD of OPEN_ROUTES. Without
    the variable it refuses them all (a server started without its token stays closed)."""

    def __init__(self, app: Any):
        self.app = app
        token = os.environ.get(TOKEN_ENV, "").strip()
        self._expected = token.encode() if token else None

    def _allowed(self, scope: dict) -> bool:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_ROUTES and scope.get("method") in ("GET", "HEAD"):
            return True
        if self._expected is None:
            return False
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = value
                break
        credentials = bearer_credentials(given)
        return credentials is not None and hmac.compare_digest(credentials, self._expected)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "Unauthorized: this server needs the run\'s token as Authorization: Bearer <token>"}'
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer")],
        })
        await send({"type": "http.response.body", "body": body})
