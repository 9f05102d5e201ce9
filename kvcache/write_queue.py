"""A bounded background writer: callers hand it (key, payload) items and return at once; one
daemon thread encodes and writes them in batches through a sink function.

Bounded by bytes, not items: when the pending bytes would exceed the limit the new items are
dropped (and counted) instead of blocking the caller, because a slow tier must never slow the
engine. `drain()` waits until everything queued so far has been handled (tests, shutdown).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

Item = tuple[str, object]  # (key, payload as any buffer: bytes, memoryview, numpy array)


class WriteQueue:
    def __init__(
        self,
        name: str,
        sink: Callable[[list[Item]], None],
        max_pending_bytes: int,
        batch_items: int = 32,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self._sink = sink
        self._max_bytes = max_pending_bytes
        self._batch = batch_items
        self._on_drop = on_drop
        self._cond = threading.Condition()
        self._items: deque[tuple[Item, int]] = deque()
        self._pending_bytes = 0
        self._in_flight = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[Item]) -> int:
        """Queue items; return how many were accepted (the rest were dropped)."""
        accepted = 0
        with self._cond:
            for key, payload in items:
                size = memoryview(payload).nbytes
                if self._closed or self._pending_bytes + size > self._max_bytes:
                    continue
                self._items.append(((key, payload), size))
                self._pending_bytes += size
                accepted += 1
            self._cond.notify_all()
        if accepted < len(items) and self._on_drop is not None:
            self._on_drop(len(items) - accepted)
        return accepted

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty and no batch is being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._in_flight, timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._closed)
                if not self._items:
                    return
                batch = [self._items.popleft() for _ in range(min(self._batch, len(self._items)))]
                self._in_flight = len(batch)
            try:
                self._sink([item for item, _ in batch])
            except Exception:  # a tier bug must not kill the writer thread: log, move on
                log.exception("KV write queue %s: sink failed", self._thread.name)
            finally:
                with self._cond:
                    self._pending_bytes -= sum(size for _, size in batch)
                    self._in_flight = 0
                    self._cond.notify_all()
