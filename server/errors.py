"""Error bodies for each protocol and the exceptions the frontend raises on purpose.

OpenAI's shape `{"error": {"message", "type", "param", "code"}}` for /v1/* and Anthropic's
`{"type": "error", "error": {"type", "message"}}` for /v1/messages. Not here: the FastAPI handlers
that pick between them (server/app.py).
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class HTTPError(Exception):
    """An error with a status and a message, rendered in the protocol of the endpoint."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def openai_error(status: int, message: str, param: str | None = None) -> dict:
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": kind}}


def anthropic_error(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    # A message may quote the request (a field name with a lone surrogate): keep it encodable.
    message = _encodable(message)
    param = None if param is None else _encodable(param)
    body = (
        anthropic_error(status, message)
        if is_anthropic_path(path)
        else openai_error(status, message, param)
    )
    # A body over the limit is left unread: closing the connection stops the client sending it.
    headers = {"Connection": "close"} if status == 413 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def message_of_conversion_error(body: str) -> str:
    """The message inside a recipe ConversionError body (already an OpenAI error object)."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body
