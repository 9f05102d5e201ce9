"""Large inputs never stall the event loop or the memory: /health keeps answering within 200 ms
while a 7 MB prompt and a 300 MB chunked body are refused, and the server's memory grows by no
more than the body limit."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from server_harness import running_server

MODEL = "smollm2-135m"
HEALTH_BUDGET_S = 0.2
PAGE = 4096


@pytest.fixture(scope="module")
def server(smollm_engine):
    with running_server(smollm_engine, MODEL) as srv:
        yield srv


@contextlib.contextmanager
def health_latencies(base_url: str) -> Iterator[list[float]]:
    """Time /health over and over, on a connection of its own, until the block ends."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base_url, timeout=10) as client:
            while not done.is_set():
                t0 = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    while not latencies and thread.is_alive():
        time.sleep(0.01)
    try:
        yield latencies
        time.sleep(0.1)  # and a few more answers after the work
    finally:
        done.set()
        thread.join(30)


def in_background(fn: Callable[[], object]) -> Callable[[], object]:
    """Start `fn` on a thread; the returned callable waits for and returns its result."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()

    def wait() -> object:
        thread.join(300)
        return result[0]

    return wait


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_health_answers_while_a_7mb_prompt_is_refused(server, route):
    prompt = "All work and no play makes Jack a dull boy. " * 160_000  # 7 MB
    body = {"model": MODEL, "max_tokens": 1}
    if route == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    # Encoded here: the server shares this process (and its GIL) with the test's client.
    content = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    with health_latencies(server.base_url) as latencies:
        answer = in_background(
            lambda: httpx.post(
                server.base_url + route, content=content, headers=headers, timeout=300
            )
        )
        response = answer()
    assert response.status_code == 400, response.text
    assert "characters" in response.json()["error"]["message"]
    assert max(latencies) < HEALTH_BUDGET_S, sorted(latencies)[-5:]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def send_chunked(base_url: str, total: int, chunk: bytes) -> tuple[bytes, int]:
    """POST `total` bytes as a chunked body from one reused buffer; (the answer, bytes sent).
    The answer is read while sending, as a server that refuses early answers mid-body."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    answer = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                answer.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    try:
        sock.sendall(head.encode())
        while sent < total:
            sock.sendall(frame)
            sent += len(chunk)
        sock.sendall(b"0\r\n\r\n")
    except OSError:  # the server closed the connection after its 413
        pass
    reader.join(60)
    sock.close()
    return bytes(answer), sent


def test_a_300mb_chunked_body_is_refused_without_buffering_it(server):
    limit = 8 * 2**20  # ServerConfig's default max_body_bytes
    chunk = b'{"messages": "' + b"x" * (2**20 - 14)
    peak = [resident_bytes()]
    baseline = peak[0]
    with health_latencies(server.base_url) as latencies:
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], resident_bytes())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        answer, sent = send_chunked(server.base_url, 300 * 2**20, chunk)
        stop.set()
        sampler.join()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 300 * 2**20  # the server hung up instead of reading it all
    assert peak[0] - baseline < limit, (peak[0] - baseline) / 2**20
    assert max(latencies) < HEALTH_BUDGET_S, sorted(latencies)[-5:]


def test_a_small_body_is_served_after_the_large_ones(server):
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200
