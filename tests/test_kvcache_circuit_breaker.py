"""The store circuit breaker opens after repeated failures, probes once per cool-down, closes on
success."""

from deepserve.kvcache.circuit_breaker import CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_failures_and_skips_calls():
    clock = FakeClock()
    cb = CircuitBreaker(failure_threshold=2, cooldown_s=1.0, clock=clock)
    cb.record_failure()
    assert cb.allow()
    cb.record_failure()
    assert not cb.allow()


def test_lets_one_probe_through_after_the_cooldown_and_closes_on_success():
    clock = FakeClock()
    cb = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=clock)
    cb.record_failure()
    clock.now = 1.01
    assert cb.allow()
    assert not cb.allow()  # only one probe at a time
    cb.record_success()
    assert cb.allow() and not cb.is_open


def test_failed_probes_back_off_exponentially_up_to_the_cap():
    clock = FakeClock()
    cb = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, max_cooldown_s=3.0, clock=clock)
    cb.record_failure()
    waits = []
    for _ in range(4):
        start = clock.now
        while not cb.allow():
            clock.now += 0.25
        waits.append(clock.now - start)
        cb.record_failure()
    assert waits == [1.0, 2.0, 3.0, 3.0]
