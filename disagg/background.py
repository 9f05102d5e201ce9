"""`BackgroundTask`: one long-running coroutine a component starts once and stops on close.

The router's health prober, DNS discovery and KV-event subscriber, and the worker's event
publisher all need the same three lines: start if not running, cancel, await the cancellation.
It lives here, at the worker API's level, so both ends (router/ and server/worker.py) import it
downwards. Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundTask:
    def __init__(self, run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._run = run
        self._name = name
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start on the running loop; a second call while it runs does nothing."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        """Cancel it and wait until it has ended; safe when it never started."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
