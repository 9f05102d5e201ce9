"""The engine's CPU thread count (engine/threads.py): fixed when asked, else the cores the host's
other work leaves idle, re-checked as that work changes; under `--batch-invariant` kept as chosen
from the first op that ran on torch (or from start, where the kernel set does not say)."""

from __future__ import annotations

import pytest
import torch

from deepserve.engine.threads import (
    CHECK_EVERY_S,
    ThreadPolicy,
    compute_threads,
    own_running_threads,
    runnable_tasks,
)
from deepserve.kernels.kernel_set import TorchCalls


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Host:
    """A fake host: a settable runnable-task count and a clock the test moves."""

    def __init__(self, running: int) -> None:
        self.running, self.now = running, 0.0
        self.own = 1  # the process's own running threads: the engine's, reading
        self.script: list[int] = []  # readings to give first, in order

    def policy(self, cores: int, **kw) -> ThreadPolicy:
        return ThreadPolicy(
            cores=cores, read_runnable=self.read, read_own=lambda: self.own,
            clock=lambda: self.now, sleep=self.wait, **kw,
        )  # fmt: skip

    def read(self) -> int:
        return self.script.pop(0) if self.script else self.running

    def wait(self, seconds: float) -> None:
        self.now += seconds

    def later(self, running: int, steps: int = 20) -> None:
        self.running = running
        self.now += steps * CHECK_EVERY_S


@pytest.mark.parametrize(
    "cores,others,threads", [(2, 0, 2), (2, 1, 1), (2, 11, 1), (8, 0, 7), (8, 3, 5), (1, 0, 1)]
)
def test_compute_threads_take_the_idle_cores_and_leave_one_on_bigger_hosts(cores, others, threads):
    assert compute_threads(cores, others) == threads


def test_a_quiet_host_gets_every_core_and_a_busy_one_a_single_thread():
    host = Host(running=1)  # the engine's own thread only
    policy = host.policy(cores=2)
    assert policy.start() == 2 and torch.get_num_threads() == 2
    host.later(running=13)
    assert policy.before_step() == 1 and torch.get_num_threads() == 1
    host.later(running=1)
    assert policy.before_step() == 2


def test_the_load_is_not_read_again_before_it_is_due():
    host = Host(running=1)
    policy = host.policy(cores=2)
    policy.start()
    host.running = 13  # no time has passed
    assert policy.before_step() == 2


def test_one_busy_reading_does_not_flip_the_count():
    host = Host(running=1)
    policy = host.policy(cores=4)
    policy.start()
    host.later(running=4, steps=1)
    assert policy.before_step() == 3  # averaged over time: a quarter second of 3 others is ~1


def test_num_threads_fixes_the_count_whatever_the_load():
    host = Host(running=13)
    policy = host.policy(cores=2, fixed=2)
    assert policy.start() == 2
    host.later(running=13)
    assert policy.before_step() == 2


def test_batch_invariant_mode_keeps_the_count_chosen_at_start():
    host = Host(running=13)
    policy = host.policy(cores=2, adapt=False)
    assert policy.start() == 1
    host.later(running=1)
    assert policy.before_step() == 1


def test_runnable_tasks_reads_procs_running_and_tolerates_other_formats(tmp_path):
    good, bad = tmp_path / "loadavg", tmp_path / "bad"
    good.write_text("13.62 14.97 12.29 12/267 5371\n")
    bad.write_text("nothing here\n")
    assert runnable_tasks(str(good)) == 12
    assert runnable_tasks(str(bad)) is None
    assert runnable_tasks(str(tmp_path / "missing")) is None


def test_one_quiet_instant_at_start_does_not_choose_every_core_on_a_busy_host():
    host = Host(running=13)
    host.script = [1]  # the first reading caught a moment with only the engine running
    assert host.policy(cores=2, adapt=False).start() == 1


def test_the_engines_own_spinning_threads_are_not_counted_as_the_hosts_other_work():
    host = Host(running=1)
    policy = host.policy(cores=2)
    assert policy.start() == 2
    # after a two-thread step: the reader and the kernel's worker, still spinning, both running
    host.running, host.own = 2, 2
    for _ in range(5):
        host.later(running=2)
        assert policy.before_step() == 2


def test_own_running_threads_counts_this_process_threads_in_the_running_state(tmp_path):
    states = {"10": "R", "11": "R", "12": "S", "13": "R", "14": "D"}
    for tid, state in states.items():
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "stat").write_text(f"{tid} (python3 (x) y) {state} 1 2 3\n")
    # 10 is the main thread (a server's event loop), not the caller: a neighbour, not counted
    assert own_running_threads(str(tmp_path), main=10) == 2
    assert own_running_threads(str(tmp_path), main=99) == 3
    assert own_running_threads(str(tmp_path / "missing")) == 1
    assert own_running_threads() >= 1  # this very thread, on a real /proc


def test_one_stray_reading_after_a_long_step_keeps_both_cores_and_a_neighbour_that_stays_gets_one():
    host = Host(running=1)
    policy = host.policy(cores=2)
    assert policy.start() == 2
    host.later(running=2, steps=3)  # a 0.75 s step, then a task woken at the reading instant
    assert policy.before_step() == 2
    host.later(running=1, steps=3)
    assert policy.before_step() == 2
    for _ in range(2):  # a neighbour that keeps a core busy
        host.later(running=2, steps=3)
        threads = policy.before_step()
    assert threads == 1


def test_batch_invariant_mode_follows_the_load_while_no_call_went_to_torch():
    host = Host(running=1)
    policy = host.policy(cores=2, adapt=False)
    policy.adapt_until_torch(TorchCalls())
    assert policy.start() == 2
    host.later(running=13)
    assert policy.before_step() == 1


def test_batch_invariant_mode_keeps_the_count_from_the_first_call_that_went_to_torch():
    host = Host(running=1)
    calls = TorchCalls()
    policy = host.policy(cores=2, adapt=False)
    policy.adapt_until_torch(calls)
    assert policy.start() == 2
    calls.record("bmm")
    host.later(running=13)
    assert policy.before_step() == 2
