"""A circuit breaker for a remote store: after repeated failures, skip calls for a cool-down so a
dead store costs nothing per request; then let one probe through and close on its success.

Cool-downs grow exponentially up to a cap while the store stays down, so a long outage costs one
probe per `max_cooldown_s`. Thread-safe; the clock is injectable for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 2,
        cooldown_s: float = 0.5,
        max_cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = failure_threshold
        self._base = cooldown_s
        self._max = max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._cooldown = cooldown_s
        self._open_until = 0.0
        self._probing = False

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._failures >= self._threshold

    def allow(self) -> bool:
        """True when a call may go to the store now (closed, or the one probe after a cool-down)."""
        with self._lock:
            if self._failures < self._threshold:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._cooldown = self._base
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._failures < self._threshold:
                return
            if self._probing:  # the probe failed: wait longer before the next one
                self._cooldown = min(self._cooldown * 2, self._max)
            self._probing = False
            self._open_until = self._clock() + self._cooldown
