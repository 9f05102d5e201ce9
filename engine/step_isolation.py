"""Keeping one request's failure out of the other requests' step.

When running a step raises, the step is run again one request at a time to find the requests
whose own step raises (a sampling tensor that cannot be built, a grammar that throws...). Those
are failed alone; the others run once more as one batch. Running a step again is safe: a forward
writes only the KV slots of the tokens it computes (the same tokens at the same positions), block
copies are idempotent, and preparing or sampling changes no sequence state.

An error that no request causes alone, a device error (it poisons the device context) and
anything that is not an `Exception` stay fatal to the engine, as does any error outside the
runner (the scheduler's or block manager's state could be inconsistent).

Not here: running a step (model_runner.py) or applying its results (llm_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepserve.engine.request import Request
from deepserve.engine.scheduler import SchedulerOutput

Execute = Callable[[SchedulerOutput], object]


def is_fatal(error: BaseException) -> bool:
    """True for errors the engine cannot blame on a request."""
    return not isinstance(error, Exception) or isinstance(
        error, MemoryError | torch.AcceleratorError
    )


def requests_of(out: SchedulerOutput) -> list[Request]:
    """The requests scheduled in `out`, in order of their first chunk."""
    seen: dict[int, Request] = {}
    for item in out.scheduled:
        seen.setdefault(id(item.seq.request), item.seq.request)
    return list(seen.values())


def only(out: SchedulerOutput, keep: Callable[[Request], bool]) -> SchedulerOutput:
    """The part of `out` that belongs to the requests `keep` accepts: their chunks, forks and the
    block copies into their forked samples' blocks."""
    scheduled = [item for item in out.scheduled if keep(item.seq.request)]
    forks = [f for f in out.forks if keep(f.parent.request)]
    children_blocks = {b for f in forks for child in f.children for b in child.block_table}
    copies = [c for c in out.block_copies if c[1] in children_blocks]
    return SchedulerOutput(scheduled, forks, copies, list(out.preempted))


def find_failing(out: SchedulerOutput, execute: Execute) -> dict[int, tuple[Request, Exception]]:
    """Run `out` one request at a time; the requests whose own step raised, by id."""
    failing: dict[int, tuple[Request, Exception]] = {}
    for request in requests_of(out):
        try:
            execute(only(out, lambda r, request=request: r is request))
        except Exception as e:
            if is_fatal(e):
                raise
            failing[id(request)] = (request, e)
    return failing
