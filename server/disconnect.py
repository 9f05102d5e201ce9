"""Running work that ends early when the HTTP client disconnects: the one disconnect watcher of
every ASGI route (the OpenAI routes in server/, the worker's generate stream in server/worker.py).

Not here: what a route does once its client is gone (it aborts the engine request by closing the
engine's generator, which cancelling the work does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


# A disconnect is looked for only once a request has run this long: most short requests end
# first and never start the watcher's task (two task steps a request). A client that leaves
# sooner is noticed at this point, so the engine stops at most this much later.
DISCONNECT_WATCH_AFTER_S = 0.05


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; cancel it and raise ClientDisconnected if the client leaves first.

    `receive` is the request's ASGI receive channel, its body already read, so the next message
    it gives can only be the disconnect. `work` runs in this task and a watcher's done-callback
    cancels it: a second task for the work and the wake-up through `asyncio.wait` when it ends
    cost ~0.1 ms a request."""
    task = asyncio.current_task()
    ended = gone = False
    watcher: asyncio.Future | None = None

    def on_disconnect(watched: asyncio.Future) -> None:
        nonlocal gone
        # `ended`: the work may finish in the same loop turn; never cancel what follows it.
        if ended or watched.cancelled() or watched.exception() is not None:
            return
        gone = True
        task.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(on_disconnect)

    timer = asyncio.get_running_loop().call_later(DISCONNECT_WATCH_AFTER_S, watch)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientDisconnected() from None
    finally:
        ended = True
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
