"""`WorkerClient`: the async HTTP client for one worker's internal API (NDJSON streams over
disagg/http1.py's keep-alive connections; httpx for the other calls).

Every call carries the shared secret and a bounded timeout: connecting, the wait for the first
event (a worker sends its headers with it), and the gap between events. Transport failures and
5xx become `WorkerUnavailableError`; 4xx become `WorkerRejectedError`. Not here: which worker to
call (router/) or the PD flow (disagg/flow.py).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from deepserve.disagg import protocol
from deepserve.disagg.errors import WorkerRejectedError, WorkerUnavailableError
from deepserve.disagg.http1 import Http1Error, Http1Pool, Response


@dataclass(frozen=True)
class ClientTimeouts:
    connect: float = 2.0
    control: float = 5.0  # abort, load, health
    first_event: float = 120.0  # queueing + prefill on a busy CPU worker
    between_events: float = 30.0


class WorkerClient:
    def __init__(self, url: str, token: str, timeouts: ClientTimeouts | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeouts = timeouts or ClientTimeouts()
        t = self.timeouts
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=protocol.bearer(token),
            timeout=httpx.Timeout(t.control, connect=t.connect),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._streams = Http1Pool(self.url, protocol.bearer(token))  # the generate hot path

    async def close(self) -> None:
        await self._streams.close()
        await self._http.aclose()

    async def generate(self, req: protocol.GenerateRequest) -> AsyncIterator[protocol.StreamEvent]:
        """Stream the worker's events for `req`; raise on failure, never end silently early.
        Every read waits at most `between_events`; the first event at most `first_event`."""
        t = self.timeouts
        body = json.dumps(req.to_json(), separators=(",", ":")).encode()
        started = False
        try:
            # A worker sends its headers with the first event (server/worker.py).
            async with self._streams.post(
                protocol.GENERATE_PATH, body, t.connect, t.first_event
            ) as resp:
                if resp.status >= 400:
                    raise _status_error(resp.status, await resp.read(t.control), self.url)
                events = _Events(resp, t.between_events)
                async with asyncio.timeout(t.first_event):
                    event = await events.next()
                while event is not None:
                    _raise_for_event_error(event, started)
                    started = started or any(o["token_ids"] for o in event.outputs)
                    if event.finished:
                        # Read the body's end before handing over the last event: a consumer
                        # that stops there would otherwise close the connection, not reuse it.
                        await events.skip_rest()
                        yield event
                        return
                    yield event
                    event = await events.next()
                raise WorkerUnavailableError(f"{self.url}: stream ended early", started)
        except (OSError, TimeoutError, Http1Error) as e:
            raise WorkerUnavailableError(f"{self.url}: {type(e).__name__}: {e}", started) from e

    async def abort(self, request_id: str) -> None:
        await self._post(protocol.ABORT_PATH, {"request_id": request_id})

    async def load(self) -> protocol.WorkerLoad:
        return protocol.WorkerLoad.from_json(await self._get(protocol.LOAD_PATH))

    async def health(self) -> protocol.WorkerHealth:
        return protocol.WorkerHealth.from_json(await self._get(protocol.HEALTH_PATH))

    async def model_card(self) -> dict:
        return await self._get(protocol.MODEL_PATH)

    async def metrics(self) -> str:
        resp = await self._request("GET", protocol.METRICS_PATH)
        return resp.text

    async def _get(self, path: str) -> dict:
        return (await self._request("GET", path)).json()

    async def _post(self, path: str, body: dict) -> dict:
        return (await self._request("POST", path, json=body)).json()

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise WorkerUnavailableError(f"{self.url}{path}: {type(e).__name__}: {e}") from e
        await _raise_for_status(resp)
        return resp


class _Events:
    """The `StreamEvent`s of one NDJSON body. Plain methods, not async generators: every event
    of every routed request passes here. Lines stay bytes (JSON parses bytes)."""

    def __init__(self, resp: Response, between_events: float) -> None:
        self._resp = resp
        self._timeout = between_events
        self._lines: deque[bytes] = deque()
        self._pending = b""
        self._ended = False

    async def next(self) -> protocol.StreamEvent | None:
        line = await self._next_line()
        return None if line is None else protocol.StreamEvent.from_json(json.loads(line))

    async def skip_rest(self) -> None:
        while await self._next_line() is not None:
            pass

    async def _next_line(self) -> bytes | None:
        while not self._lines:
            if self._ended:
                return None
            chunk = await self._resp.next_chunk(self._timeout)
            if chunk is None:
                self._ended = True
                chunk = b"\n"  # the last line may lack its newline
            *lines, self._pending = (self._pending + chunk).split(b"\n")
            self._lines.extend(line for line in lines if line.strip())
        return self._lines.popleft()


def _raise_for_event_error(event: protocol.StreamEvent, started: bool) -> None:
    if event.error is None:
        return
    if event.rejected:  # the request failed for its own content: another worker would too
        raise WorkerRejectedError(event.error)
    raise WorkerUnavailableError(f"worker error: {event.error}", started)


async def _raise_for_status(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    await resp.aread()
    raise _status_error(resp.status_code, resp.content, str(resp.url))


def _status_error(status: int, body: bytes, where: str) -> Exception:
    message = _error_message(body) or f"status {status}"
    # A wrong secret is the deployment's fault and overload is the worker's: neither is the request's.
    if status < 500 and status not in (401, 403, 429):
        return WorkerRejectedError(message, status)
    return WorkerUnavailableError(f"{where}: {status} {message}")


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:500].decode(errors="replace")
