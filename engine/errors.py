"""Typed errors the engine raises at its boundary. Each names the problem in its message.

`InvalidRequestError` is the caller's fault (a frontend maps it to 400), and so is
`RequestFailedError`, one request's failure inside a step; the others are configuration problems
found at start-up.
"""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses before queueing any work (prompt too long, bad params...)."""


class RequestFailedError(InvalidRequestError):
    """A request failed inside the engine (preparing or sampling its step) while the engine went on
    serving the others: as far as the engine can tell its own content is the cause, so it is the
    caller's fault (a 400) and no other worker should be tried with it."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """An unknown built-in model name, or a path with no checkpoint in it."""


class UnsupportedModelError(EngineError):
    """A checkpoint whose architecture, quantization or dtype the engine cannot run."""
