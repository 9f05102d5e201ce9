"""ASGI middleware in front of every route: API keys, body-size limit, HTTP request metrics.

A request that passes the key check carries its tenant (server/cache_salt.py) in the ASGI scope's
state, where the routes read it to salt the prefix cache by key.

Written as plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses pass through
untouched and disconnects still reach the handlers. Not here: per-protocol error bodies
(server/errors.py), which this uses for its own 401 and 413 answers.
"""

from __future__ import annotations

import hmac

from deepserve.server.cache_salt import tenant_id
from deepserve.server.errors import error_response
from deepserve.server.metrics import ServerMetrics

OPEN_PATHS = ("/health", "/ready", "/metrics")
KNOWN_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ready",
    "/metrics",
)


class FrontMiddleware:
    def __init__(
        self, app, api_keys: tuple[str, ...], max_body_bytes: int, metrics: ServerMetrics
    ) -> None:
        self.app = app
        self.api_keys = [(key.encode(), tenant_id(key)) for key in api_keys]
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = {"code": 500}

        async def send_and_count(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            rejection = self._reject(scope)
            if rejection is not None:
                await rejection(scope, receive, send_and_count)
            else:
                await self.app(scope, receive, send_and_count)
        finally:
            endpoint = _endpoint(path)
            self.metrics.http_request(endpoint, status["code"])

    def _reject(self, scope):
        path = scope["path"]
        headers = dict(scope.get("headers") or [])
        if self.api_keys and not path.startswith(OPEN_PATHS):
            tenant = self._tenant(headers)
            if tenant is None:
                return error_response(path, 401, "missing or invalid API key")
            scope.setdefault("state", {})["tenant"] = tenant
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return error_response(
                path, 413, f"request body exceeds the limit of {self.max_body_bytes} bytes"
            )
        return None

    def _tenant(self, headers: dict[bytes, bytes]) -> str | None:
        """The tenant of the key the request carries; None when it carries no valid key."""
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        found = None
        for key, tenant in self.api_keys:  # every key compared, in constant time each
            if given and hmac.compare_digest(given, key):
                found = tenant
        return found


def _endpoint(path: str) -> str:
    """The metrics label of a request path: a known endpoint, one model's card, or "other"."""
    if path in KNOWN_ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
