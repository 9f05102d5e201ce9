"""The per-sequence draft throttle (engine/spec_decode/throttle.py): drafting backs off on
rejected drafts, pauses after repeated misses with a doubling pause, probes with one draft, and
recovers on acceptance, from the sequence's own rounds; and the MTP prior shared by the engine's
sequences (a cold window starts new sequences in the longest pause)."""

from __future__ import annotations

from deepserve.engine.spec_decode.throttle import (
    COLD_PROBE_STEPS,
    COLD_ROUNDS,
    MAX_PAUSE,
    MIN_PAUSE,
    MISSES_TO_PAUSE,
    DraftThrottle,
    RecentRounds,
)


def opportunities(t: DraftThrottle, n: int) -> list[int]:
    return [t.take_opportunity() for _ in range(n)]


def test_starts_at_k_and_stays_there_while_everything_is_accepted():
    t = DraftThrottle(4)
    for _ in range(10):
        assert t.take_opportunity() == 4
        t.observe(4, 4)


def test_partial_acceptance_drafts_one_more_than_was_accepted():
    t = DraftThrottle(5)
    t.observe(5, 2)
    assert t.take_opportunity() == 3
    t.observe(3, 3)  # all accepted: grows again, one at a time
    assert t.take_opportunity() == 4


def test_a_miss_drops_to_one_draft_and_repeated_misses_pause_drafting():
    t = DraftThrottle(3)
    for _ in range(MISSES_TO_PAUSE - 1):
        t.observe(t.take_opportunity(), 0)
    assert t.take_opportunity() == 1
    t.observe(1, 0)
    assert opportunities(t, MIN_PAUSE) == [0] * MIN_PAUSE
    assert t.take_opportunity() == 1  # the probe


def test_pause_doubles_with_each_further_miss_up_to_the_cap():
    t = DraftThrottle(3)
    pauses = []
    for _ in range(12):
        drafted = t.take_opportunity()
        skipped = 0
        while drafted == 0:
            skipped += 1
            drafted = t.take_opportunity()
        pauses.append(skipped)
        t.observe(drafted, 0)
    expected = [0] * MISSES_TO_PAUSE
    pause = MIN_PAUSE
    while len(expected) < len(pauses):
        expected.append(pause)
        pause = min(2 * pause, MAX_PAUSE)
    assert pauses == expected
    assert pauses[-1] == MAX_PAUSE


def test_never_accepting_costs_about_one_draft_per_max_pause_steps():
    t = DraftThrottle(3)
    steps = 20 * MAX_PAUSE
    drafted = 0
    for _ in range(steps):
        n = t.take_opportunity()
        drafted += n
        t.observe(n, 0)
    assert drafted < steps / MAX_PAUSE + 3 * 8  # the ramp to the cap, then one probe per pause


def test_an_accepted_probe_ends_the_pausing():
    t = DraftThrottle(3)
    for _ in range(6):
        n = t.take_opportunity()
        while n == 0:
            n = t.take_opportunity()
        t.observe(n, 0)
    n = t.take_opportunity()
    while n == 0:
        n = t.take_opportunity()
    t.observe(n, 1)
    assert t.take_opportunity() == 2
    t.observe(2, 0)  # one miss again: no pause yet, and the next pause is the shortest
    assert t.take_opportunity() == 1
    t.observe(1, 0)
    assert opportunities(t, MIN_PAUSE + 1) == [0] * MIN_PAUSE + [1]


def test_a_proposal_of_nothing_changes_nothing():
    t = DraftThrottle(3)
    t.observe(0, 0)
    assert t == DraftThrottle(3)


def test_finding_nothing_to_propose_pauses_like_a_miss_but_keeps_the_length():
    t = DraftThrottle(3)
    for _ in range(MISSES_TO_PAUSE):
        assert t.take_opportunity() == 3
        t.nothing_proposed()
    assert t.paused
    for _ in range(5):  # the pause does not grow
        assert opportunities(t, MIN_PAUSE + 1) == [0] * MIN_PAUSE + [3]
        t.nothing_proposed()


def test_a_throttle_started_at_one_draft_grows_to_k_while_everything_is_accepted():
    t = DraftThrottle(3, allowed=1)
    lengths = []
    for _ in range(4):
        n = t.take_opportunity()
        lengths.append(n)
        t.observe(n, n)
    assert lengths == [1, 2, 3, 3]


def test_recent_rounds_turn_cold_after_a_full_window_with_nothing_accepted():
    recent = RecentRounds()
    for _ in range(COLD_ROUNDS - 1):
        recent.observe(1, 0)
    assert not recent.cold
    recent.observe(0, 0)  # no draft: not a round
    assert not recent.cold
    recent.observe(1, 0)
    assert recent.cold


def test_one_accepted_draft_in_the_window_keeps_the_rounds_warm():
    recent = RecentRounds()
    recent.observe(2, 1)
    for _ in range(COLD_ROUNDS - 1):
        recent.observe(1, 0)
    assert not recent.cold
    recent.observe(1, 0)  # the accepted round leaves the window
    assert recent.cold


def test_a_cold_throttle_probes_with_one_draft_after_the_longest_pause():
    t = DraftThrottle.cold(3)
    assert t.paused
    assert opportunities(t, MAX_PAUSE + 1) == [0] * MAX_PAUSE + [1]
    t.observe(1, 0)
    assert opportunities(t, MAX_PAUSE + 1) == [0] * MAX_PAUSE + [1]


def test_an_accepted_probe_warms_a_cold_throttle():
    t = DraftThrottle.cold(3)
    opportunities(t, MAX_PAUSE)
    assert t.take_opportunity() == 1
    t.observe(1, 1)
    assert opportunities(t, 2) == [2, 2]


def cold_rounds() -> RecentRounds:
    recent = RecentRounds()
    for _ in range(COLD_ROUNDS):
        recent.observe(1, 0)
    return recent


def test_a_warm_window_grants_every_probe():
    recent = RecentRounds()
    assert all(recent.grant_probe() for _ in range(3))


def test_a_cold_window_grants_one_probe_per_cold_probe_steps_of_the_engine():
    recent = cold_rounds()
    assert recent.grant_probe()
    granted = []
    for _ in range(COLD_PROBE_STEPS):
        recent.tick()
        granted.append(recent.grant_probe())
    assert granted == [False] * (COLD_PROBE_STEPS - 1) + [True]


def test_probe_due_only_looks():
    recent = cold_rounds()
    assert recent.probe_due() and recent.probe_due()
    assert recent.grant_probe()
    assert not recent.probe_due()


def test_a_deferred_draft_pauses_again_as_long_as_the_last_pause():
    t = DraftThrottle.cold(3)
    opportunities(t, MAX_PAUSE)
    assert t.take_opportunity() == 1
    t.defer()
    assert opportunities(t, MAX_PAUSE + 1) == [0] * MAX_PAUSE + [1]
