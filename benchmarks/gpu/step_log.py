"""A log of every step the engine runs (when, rows, new tokens, graph replay or eager, launched
ahead of the previous step's ids or not), for the serving benchmark: do HTTP's steps carry fewer
rows than offline's, how many are eager, and how often async scheduling fell back?

`install(path)` wraps `ModelRunner.launch` (every step goes through it, synchronous or launched
ahead) to append one line per step to `path`; `summary(path, t0, t1)` reads the steps started in
a window of wall-clock time. Run as a module it installs the log in a `deepserve` server
process: `python3 step_log.py LOG serve ARGS...` runs `deepserve serve ARGS...`.
Benchmark code only: the engine itself keeps no such log.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path


def install(path: Path):
    """Start logging; returns a function that stops it."""
    from deepserve.engine.model_runner import ModelRunner

    plain = ModelRunner.launch
    sink = Path(path).open("a", buffering=1)  # noqa: SIM115 (open until `stop`)

    def launch(self, out, on_launched=None, feed=None, **kw):
        graph, ahead = int(self._replayable(out)), int(feed is not None)
        sink.write(f"{time.time():.6f} {len(out.scheduled)} {out.num_tokens} {graph} {ahead}\n")
        return plain(self, out, on_launched, feed, **kw)

    ModelRunner.launch = launch

    def stop() -> None:
        ModelRunner.launch = plain
        sink.close()

    return stop


def summary(path: Path, t0: float, t1: float) -> dict:
    steps, times = [], []
    for line in Path(path).read_text().splitlines():
        t, rows, tokens, graph, ahead = line.split()
        if t0 <= float(t) <= t1:
            steps.append((int(rows), int(tokens), graph == "1", ahead == "1"))
            times.append(float(t))
    # Launch-to-launch gaps over 10 ms: the engine idle or in a long (eager) step.
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b - a > 0.01]
    graph = [s for s in steps if s[2]]
    eager = [s for s in steps if not s[2]]

    def mean(values: list[int]) -> float:
        return round(statistics.fmean(values), 2) if values else 0.0

    return dict(
        steps=len(steps), graph_steps=len(graph), eager_steps=len(eager),
        launched_ahead=sum(s[3] for s in steps),
        rows_per_graph_step=mean([s[0] for s in graph]),
        rows_per_eager_step=mean([s[0] for s in eager]),
        tokens_per_eager_step=mean([s[1] for s in eager]),
        graph_rows_hist=_hist([s[0] for s in graph]),
        window_s=round(t1 - t0, 3),
        long_gaps=len(gaps), long_gaps_s=round(sum(gaps), 3),
        # each eager step: ms from the window's start, rows, tokens
        eager_timeline=[[round((t - t0) * 1000, 1), s[0], s[1]]
                        for t, s in zip(times, steps, strict=True) if not s[2]],
    )  # fmt: skip


def _hist(values: list[int]) -> dict[str, int]:
    edges = (1, 8, 16, 32, 48, 63, 64)
    out: dict[str, int] = {}
    for v in values:
        key = next((f"<={e}" for e in edges if v <= e), f">{edges[-1]}")
        out[key] = out.get(key, 0) + 1
    return out


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    from deepserve.server.cli import main

    sys.argv = ["deepserve", *sys.argv[2:]]
    sys.exit(main())
