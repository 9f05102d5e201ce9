"""Typed errors of the worker's internal API, as the router and the frontend see them.

`WorkerRejectedError` is the request's fault (the worker answered 4xx): never retried, never held
against the worker. `WorkerUnavailableError` is the worker's fault (refused connection, timeout,
5xx, a stream cut short): the router may retry elsewhere and counts it towards ejection.
"""

from __future__ import annotations

from deepserve.engine.errors import EngineError, InvalidRequestError


class WorkerRejectedError(InvalidRequestError):
    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


class WorkerUnavailableError(EngineError):
    """A worker failed; `started` tells whether it had already streamed tokens for the request,
    `worker` which worker it was (its URL, set by the router), so a resume can avoid it."""

    status_code = 503

    def __init__(self, message: str, started: bool = False, worker: str | None = None) -> None:
        super().__init__(message)
        self.started = started
        self.worker = worker


class NoWorkerError(WorkerUnavailableError):
    """No healthy worker of the needed role is left to try."""
