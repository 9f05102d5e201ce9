"""The event loop never waits on a model step: /health answers fast while 32 streams decode."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest
from server_harness import running_server, smollm_engine

MODEL = "smollm2-135m"
__all__ = ["smollm_engine"]


@pytest.mark.slow
def test_health_answers_under_50ms_while_32_streams_run(smollm_engine):
    with running_server(smollm_engine, MODEL) as srv:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 24,
            "temperature": 0.8,
            "seed": 1,
            "stream": True,
        }
        started = threading.Barrier(33)

        def stream() -> None:
            with httpx.stream(
                "POST", srv.base_url + "/v1/chat/completions", json=body, timeout=300
            ) as r:
                lines = r.iter_lines()
                next(lines)
                started.wait()
                for _ in lines:
                    pass

        threads = [threading.Thread(target=stream) for _ in range(32)]
        for t in threads:
            t.start()
        started.wait(timeout=120)
        latencies = []
        with httpx.Client(base_url=srv.base_url) as client:
            while smollm_engine.load().running > 0 and len(latencies) < 40:
                t0 = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
        for t in threads:
            t.join()
    assert len(latencies) >= 10
    assert statistics.median(latencies) < 0.05, latencies
    assert sorted(latencies)[int(0.9 * len(latencies))] < 0.05, latencies
