"""Typed errors the engine raises at its boundary. Each names the problem in its message.

`InvalidRequestError` is the caller's fault (a frontend maps it to 400); the others are
configuration problems found at start-up.
"""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses before queueing any work (prompt too long, bad params...)."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """An unknown built-in model name, or a path with no checkpoint in it."""


class UnsupportedModelError(EngineError):
    """A checkpoint whose architecture, quantization or dtype the engine cannot run."""
