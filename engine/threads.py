"""How many CPU threads a step's kernels run on: fixed (`--num-threads`), or chosen by the load
of the host.

A parallel kernel ends when its slowest thread does. On a host whose cores are busy with other
work, one of the engine's threads is often descheduled for a whole time slice while the others
wait at the kernel's end, hundreds of times a step: two threads on two shared cores ran several
times slower than one (benchmarks/RESULTS.md). So by default the engine counts the other runnable
tasks of the host between steps (the kernel's `procs_running`, less this process's own running
threads: the reader, and kernel threads still spinning at a parallel region's end) and
gives its kernels only the cores they leave idle, at least one; on a host of more than two cores
it also leaves one core to the HTTP server and the scheduler. OpenMP's spinning waits between
kernels then only happen on cores nobody else asked for.

With `--batch-invariant` the native kernels give the same bits on any thread count, but the torch
ops that fill in for them (kernels/reference/invariant.py) are only checked at the count they were
probed with. So the count follows the load only while the flag's set has handed no call to torch
(its `TorchCalls`, which the engine passes in at build), and is kept from the first such call on:
SmolLM2 in float32 or bfloat16 runs all native and adapts; the DeepSeek models' MLA, MoE routing
and sparse attention run torch ops from the first step. Where the set does not record its torch
calls the count chosen at start is kept. What does not live here: the kernels' own split of work
over the threads (kernels/cpu/csrc/, torch).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepserve.kernels.kernel_set import TorchCalls

LOADAVG = "/proc/loadavg"
# Reading the host's load every step would cost more than it tells: a step is milliseconds and a
# neighbour's load changes over seconds. Runnable-task counts are instantaneous, so they are
# averaged with a decay of SMOOTHING_S seconds.
CHECK_EVERY_S = 0.25
SMOOTHING_S = 1.0
# At start the count is chosen from the mean of several readings: one instant of a busy host can
# show a single runnable task, and under --batch-invariant the count is kept for good.
START_READINGS = 20
START_SPACING_S = 0.025
BUSY_AT = 0.75  # a smoothed count of other tasks from which a core is theirs (compute_threads)


def cores_owned() -> int:
    return len(os.sched_getaffinity(0))


def own_running_threads(task_dir: str = "/proc/self/task", main: int | None = None) -> int:
    """This process's threads running or ready to run now, the caller's included, but not the
    main thread unless it is the caller: a server's event loop runs there, and its work competes
    with the kernels like a neighbour's. What is left is the caller and the kernels' workers:
    OpenMP's spin for a while after a parallel region, and counted as the host's other work they
    made every second step of a long prefill run on one thread (a 1,024-token prompt: 0.74 s,
    then 1.45 s, then 0.74 s ...)."""
    main = os.getpid() if main is None else main
    caller = threading.get_native_id()
    running = 0
    try:
        for tid in os.listdir(task_dir):
            if int(tid) == main and main != caller:
                continue
            try:
                with open(f"{task_dir}/{tid}/stat") as f:
                    # the state follows the command name, which is in parentheses
                    running += f.read().rpartition(")")[2].split()[0] == "R"
            except (OSError, IndexError):
                continue  # a thread that ended while we looked
    except OSError:
        return 1
    return max(1, running)


def runnable_tasks(path: str = LOADAVG) -> int | None:
    """Tasks running or ready to run on the whole host now, or None where the kernel does not say
    (`/proc/loadavg`'s fourth field is `running/total`)."""
    try:
        with open(path) as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def compute_threads(cores: int, others: float) -> int:
    """Threads for the kernels when `others` other tasks want a core (smoothed): the idle cores,
    at least one, and one core short of all when there are more than two (the server's). A core
    counts as taken from `BUSY_AT` of a task on: one stray reading after a long step (weight ~0.5)
    costs a step at half speed if it is believed, and a real neighbour passes 0.75 by the second."""
    most = cores - 1 if cores > 2 else cores
    return max(1, min(most, cores - math.floor(others + 1 - BUSY_AT)))


@dataclass
class ThreadPolicy:
    """Sets torch's thread count before a step. `fixed`: that count always; else by load."""

    fixed: int | None = None
    adapt: bool = True  # False: the count chosen at start is kept (--batch-invariant, by default)
    # adapt only until a call is recorded here, then keep the count that call ran at
    until_torch: TorchCalls | None = None
    cores: int = field(default_factory=cores_owned)
    read_runnable: Callable[[], int | None] = runnable_tasks
    read_own: Callable[[], int] = own_running_threads
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    _others: float | None = None
    _checked: float = float("-inf")
    _threads: int = 0

    def start(self) -> int:
        """Choose and set the count at start-up (a fraction of a second of readings); returns it."""
        if self.fixed is not None:
            return self._set(self.fixed)
        readings = []
        for i in range(START_READINGS):
            if i:
                self.sleep(START_SPACING_S)
            readings.append(self.read_runnable())
        known = [r for r in readings if r is not None]
        self._checked = self.clock()
        own = self.read_own()
        self._others = max(0.0, sum(known) / len(known) - own) if known else 0.0
        return self._set(compute_threads(self.cores, self._others))

    def before_step(self) -> int:
        """Re-check the host's load when due (adaptive only); returns the count in use."""
        if self.adapting and self.clock() - self._checked >= CHECK_EVERY_S:
            self._set(self._by_load())
        return self._threads

    def adapt_until_torch(self, calls: TorchCalls) -> None:
        """Follow the load while `calls` is empty (--batch-invariant over native kernels)."""
        self.adapt, self.until_torch = True, calls

    @property
    def adapting(self) -> bool:
        """Whether the count follows the load now."""
        return (
            self.fixed is None
            and self.adapt
            and not (self.until_torch is not None and self.until_torch.ops)
        )

    def _by_load(self) -> int:
        now, last = self.clock(), self._checked
        self._checked = now
        # ours first: a worker that stops spinning between the two readings then counts for
        # neither, instead of for a neighbour
        own = self.read_own()
        running = self.read_runnable()
        if running is None:
            return compute_threads(self.cores, 0)
        others = max(0, running - own)  # less ours: this reader, the kernels' spinning workers
        if self._others is None:
            self._others = float(others)
        else:
            weight = 1.0 - math.exp(-(now - last) / SMOOTHING_S)
            self._others += weight * (others - self._others)
        return compute_threads(self.cores, self._others)

    def _set(self, threads: int) -> int:
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads
        return threads
